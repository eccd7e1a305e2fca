"""The `zero/` folder of a universal checkpoint: which states each parameter has, the tensor index, and the
structural checks.

`ds_to_universal` (DeepSpeed 0.19, `deepspeed/checkpoint/ds_to_universal.py`) writes one folder per
parameter, each state a whole tensor in a torch.save file of its own:

- ZeRO 1-2 (`merge_tp_slices`): `fp32.pt`, `exp_avg.pt` and `exp_avg_sq.pt` hold `{"param": tensor,
  "cat_dim": 0}` with the parameter's shape, and `step.pt` the optimizer's step (a 0-dim tensor) when it
  keeps one. A parameter the optimizer holds no fragment of gets a `fp32.pt` of its module weights only.
- ZeRO-3 (`merge_zero3_slices`): `fp32.pt`, `exp_avg.pt` and `exp_avg_sq.pt` hold the flat tensor itself
  (the parameter's elements, row-major) and there is no `step.pt`: the step stays in `optimizer_state.pt`.
  Frozen parameters get no folder; their fragments stay in the model states.

`zero/optimizer_state.pt` holds the optimizer's global state (ZeRO 1-2: loss scaler, `param_groups`, ...;
ZeRO-3: rank 0's whole optimizer state dict, whose `state` holds each group's `step`). DeepSpeed's
`load_hp_checkpoint_state` loads every `*.pt` of a parameter's folder; the folder of a trainable parameter
without its `fp32.pt` leaves that parameter's master weights unrestored.

Everything is read through `formats.torch_pickle` (each file's `data.pkl` and zip directory, never the
tensors' bytes, and never an unpickler that runs code). The index is named as a ZeRO tag's is
(`families.zero_tag.tensor_index`): the model under the module's names, ZeRO 1-2's fp32 copies as
`optimizer.fp32.<name>`, the optimizer state as `optimizer.state.<name>.<state>`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import ChunkEncoding, Component, Problem, ProblemKind, TensorChunk, TensorEntry
from ckptctl.contract.base import LISTED_ABSENT
from ckptctl.errors import CkptctlError
from ckptctl.families.torch_file import torch_file_problems
from ckptctl.families.zero_tag.names import UNIVERSAL_STATES_DIR
from ckptctl.families.zero_tag.tag import DeepSpeedTag, base_state
from ckptctl.families.zero_tag.tensor_index import IndexBuilder, param_groups
from ckptctl.formats.chunks import coverage_problems
from ckptctl.formats.torch_pickle import TorchPickle, open_torch_pickle
from ckptctl.formats.torch_pickle_classes import TensorRef

__all__ = [
    "MOMENTS",
    "OPTIMIZER_STATE",
    "ZERO_DIR",
    "UniversalStates",
    "ZeroFolder",
    "state_file",
    "trainable_shapes",
    "universal_index",
    "verify_states",
    "zero_folder",
]

ZERO_DIR = UNIVERSAL_STATES_DIR
OPTIMIZER_STATE = f"{ZERO_DIR}/optimizer_state.pt"
#: The states every trainable parameter's folder holds (its fp32 master weights and Adam's moments).
MOMENTS = ("fp32", "exp_avg", "exp_avg_sq")
_STEP = "step"
_FP32 = "fp32"


@dataclass(frozen=True, slots=True)
class ZeroFolder:
    """The `zero/` folder of a universal checkpoint, from the listing of the checkpoint's files.

    Attributes:
        params: parameter name -> its state files (state name, `fp32`, `exp_avg`, ..., -> size in bytes).
        optimizer_state: the size of `zero/optimizer_state.pt`, None when it is missing.
        others: any other file below `zero/` (relative to the checkpoint).
    """

    params: dict[str, dict[str, int]]
    optimizer_state: int | None
    others: tuple[str, ...]


def zero_folder(files: Mapping[str, int]) -> ZeroFolder:
    """The `zero/` folder among a checkpoint's files (relative path with `/` -> size)."""
    params: dict[str, dict[str, int]] = {}
    optimizer_state = None
    others = []
    for rel, size in files.items():
        parts = rel.split("/")
        if parts[0] != ZERO_DIR:
            continue
        if rel == OPTIMIZER_STATE:
            optimizer_state = size
        elif len(parts) == 3 and parts[2].endswith(".pt"):
            params.setdefault(parts[1], {})[parts[2].removesuffix(".pt")] = size
        else:
            others.append(rel)
    return ZeroFolder(params, optimizer_state, tuple(sorted(others)))


def state_file(name: str, state: str) -> str:
    """The file of one state of one parameter, relative to the checkpoint."""
    return f"{ZERO_DIR}/{name}/{state}.pt"


