"""The layout registry: which layouts exist, in which order they are tried, and the run walker.

The registry holds dotted names: each framework plugin's reader (its `Layout` subclass) and the capabilities
it provides (`contract.capabilities`). Modules are imported on first use (as fsspec does with its
implementations), and detection imports the readers in registry order only until one recognises the folder,
so that a command that needs one layout does not pay for all of them.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import importlib
import importlib.util
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, Final, TypeVar, cast

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState
from ckptctl.contract.base import Layout
from ckptctl.contract.capabilities import (
    CONVERT_SOURCE,
    POINTER_WRITER,
    SLIMMER,
    TRAINING_STATE_SOURCE,
    TRAINING_STATE_WRITER,
    Slot,
    TrainingStateWriter,
)
from ckptctl.errors import CheckpointNotFound, CkptctlError, UnknownLayout
from ckptctl.formats.framework_classes import FrameworkClasses
from ckptctl.formats.slim_marker import SLIM_MARKER, SLIM_NOTE, is_slim_file
from ckptctl.layouts.generic import GENERIC, TRAINING_STATE, generic_layout, training_state_layout, unclaimed
from ckptctl.layouts.run_state import attach_run_state, run_state_files
from ckptctl.quoting import shell

__all__ = [
    "DEFAULT_SCAN_DEPTH",
    "ConvertTarget",
    "Layout",
    "Plugin",
    "ScanContext",
    "capability",
    "detect",
    "framework_pickle_classes",
    "get_layout",
    "layout_names",
    "open_checkpoint",
    "peek",
    "peek_dir",
    "pointed_children",
    "resolve",
    "scan_context",
    "scan_run",
    "training_state_writer",
    "training_state_writers",
]


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
#: layouts leave such a folder alone (`parts.zero_tag.names.is_universal`), so it can come last, after the layouts
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


#: How deep `list`, `verify` and `prune` look for checkpoints below a run folder: AReaL's recover slots sit
#: 6 levels below its `fileroot` (checkpoints/user/experiment/trial/default/recover_checkpoint).
DEFAULT_SCAN_DEPTH = 6

#: Folders never worth descending into when looking for checkpoints.
_SKIP_DIRS = frozenset({"__pycache__", ".git", ".hg", ".svn", "node_modules", ".ckptctl-trash", "wandb"})


# --------------------------------------------------------------------------------------------------
# The scan context: what one operation has learnt about the folders around the candidates it identified.
# --------------------------------------------------------------------------------------------------

_PEEK_LIMIT = 4096
_LISTING = "listing"
T = TypeVar("T")
C = TypeVar("C")


class ScanContext:
    """The peeks of one operation: listings of the folders around a candidate (its parent, its siblings),
    which some layouts need to tell apart frameworks that write the same files (an OpenRLHF tag from a
    plain DeepSpeed one), and facts derived from them.

    Owned by the operation that opens it with `scan_context()` (a scan, a `detect`, a command that scans
    and then opens every checkpoint it found) and dropped when that ends, so that nothing outlives the
    operation. A local folder's peek is keyed by its mtime as well, so that a folder that gained or lost
    entries within the operation is listed again; a remote one is listed once per context. Thread-safe:
    the walker's threads share their caller's context (`io.parallel_map` copies the context variables).
    """

    def __init__(self) -> None:
        self._peeks: dict[tuple[str, int], dict[Any, Any]] = {}
        self._lock = threading.Lock()

    def peek_dir(self, url: str) -> list[io.DirEntry] | None:
        """See the module function `peek_dir`."""
        slot = self._slot(url)
        return None if slot is None else slot[_LISTING]

    def peek(self, url: str, derive: Callable[[str, list[io.DirEntry]], T]) -> T | None:
        """See the module function `peek`."""
        slot = self._slot(url)
        if slot is None or slot[_LISTING] is None:
            return None
        with self._lock:
            if derive in slot:
                return cast(T, slot[derive])
        value = derive(url, slot[_LISTING])
        with self._lock:
            slot[derive] = value
        return value

    def _slot(self, url: str) -> dict[Any, Any] | None:
        version = 0
        if io.is_local(url):
            try:
                version = os.stat(io.local_path(url)).st_mtime_ns
            except OSError:
                return None
        key = (url, version)
        with self._lock:
            slot = self._peeks.get(key)
        if slot is not None:
            return slot
        try:
            listing: list[io.DirEntry] | None = io.list_dir(url)
        except CkptctlError:
            listing = None
        slot = {_LISTING: listing}
        with self._lock:
            if len(self._peeks) >= _PEEK_LIMIT:
                self._peeks.clear()
            self._peeks[key] = slot
        return slot


_current_scan: contextvars.ContextVar[ScanContext | None] = contextvars.ContextVar("ckptctl_scan", default=None)


@contextlib.contextmanager
def scan_context() -> Iterator[ScanContext]:
    """The scan context of the current operation: the one already open (a `detect` inside a scan shares
    the scan's), or a new one for the duration of the block."""
    active = _current_scan.get()
    if active is not None:
        yield active
        return
    context = ScanContext()
    token = _current_scan.set(context)
    try:
        yield context
    finally:
        _current_scan.reset(token)


def peek_dir(url: str) -> list[io.DirEntry] | None:
    """The listing of the folder at `url` (None when it is not a folder), listed once per scan context.

    Layouts call it for the parent or the siblings of a folder they are identifying, so a save folder of
    1,000 tags is listed once, not once per tag. Outside any scan context it lists the folder afresh.
    """
    return (_current_scan.get() or ScanContext()).peek_dir(url)


def peek(url: str, derive: Callable[[str, list[io.DirEntry]], T]) -> T | None:
    """`derive(url, listing)` for the folder at `url`, computed once per scan context like `peek_dir`
    (None when it is not a folder). For facts about a folder that every one of its children asks for
    (whether a save folder holds `best_*` tags), which would cost N x N on a folder of N checkpoints
    otherwise."""
    return (_current_scan.get() or ScanContext()).peek(url, derive)


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


def _candidates(layout: str | None) -> Iterator[Layout]:
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
    names = dict.fromkeys(
        f"{plugin.package}.{target}"
        for plugin in _REGISTRY
        if (target := plugin.capabilities.get(TRAINING_STATE_WRITER)) is not None
    )
    return [cast(TrainingStateWriter, _load(name)) for name in names]


def training_state_writer(target: str) -> TrainingStateWriter:
    """The training-state writer whose `target` is `target` (`reshard --to`).

    Raises:
        CkptctlError: no registered framework writes that target (the message names those that exist).
    """
    writers = training_state_writers()
    found = next((writer for writer in writers if writer.target == target), None)
    if found is None:
        known = ", ".join(sorted(writer.target for writer in writers)) or "none"
        raise CkptctlError(f"no framework writes a training state as {target!r}", f"--to takes: {known}")
    return found


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


# --------------------------------------------------------------------------------------------------
# What a folder is: the one identification every command goes through (the walker's, for each folder).
# --------------------------------------------------------------------------------------------------


def _identify(
    url: str, entries: Sequence[io.DirEntry], layout: str | None = None
) -> tuple[Layout, CheckpointRef] | None:
    """The first layout (in registry order, or only `layout`) that recognises the folder, and its ref."""
    for candidate in _candidates(layout):
        ref = candidate.identify(url, entries)
        if ref is not None:
            return candidate, _slim_state(ref, entries)
    return None


#: States a slim marker overrides: the layout may take a checkpoint without its optimizer for a broken one.
_SLIMMABLE_STATES = frozenset({CheckpointState.COMPLETE, CheckpointState.BROKEN})


def _slim_state(ref: CheckpointRef, entries: Sequence[io.DirEntry]) -> CheckpointRef:
    """`ref` as state `slim` when its folder holds the marker `ckptctl slim` writes last (whatever layout it
    is: the marker is the same for all), so that every command reads it as slim."""
    if ref.state in _SLIMMABLE_STATES and any(e.name == SLIM_MARKER and not e.is_dir for e in entries):
        return replace(ref, state=CheckpointState.SLIM, note=SLIM_NOTE)
    return ref


def _slim_file_state(ref: CheckpointRef, entry: io.DirEntry) -> CheckpointRef:
    """`ref` as state `slim` when the one-file checkpoint is one `ckptctl slim` wrote (the marker is inside it:
    `formats.slim_marker.is_slim_file`, a read of its last bytes)."""
    if ref.state in _SLIMMABLE_STATES and is_slim_file(ref.url, entry.size):
        return replace(ref, state=CheckpointState.SLIM, note=SLIM_NOTE)
    return ref


def pointed_children(url: str, entries: Sequence[io.DirEntry]) -> set[str]:
    """The children of `url` that a `latest`-style pointer in it names (any layout's; the generic reader's
    links and tracker files where no layout's pointer names one)."""
    found = {io.join(url, name) for layout in all_layouts() if (name := layout.latest_pointer(url, entries))}
    present = {io.join(url, e.name) for e in entries}
    if not found & present and (name := generic_layout().latest_pointer(url, entries)):
        found.add(io.join(url, name))
    return found


def _identify_file(url: str, entry: io.DirEntry, layout: str | None = None) -> tuple[Layout, CheckpointRef] | None:
    """The first layout (in registry order, or only `layout`) whose checkpoints are files like `entry`, and
    the file's ref when it recognises it."""
    names = [layout] if layout else [p.name for p in _REGISTRY if entry.name.endswith(p.checkpoint_files)]
    for candidate in map(get_layout, names):
        if candidate.checkpoint_files and entry.name.endswith(candidate.checkpoint_files):
            ref = candidate.identify_file(url, entry)
            if ref is not None:
                return candidate, _slim_file_state(ref, entry)
    return None


def _file_checkpoints(url: str, entries: Sequence[io.DirEntry]) -> list[CheckpointRef]:
    """The files of the folder `url` that are whole checkpoints (hidden ones are staging files)."""
    endings = tuple(ending for layout in all_layouts() for ending in layout.checkpoint_files)
    if not endings:
        return []
    found = []
    for entry in entries:
        if not entry.is_dir and entry.name.endswith(endings) and not entry.name.startswith("."):
            hit = _identify_file(io.join(url, entry.name), entry)
            if hit is not None:
                found.append(hit[1])
    return found


def detect(url: str, layout: str | None = None, *, explain: bool = True) -> tuple[Layout, CheckpointRef]:
    """The layout of the checkpoint at `url` and its ref: a folder (itself, also when it holds other
    checkpoints: see `scan_run`), or a single weights file (see `layouts.single_file`).

    Raises:
        CheckpointNotFound: the folder does not exist.
        UnknownLayout: no layout recognises it (the message lists what was tried, and says when the
            folder looks like a run holding checkpoints rather than a checkpoint).
    """
    if not io.is_dir(url):
        return _detect_file(url, layout)
    with scan_context():
        entries = io.list_dir(url)
        hit = _identify(url, entries, layout) or _unknown(url, entries, layout)
        if hit is not None:
            return hit
        raise _not_a_checkpoint(url, entries, layout, explain)


def _unknown(url: str, entries: Sequence[io.DirEntry], layout: str | None) -> tuple[Layout, CheckpointRef] | None:
    """The generic reader's ref of a folder no plugin recognised, when no layout was asked for."""
    ref = generic_layout().identify(url, entries) if layout is None else None
    return None if ref is None else (get_layout(ref.layout), ref)


def _detect_file(url: str, layout: str | None) -> tuple[Layout, CheckpointRef]:
    """A file a layout takes for a whole checkpoint (`Layout.identify_file`), a single weights file, or the
    error that says what to pass instead."""
    if io.exists(url):
        from ckptctl.layouts.single_file import detect_file

        name = io.name_of(url)
        entry = next((e for e in peek_dir(io.parent_of(url)) or () if e.name == name and not e.is_dir), None)
        hit = _identify_file(url, entry, layout) if entry is not None else None
        if hit is not None:
            return hit
        if layout is not None:
            raise UnknownLayout(f"{url} is a file: --layout {layout} names a folder layout", "leave out --layout")
        return detect_file(url)
    raise CheckpointNotFound(f"no such checkpoint folder: {url}")


def _not_a_checkpoint(url: str, entries: Sequence[io.DirEntry], layout: str | None, explain: bool) -> UnknownLayout:
    tried = layout or ", ".join(layout_names())
    hint = "check the path"
    # The hint costs a scan of the folder: callers that only ask "is this a checkpoint?" skip it.
    if explain and layout is None and any(e.is_dir for e in entries):
        inner = scan_run(url, max_depth=2)
        if inner:
            hint = f"this looks like a run folder with {len(inner)} checkpoint(s); use `{shell('ckptctl', 'list', url)}` or pass one of them"
    return UnknownLayout(f"{url} is not a checkpoint of any known layout (tried: {tried})", hint)


def resolve(url: str, layout: str | None = None) -> tuple[Layout, CheckpointRef]:
    """The one checkpoint a command that takes a checkpoint (`inspect`, `convert`, `diff`) acts on.

    The folder itself when it is a checkpoint, also when it holds others (the final model of an HF
    Trainer `output_dir` beside its `checkpoint-N/`); else the checkpoint that a `latest`-style pointer in
    it names (a DeepSpeed save folder: the tag its `latest` names; a Lightning `dirpath`: `last.ckpt`), as
    `scan_run` marks it.

    Args:
        url: the folder.
        layout: consider this layout only instead of trying each.

    Raises:
        CheckpointNotFound: the folder does not exist.
        UnknownLayout: neither the folder nor what a pointer in it names is a checkpoint.
    """
    if not io.is_dir(url):
        return _detect_file(url, layout)
    with scan_context():
        entries = io.list_dir(url)
        hit = _identify(url, entries, layout)
        if hit is not None:
            return hit
        folders = {io.join(url, e.name) for e in entries if e.is_dir}
        files = {io.join(url, e.name): e for e in entries if not e.is_dir}
        pointed = pointed_children(url, entries)
        named = [
            found
            for child in sorted(pointed & folders)
            if (found := _identify(child, io.list_dir(child), layout)) is not None
        ]
        named += [
            found for child in sorted(pointed & set(files)) if (found := _identify_file(child, files[child], layout))
        ]
        if len(named) == 1:
            return named[0]
        if len(named) > 1:  # a DeepSpeed save folder's `latest` and `latest_universal`
            names = ", ".join(f"{io.name_of(ref.url)} ({found.name})" for found, ref in named)
            raise UnknownLayout(f"{url} is not a checkpoint; pointers in it name {names}", "pass one of them")
        unknown = _unknown(url, entries, layout)
        if unknown is not None:
            return unknown
        raise _not_a_checkpoint(url, entries, layout, explain=True)


def open_checkpoint(url: str, layout: str | None = None) -> Checkpoint:
    """Open the checkpoint `resolve(url, layout)` names (state `slim` when `ckptctl slim` made it so)."""
    found, ref = resolve(url, layout)
    checkpoint = found.open(ref.url)
    if ref.state is CheckpointState.SLIM and checkpoint.ref.state is not CheckpointState.SLIM:
        checkpoint = replace(checkpoint, ref=replace(checkpoint.ref, state=ref.state, note=ref.note))
    return checkpoint


# --------------------------------------------------------------------------------------------------
# The run walk.
# --------------------------------------------------------------------------------------------------


def scan_run(url: str, max_depth: int = DEFAULT_SCAN_DEPTH) -> list[CheckpointRef]:
    """Every checkpoint at or below `url` (the folder itself included), in whatever nesting the run uses.

    A folder can be a checkpoint and hold checkpoints (an HF Trainer `output_dir` with the final model
    beside `checkpoint-N/`; a DCP or DeepSpeed run with an exported model beside its steps). A folder
    recognised as a checkpoint is recorded, and its child folders that are not part of it (the layout's
    `members`) are walked on; the ref names those that hold checkpoints in `CheckpointRef.holds`, and
    comes before them. In a folder that is no checkpoint, files a layout takes for whole checkpoints
    (`Layout.identify_file`: Lightning's `epoch=0-step=100.ckpt`) are listed too, and after every plugin the
    generic reader (`layouts.generic.unclaimed`) lists checkpoint-like files none of them claims, as state
    `unknown`: a step-named file on its own, the others as their folder. Hidden folders are only
    checked themselves (a layout may recognise its own staging folders) and never descended into. Folders that a layout names as parts of its checkpoints
    kept beside them (its `companions(url, entries)`: open-instruct's shared `ref_policy/`, AReaL's
    `recover_info/`) are neither listed nor descended into. A checkpoint that a `latest`-style pointer in
    its parent folder names has `latest` set.

    On object stores the run is listed once, recursively (`io.listing_snapshot`), every folder's entries
    and sizes come from that listing, and the checkpoints' marker reads overlap on a bounded pool.

    Raises:
        CheckpointNotFound: `url` is not a folder.
    """
    with io.listing_snapshot(url), scan_context():
        if not io.is_dir(url):
            if io.exists(url):
                raise CheckpointNotFound(
                    f"{url} is a file, not a run folder", "pass the folder that holds the checkpoints"
                )
            raise CheckpointNotFound(f"no such run folder: {url}")
        return _walk(url, io.list_dir(url), 0, max_depth, parallel=not io.is_local(url))


def _companions(url: str, entries: Sequence[io.DirEntry]) -> frozenset[str]:
    """Child folders of `url` that belong to checkpoints beside them rather than being checkpoints."""
    found: set[str] = set()
    for layout in all_layouts():
        found |= layout.companions(url, entries)
    return frozenset(found)


@dataclass(slots=True)
class _Level:
    """A folder of the walk whose child folders are being walked.

    Attributes:
        url, entries, depth: the folder, its listing and its depth below the run.
        out: where its checkpoints go once all its children are walked (its parent's list for that child).
        hit: the folder's own ref when it is a checkpoint.
        files: its files that are whole checkpoints (`Layout.identify_file`), when it is not one itself.
        todo: child folders still to walk.
        parallel: whether its children may fan out on threads.
        children: each walked child's name with the checkpoints found at or below it.
    """

    url: str
    entries: Sequence[io.DirEntry]
    depth: int
    out: list[CheckpointRef]
    hit: CheckpointRef | None
    parallel: bool = False
    files: list[CheckpointRef] = field(default_factory=list)
    todo: deque[io.DirEntry] = field(default_factory=deque)
    children: list[tuple[str, list[CheckpointRef]]] = field(default_factory=list)


def _walk(
    url: str, entries: Sequence[io.DirEntry], depth: int, max_depth: int, parallel: bool = False
) -> list[CheckpointRef]:
    """The checkpoints at or below `url`, a checkpoint before the ones it holds. With `parallel`, the first
    level holding more than one folder is identified on `io.parallel_map`'s threads (for object stores,
    where a layout's marker reads are requests worth overlapping); the levels below it are walked by those
    threads alone.

    The walk keeps its own stack of folders rather than recursing, so that a run nested thousands of
    folders deep (with a `max_depth` as large) cannot exhaust Python's stack.
    """
    result: list[CheckpointRef] = []
    stack: list[_Level] = []

    def enter(url: str, entries: Sequence[io.DirEntry], depth: int, parallel: bool, out: list[CheckpointRef]) -> None:
        hit = _identify(url, entries)
        files: list[CheckpointRef] = []
        if hit is None:  # its whole-checkpoint files, then what only the generic reader finds (after every plugin)
            files = _file_checkpoints(url, entries)
            folder, loose = unclaimed(url, entries, frozenset(io.name_of(ref.url) for ref in files))
            files += loose
            hit = None if folder is None else (get_layout(folder.layout), folder)
        folders: list[io.DirEntry] = []
        if depth < max_depth:
            skip = _SKIP_DIRS | (hit[0].members(url, entries) if hit is not None else frozenset())
            folders = [e for e in entries if e.is_dir and e.name not in skip]
            if folders:
                parts = _companions(url, entries)
                folders = [e for e in folders if e.name not in parts]
        level = _Level(url, entries, depth, out, hit[1] if hit is not None else None, parallel, files)
        if parallel and len(folders) > 1:
            visited = io.parallel_map(lambda e: _walk_child(url, e, depth, max_depth), folders)
            level.children = [(e.name, refs) for e, refs in zip(folders, visited, strict=True)]
            _finish(level)
            return
        level.todo.extend(folders)
        stack.append(level)

    enter(url, entries, depth, parallel, result)
    while stack:
        level = stack[-1]
        if not level.todo:
            stack.pop()
            _finish(level)
            continue
        entry = level.todo.popleft()
        child = _child(level.url, entry)
        if child is None:
            continue
        child_url, child_entries = child
        refs: list[CheckpointRef] = []
        level.children.append((entry.name, refs))
        if entry.name.startswith("."):
            hidden = _identify(child_url, child_entries)
            if hidden is not None:
                refs.append(hidden[1])
            continue
        enter(child_url, child_entries, level.depth + 1, level.parallel, refs)
    return result


def _child(url: str, entry: io.DirEntry) -> tuple[str, list[io.DirEntry]] | None:
    """The URL and listing of a child folder, or None when it was removed while we walked."""
    child_url = io.join(url, entry.name)
    try:
        return child_url, io.list_dir(child_url)
    except CheckpointNotFound:
        return None


def _walk_child(url: str, entry: io.DirEntry, depth: int, max_depth: int) -> list[CheckpointRef]:
    """The checkpoints at or below the child folder `entry` of `url` (a hidden folder is only identified)."""
    child = _child(url, entry)
    if child is None:
        return []
    child_url, child_entries = child
    if entry.name.startswith("."):
        hidden = _identify(child_url, child_entries)
        return [] if hidden is None else [hidden[1]]
    return _walk(child_url, child_entries, depth + 1, max_depth)


def _model_only(ref: CheckpointRef) -> bool:
    """Whether `ref`'s layout holds model weights only (nothing a resume restores besides the model)."""
    return not get_layout(ref.layout).resume_profile().resumable


def _finish(level: _Level) -> None:
    """Hand a walked folder's checkpoints to its parent: its own ref first (naming the children that hold
    checkpoints), then theirs, marking those a `latest` pointer in the folder names."""
    children = level.files + [ref for _, refs in level.children for ref in refs]
    if level.hit is None or level.hit.layout == GENERIC:
        # A run-level state file beside model folders goes with the newest of them; alone, it is unknown.
        names = run_state_files(level.entries)
        attached = attach_run_state(level.url, names, children, _model_only) if names else None
        if attached is not None:
            children = attached
        elif names:
            level.hit = unclaimed(level.url, level.entries, run_state=True)[0] or level.hit
    if level.hit is not None:
        holds = tuple(name for name, refs in level.children if refs)
        level.out.append(replace(level.hit, holds=holds) if holds else level.hit)
    pointed = pointed_children(level.url, level.entries) if children else set()
    level.out.extend(replace(ref, latest=True) if ref.url in pointed else ref for ref in children)
