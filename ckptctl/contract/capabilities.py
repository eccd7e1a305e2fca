"""What a framework plugin provides besides its reader (DESIGN §1): small capability objects.

A framework package's reader is its `Layout` subclass (detect, open, index, verify, markers, pointers,
protections, resume profile). Anything else it can do is a capability, provided only where the framework
has it and declared in its registry entry (`ckptctl.layouts.Plugin`) as a dotted name that is imported on
first use, as Pillow registers an image plugin's opener and saver apart and fsspec names its
implementations. `ops/` asks `capability(layout, SLOT)` and never names a framework:

- `CONVERT_SOURCE` (`ConvertSource`): the model `convert` (and `diff`) read from a framework's checkpoints
  beyond their tensor index: master weights, name maps, the model spec, config;
- `SLIMMER` (`Slimmer`): what of its checkpoints `slim` drops (training-only state) and writes instead;
- `TRAINING_STATE_WRITER`, `POINTER_WRITER`: the slots `reshard` and `repair` fill;
- `TRAINING_STATE_SOURCE` (`TrainingStateSource`): a framework's training state parameter by parameter, which a
  writer of another framework's state reads (`reshard --to dcp` of a native or DeepSpeed state): plugins never
  import each other, so the writer asks `capability(source.layout, TRAINING_STATE_SOURCE)`.

A capability is typed by its slot: `capability(layout, CONVERT_SOURCE)` is a `ConvertSource` or None. The types
live by the command that uses them (`convert_source`, `reshard_state`, `rewrites`: repair's and slim's); this
module types the slots and is where plugins and `ops` import them from.
"""

from __future__ import annotations

from ckptctl.contract import slots
from ckptctl.contract.convert_source import (
    NO_NAME_MAP,
    Adapter,
    ConvertSource,
    DerivedTensor,
    HeadTask,
    HfModel,
    MasterWeights,
    MasterWeightsReader,
    ModelSpec,
    ModelTensors,
    NameMap,
    NativeModel,
    default_config_folders,
)
from ckptctl.contract.reshard_state import (
    NotCarried,
    ParamState,
    ReshardRequest,
    StateTensor,
    TrainingStateSource,
    TrainingStateWriter,
    WrittenState,
)
from ckptctl.contract.rewrites import OneLookSlimmer, Pointer, PointerWriter, Slimmer, SlimRecipe, SlimRewrite
from ckptctl.contract.slots import Slot

__all__ = [
    "CONVERT_SOURCE",
    "NO_NAME_MAP",
    "POINTER_WRITER",
    "SLIMMER",
    "TRAINING_STATE_SOURCE",
    "TRAINING_STATE_WRITER",
    "Adapter",
    "ConvertSource",
    "DerivedTensor",
    "HeadTask",
    "HfModel",
    "MasterWeights",
    "MasterWeightsReader",
    "ModelSpec",
    "ModelTensors",
    "NameMap",
    "NativeModel",
    "NotCarried",
    "OneLookSlimmer",
    "ParamState",
    "Pointer",
    "PointerWriter",
    "ReshardRequest",
    "SlimRecipe",
    "SlimRewrite",
    "Slimmer",
    "Slot",
    "StateTensor",
    "TrainingStateSource",
    "TrainingStateWriter",
    "WrittenState",
    "default_config_folders",
]


#: The capabilities a plugin may provide, by slot: `contract.slots`' objects, typed here by what fills them.
CONVERT_SOURCE: Slot[ConvertSource] = slots.CONVERT_SOURCE
TRAINING_STATE_WRITER: Slot[TrainingStateWriter] = slots.TRAINING_STATE_WRITER
TRAINING_STATE_SOURCE: Slot[TrainingStateSource] = slots.TRAINING_STATE_SOURCE
POINTER_WRITER: Slot[PointerWriter] = slots.POINTER_WRITER
SLIMMER: Slot[Slimmer] = slots.SLIMMER