class UniversalStates:
    """The state files of a universal checkpoint, each parsed once (its `data.pkl` and zip directory)."""

    def __init__(self, url: str, files: Mapping[str, int]) -> None:
        self.url = url
        self.files = files
        self.zero = zero_folder(files)
        self._opened: dict[str, TorchPickle] = {}

    def open(self, rel: str) -> TorchPickle:
        """One file, parsed once.

        Raises:
            UnsafePickle, CorruptCheckpoint: it does not parse safely.
        """
        found = self._opened.get(rel)
        if found is None:
            found = self._opened[rel] = open_torch_pickle(io.join(self.url, rel), self.files.get(rel))
        return found

    def tensor(self, name: str, state: str) -> TensorRef | None:
        """The tensor one state file holds (the `param` of ZeRO 1-2's dict, ZeRO-3's bare tensor); None when
        it holds none (a step saved as a number).

        Raises:
            UnsafePickle, CorruptCheckpoint: the file does not parse safely.
        """
        root = self.open(state_file(name, state)).root
        found = root.get("param") if isinstance(root, dict) else root
        return found if type(found) is TensorRef else None

    def entry(
        self, name: str, state: str, component: Component, shape: tuple[int, ...] | None, entry_name: str
    ) -> TensorEntry | None:
        """One state file as an index entry: the parameter's `shape` when the file holds it flat (ZeRO-3),
        the stored shape otherwise; None when the file holds no tensor.

        Raises:
            UnsafePickle, CorruptCheckpoint: the file does not parse safely.
        """
        ref = self.tensor(name, state)
        if ref is None:
            return None
        full = shape if shape is not None and len(ref.shape) == 1 and ref.numel == math.prod(shape) else ref.shape
        rel = state_file(name, state)
        found = self.open(rel).byte_range(ref)
        chunks: tuple[TensorChunk, ...] = ()
        if found is not None:
            chunks = (TensorChunk(rel, found[0], found[1] - found[0], (0,) * len(full), full, ChunkEncoding.RAW),)
        return TensorEntry(entry_name, component, ref.dtype, full, chunks)

    def optimizer_state(self) -> dict[str, Any]:
        """`zero/optimizer_state.pt` (empty when it is not a dict).

        Raises:
            UnsafePickle, CorruptCheckpoint: it is missing or does not parse safely.
        """
        root = self.open(OPTIMIZER_STATE).root
        return root if isinstance(root, dict) else {}


def trainable_shapes(tag: DeepSpeedTag) -> dict[str, tuple[int, ...]]:
    """The parameters the optimizer holds (`param_shapes` of the rank-0 model states), with their shapes
    (each model-parallel rank's own shard shapes when there are several); empty when none are recorded."""
    if tag.states.get("param_shapes") is None:
        return {}
    return {name: shape for group in param_groups(tag.states.get("param_shapes")) for name, shape in group.items()}


def universal_index(tag: DeepSpeedTag, states: UniversalStates) -> tuple[TensorEntry, ...]:
    """The tensor index of a universal checkpoint: the model (the module's weights where the model states
    hold them whole, as ZeRO 1-2 saves them, else the fp32 files), frozen parameters and buffers from the
    model states, and the optimizer state per parameter.

    Raises:
        UnsafePickle, CorruptCheckpoint: a file does not parse, or a frozen parameter's fragments are missing.
    """
    builder = IndexBuilder(tag, 0, "", "")
    shapes = trainable_shapes(tag)
    frozen = tag.states.get("frozen_param_shapes")
    frozen_names = set(frozen) if isinstance(frozen, dict) else set()
    buffer_names = tag.states.get("buffer_names")
    buffers = set(buffer_names) if isinstance(buffer_names, list) else set()
    model: list[TensorEntry] = []
    optimizer: list[TensorEntry] = []
    # Folders of parameters the optimizer holds no state of (ZeRO 1-2 writes their module weights as fp32).
    others = [n for n in states.zero.params if n not in shapes and n not in frozen_names and n not in buffers]
    for name in [*shapes, *others]:
        held = states.zero.params.get(name, {})
        shape = shapes.get(name)
        fp32 = states.entry(name, _FP32, Component.MODEL, shape, name) if _FP32 in held else None
        full = fp32.shape if fp32 is not None else shape or ()
        module_ref = builder.module.get(name)
        if type(module_ref) is TensorRef and module_ref.shape == full:
            model.append(builder._from_file(name, Component.MODEL, builder.model_file, module_ref))
            if fp32 is not None:
                optimizer.append(replace(fp32, name=f"optimizer.fp32.{name}", component=Component.OPTIMIZER))
        else:
            model.append(fp32 or TensorEntry(name, Component.MODEL, "float32", full, ()))
        for state in (*MOMENTS[1:], _STEP):
            if state in held:
                entry = states.entry(
                    name,
                    state,
                    Component.OPTIMIZER,
                    full if state != _STEP else None,
                    f"optimizer.state.{name}.{state}",
                )
                if entry is not None:
                    optimizer.append(entry)
    model += builder._frozen()
    model += builder._buffers(shapes)
    if states.zero.optimizer_state is not None:
        optimizer += _group_scalars(states)
    return (*model, *optimizer)


