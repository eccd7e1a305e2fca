"""The layout registry: which layouts exist, in which order they are tried, and the capabilities each provides.

The registry holds dotted names: each framework plugin's reader (its `Layout` subclass) and the capabilities
it provides (`contract.capabilities`). Modules are imported on first use (as fsspec does with its
implementations), and detection imports the readers in registry order only until one recognises the folder,
so that a command that needs one layout does not pay for all of them.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

from ckptctl.contract.base import Layout
from ckptctl.contract.slots import (
    CONVERT_SOURCE,
    POINTER_WRITER,
    SLIMMER,
    TRAINING_STATE_SOURCE,
    TRAINING_STATE_WRITER,
    Slot,
)
from ckptctl.errors import CkptctlError, UnknownLayout
from ckptctl.formats.framework_classes import FrameworkClasses
from ckptctl.layouts.generic import GENERIC, TRAINING_STATE, generic_layout
from ckptctl.layouts.training_state_layout import training_state_layout

if TYPE_CHECKING:  # the capabilities are built where one is used (`contract.slots`)
    from ckptctl.contract.capabilities import TrainingStateWriter

__all__ = [
    "ConvertTarget",
    "Plugin",
    "all_layouts",
    "candidates",
    "capability",
    "file_layout_names",
    "framework_pickle_classes",
    "get_layout",
    "layout_names",
    "training_state_writer",
    "training_state_writers",
]

C = TypeVar("C")


@dataclass(frozen=True, slots=True)
class Plugin:
    """One registered layout: the reader of a framework plugin and the capabilities it provides, as names
    (`module:attribute`, the module in the plugin's package) imported on first use (Pillow's
    `register_open`/`register_save`, fsspec's `known_implementations`).

    Attributes:
        name: the layout's name (`Layout.name`), as `--layout` takes it.
        package: the framework's package.
        reader: its `Layout` subclass.
        capabilities: each slot it fills (`contract.capabilities`) -> the object that fills it.
        checkpoint_files: its reader's `checkpoint_files` (a test holds them equal), known without importing
            the reader, so that a file given as a checkpoint imports only the readers that may take it.
    """

    name: str
    package: str
    reader: str
    capabilities: Mapping[Slot[Any], str] = field(default_factory=dict)
    checkpoint_files: tuple[str, ...] = ()

    def load(self, target: str) -> Any:
        """The object `target` (`module:attribute` in the package) names, its module imported on first use."""
        return _load(f"{self.package}.{target}")


#: Tried in this order: the more specific layouts first. A native checkpoint also holds safetensors files an
#: HF reader would accept, and a native multi-rank one holds a DCP folder. AReaL's recover slot is a DCP
#: folder with a name of its own, a Megatron dist-ckpt folder is a DCP folder with Megatron's files beside it,
#: and a ROLL `checkpoint-N` holds `scheduler.pt` like a Trainer checkpoint: they come before the layouts
#: they would otherwise pass for. A Trainer `checkpoint-N` holds an HF model
#: folder and possibly a DeepSpeed tag folder, and is one checkpoint with all of them; so does an accelerate
#: `save_state` folder (its model file, DeepSpeed tag or FSDP DCP folders). OpenRLHF and
#: open-instruct tags ARE DeepSpeed tag folders, told apart by the files around them, so they come before
#: `deepspeed`, which takes the tags nothing else claims. A PEFT adapter folder holds safetensors an HF reader
#: would take for a model: `peft` comes before `hf`. A sharded Lightning `.ckpt/` folder is a DCP save with
#: Lightning's `meta.pt`: `lightning` comes before the DCP-based layouts. A DeepSpeed universal checkpoint
#: holds model-states files as a tag does, beside a `zero/` folder and without optim-states files: the tag
#: layouts leave such a folder alone (`families.zero_tag.names.is_universal`), so it can come last, after the layouts
#: people know. A verl `global_step_N/` (role folders of per-rank `*_world_size_W_rank_R.pt` files) and its role
#: folders look like no other layout's, but come early so that nothing generic claims a role folder's files.
#: A ByteCheckpoint `global_step_N/` holds `model/` and `optimizer/` folders shaped like DCP folders (their
#: `.metadata` pickles ByteCheckpoint's own class, which the DCP reader leaves alone): it comes early too.
#: The capabilities a plugin declares, each under the module name every plugin gives it (`convert.py`'s
#: `SOURCE`, `repair.py`'s `POINTER_WRITER`, ...), joined with `|` on its registry line.
CONVERT: Final[dict[Slot[Any], str]] = {CONVERT_SOURCE: "convert:SOURCE"}
REPAIR: Final[dict[Slot[Any], str]] = {POINTER_WRITER: "repair:POINTER_WRITER"}
RESHARD: Final[dict[Slot[Any], str]] = {TRAINING_STATE_WRITER: "reshard:WRITER"}
SLIM: Final[dict[Slot[Any], str]] = {SLIMMER: "slim:SLIMMER"}
STATE: Final[dict[Slot[Any], str]] = {TRAINING_STATE_SOURCE: "state:SOURCE"}

_REGISTRY: tuple[Plugin, ...] = (
    Plugin("native", "ckptctl.frameworks.native", "layout:NativeLayout", CONVERT | REPAIR | SLIM | STATE),
    Plugin("verl", "ckptctl.frameworks.verl", "layout:VerlLayout", CONVERT | REPAIR | RESHARD | SLIM | STATE),
    Plugin("bytecheckpoint", "ckptctl.frameworks.bytecheckpoint", "layout:BytecheckpointLayout"),
    Plugin("areal", "ckptctl.frameworks.areal", "layout:ArealLayout", CONVERT | REPAIR | SLIM),
    Plugin("roll", "ckptctl.frameworks.roll", "layout:RollLayout", SLIM),
    Plugin(
        "lightning",
        "ckptctl.frameworks.lightning",
        "layout:LightningLayout",
        CONVERT | REPAIR | SLIM,
        checkpoint_files=(".ckpt",),
    ),
    Plugin("megatron", "ckptctl.frameworks.megatron", "layout:MegatronLayout", CONVERT | REPAIR | SLIM | STATE),
    Plugin("torchtitan", "ckptctl.frameworks.torchtitan", "layout:TorchtitanLayout", CONVERT | REPAIR | SLIM),
    Plugin("dcp", "ckptctl.frameworks.dcp", "layout:DcpLayout", RESHARD | SLIM | STATE),
    Plugin("hf_trainer", "ckptctl.frameworks.hf_trainer", "layout:HfTrainerLayout", CONVERT | REPAIR | SLIM | STATE),
    Plugin("accelerate", "ckptctl.frameworks.accelerate", "layout:AccelerateLayout", CONVERT | SLIM),
    Plugin("openrlhf", "ckptctl.frameworks.openrlhf", "layout:OpenRlhfLayout", CONVERT | REPAIR | SLIM | STATE),
    Plugin(
        "open_instruct",
        "ckptctl.frameworks.open_instruct",
        "layout:OpenInstructLayout",
        CONVERT | REPAIR | SLIM | STATE,
    ),
    Plugin(
        "deepspeed", "ckptctl.frameworks.deepspeed", "layout:DeepSpeedLayout", CONVERT | REPAIR | RESHARD | SLIM | STATE
    ),
    Plugin("peft", "ckptctl.frameworks.peft", "layout:PeftLayout", CONVERT),
    Plugin("hf", "ckptctl.frameworks.hf", "layout:HfModelLayout", CONVERT),
    Plugin(
        "deepspeed_universal",
        "ckptctl.frameworks.deepspeed",
        "universal:DeepSpeedUniversalLayout",
        {CONVERT_SOURCE: "convert:UNIVERSAL_SOURCE"},
    ),
)


class ConvertTarget(enum.StrEnum):
    """The layouts `convert --to` writes (the values are their registry names)."""

    HF = "hf"
    DCP = "dcp"


_PLUGINS = {plugin.name: plugin for plugin in _REGISTRY}


def layout_names() -> list[str]:
    return [plugin.name for plugin in _REGISTRY]


@cache
def _load(target: str) -> Any:
    """The object `module:attribute` names (the module's dotted name), its module imported on first use."""
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


@cache
def get_layout(name: str) -> Layout:
    """The layout registered under `name`.

    One instance per name for the whole process: layouts hold no state of their own (what a scan learns
    lives in its `ScanContext`), so every operation can share them. `GENERIC` (`"unknown"`) names the generic
    reader of what no plugin claims (`layouts.generic`), which is asked after every plugin.
    """
    if name == GENERIC:
        return generic_layout()
    if name == TRAINING_STATE:
        return training_state_layout()
    plugin = _PLUGINS.get(name)
    if plugin is None:
        raise UnknownLayout(f"no layout named {name!r}", f"known layouts: {', '.join(layout_names())}")
    layout: Layout = plugin.load(plugin.reader)()
    return layout


def all_layouts() -> list[Layout]:
    return [get_layout(name) for name in layout_names()]


def candidates(layout: str | None) -> Iterator[Layout]:
    """`layout`'s reader, or every reader in registry order, each imported only when the one before it
    has not recognised what is being identified."""
    if layout:
        yield get_layout(layout)
        return
    for name in layout_names():
        yield get_layout(name)


def capability(layout: str | Layout, slot: Slot[C]) -> C | None:
    """The capability of `slot` that the framework of `layout` (a layout or its name) provides, imported on
    first use; None where it provides none.

    A reader outside the registry that is built on a registered one (a subclass of its `Layout`) has that
    one's capabilities, as it has its hooks; any other layout outside the registry (a single weights file)
    has none.

    Example: `capability(checkpoint.layout, CONVERT_SOURCE)` is the layout's `ConvertSource`, or None.
    """
    plugin = _PLUGINS.get(layout) if isinstance(layout, str) else _plugin_of(layout)
    target = None if plugin is None else plugin.capabilities.get(slot)
    return None if plugin is None or target is None else cast(C, plugin.load(target))


def training_state_writers() -> list[TrainingStateWriter]:
    """Every registered framework's training-state writer (`reshard`), each once, imported on first use."""
    return [cast("TrainingStateWriter", _load(name)) for name in _writers()]


def training_state_writer(target: str) -> TrainingStateWriter:
    """The training-state writer whose `target` is `target` (`reshard --to`).

    The writers of the frameworks whose name `target` starts with (`dcp`, `verl`, `deepspeed-universal`) are
    asked first, so that a reshard imports its own writer only, not every framework's.

    Raises:
        CkptctlError: no registered framework writes that target (the message names those that exist).
    """
    spelled = target.replace("-", "_")
    writers = _writers()
    for name in sorted(writers, key=lambda name: not spelled.startswith(writers[name])):
        writer = cast("TrainingStateWriter", _load(name))
        if writer.target == target:
            return writer
    known = ", ".join(sorted(writer.target for writer in training_state_writers())) or "none"
    raise CkptctlError(f"no framework writes a training state as {target!r}", f"--to takes: {known}")


def _writers() -> dict[str, str]:
    """The dotted name of every training-state writer, each once, in registry order -> its framework's name."""
    writers: dict[str, str] = {}
    for plugin in _REGISTRY:
        target = plugin.capabilities.get(TRAINING_STATE_WRITER)
        if target is not None:
            writers.setdefault(f"{plugin.package}.{target}", plugin.name)
    return writers


def _plugin_of(layout: Layout) -> Plugin | None:
    """The registry entry of `layout`: the one of its name, else the one of the nearest registered reader
    its class is built on (read off the class's bases, which imports nothing)."""
    plugin = _PLUGINS.get(layout.name)
    if plugin is not None:
        return plugin
    readers = {f"{plugin.package}.{plugin.reader}": plugin for plugin in _REGISTRY}
    return next(
        (readers[name] for cls in type(layout).__mro__ if (name := f"{cls.__module__}:{cls.__qualname__}") in readers),
        None,
    )


def framework_pickle_classes() -> list[FrameworkClasses]:
    """The classes each registered framework package lists in its `pickle_classes` module (where it has
    one): what the torch-pickle allowlist reads as inert stand-ins (`formats.framework_classes`)."""
    from ckptctl.contract.training_state import LONG_TAIL_LIBRARIES

    found = [LONG_TAIL_LIBRARIES]  # the generic reader's: libraries no framework package speaks for
    for plugin in _REGISTRY:
        module = f"{plugin.package}.pickle_classes"
        if importlib.util.find_spec(module) is not None:
            found.append(importlib.import_module(module).CLASSES)
    return found


def file_layout_names(name: str) -> list[str]:
    """The registered layouts whose checkpoints are files named like `name` (their `checkpoint_files`), in
    registry order, known without importing their readers."""
    return [plugin.name for plugin in _REGISTRY if name.endswith(plugin.checkpoint_files)]