def _group_scalars(states: UniversalStates) -> list[TensorEntry]:
    """The 0-dim tensors of each group's state in `optimizer_state.pt` (ZeRO-3's `step`); the flat tensors
    beside them are rank 0's partitions only, which the parameter folders hold whole."""
    groups = base_state(states.optimizer_state()).get("state")
    out = []
    opened = states.open(OPTIMIZER_STATE)
    for group, values in groups.items() if isinstance(groups, dict) else ():
        for key, ref in values.items() if isinstance(values, dict) else ():
            if type(ref) is TensorRef and ref.shape == () and (found := opened.byte_range(ref)) is not None:
                chunk = TensorChunk(OPTIMIZER_STATE, found[0], found[1] - found[0], (), (), ChunkEncoding.RAW)
                out.append(
                    TensorEntry(f"optimizer.state.group{group}.{key}", Component.OPTIMIZER, ref.dtype, (), (chunk,))
                )
    return out


def verify_states(tag: DeepSpeedTag, states: UniversalStates) -> list[Problem]:
    """Structural problems of the `zero/` folder: `optimizer_state.pt` present and parsing; every trainable
    parameter's folder holding its fp32 weights and moments (and a step under ZeRO 1-2 when any parameter
    has one), each file parsing safely and holding every storage it names, with the parameter's shape
    (`param_shapes`; with several model-parallel ranks, the same shape for each state); folders of no
    parameter the model states know are warnings; then every tensor of the index covered.
    """
    zero = states.zero
    problems: list[Problem] = []
    if zero.optimizer_state is None:
        problems.append(
            Problem(
                ProblemKind.MISSING_FILE,
                OPTIMIZER_STATE,
                "the optimizer's global state is missing (DeepSpeed's universal load refuses to go on without it; "
                "ds_to_universal writes it after the parameters, so the conversion did not finish)",
            )
        )
    else:
        problems += _file_problems(states, OPTIMIZER_STATE)
    shapes = trainable_shapes(tag)
    steps = tag.zero_stage < 3 and any(_STEP in zero.params.get(name, {}) for name in shapes)
    wanted = (*MOMENTS, _STEP) if steps else MOMENTS
    absent = [(name, state) for name in shapes for state in wanted if state not in zero.params.get(name, {})]
    for name, state in absent[:LISTED_ABSENT]:
        problems.append(
            Problem(
                ProblemKind.MISSING_FILE,
                state_file(name, state),
                f"{state}.pt of {name} is missing: DeepSpeed's universal load does not restore the parameter's "
                f"{'fp32 master weights' if state == _FP32 else state}",
            )
        )
    if len(absent) > LISTED_ABSENT:
        problems.append(
            Problem(ProblemKind.MISSING_FILE, ZERO_DIR, f"{len(absent) - LISTED_ABSENT} more state files are missing")
        )
    module = tag.states.get("module")
    frozen = tag.states.get("frozen_param_shapes")
    known = (
        set(shapes) | set(module if isinstance(module, dict) else ()) | set(frozen if isinstance(frozen, dict) else ())
    )
    for name in sorted(set(zero.params) - known):
        problems.append(
            Problem(
                ProblemKind.UNEXPECTED_FILE,
                f"{ZERO_DIR}/{name}",
                f"{name} is no parameter of the model states (left by another conversion into this folder?)",
                severity="warning",
            )
        )
    for name in sorted(set(zero.params) & known):
        problems += _param_problems(states, name, shapes.get(name), tag.mp_world_size)
    if any(p.severity == "error" for p in problems):
        return problems
    try:
        index = universal_index(tag, states)
    except CkptctlError as exc:
        return [*problems, Problem(ProblemKind.COVERAGE, ZERO_DIR, exc.message)]
    return problems + coverage_problems(index)


def _param_problems(
    states: UniversalStates, name: str, shape: tuple[int, ...] | None, mp_world_size: int
) -> list[Problem]:
    """The state files of one parameter: each parses and holds its storages; the tensors agree in shape,
    with each other and with `param_shapes` (one model-parallel rank: the shards are the parameter)."""
    problems: list[Problem] = []
    found: dict[str, tuple[int, ...]] = {}
    for state in states.zero.params[name]:
        rel = state_file(name, state)
        file_problems = _file_problems(states, rel)
        problems += file_problems
        if file_problems:
            continue
        ref = states.tensor(name, state)
        if ref is None:
            if state != _STEP:
                problems.append(Problem(ProblemKind.BAD_METADATA, rel, f"{rel} holds no tensor"))
            continue
        if state != _STEP:
            found[state] = ref.shape
    if shape is not None and mp_world_size == 1:
        for state, stored in found.items():
            if stored != shape and not (len(stored) == 1 and stored[0] == math.prod(shape)):
                problems.append(
                    Problem(
                        ProblemKind.SIZE_MISMATCH,
                        state_file(name, state),
                        f"{state} of {name} has shape {list(stored)}, not the parameter's {list(shape)}",
                    )
                )
    elif len({math.prod(s) for s in found.values()}) > 1:
        problems.append(
            Problem(
                ProblemKind.SIZE_MISMATCH,
                f"{ZERO_DIR}/{name}",
                f"the states of {name} differ in size: "
                + ", ".join(f"{state} {list(s)}" for state, s in sorted(found.items())),
            )
        )
    return problems


def _file_problems(states: UniversalStates, rel: str) -> list[Problem]:
    _, problems = torch_file_problems(rel, partial(states.open, rel))
    return problems
