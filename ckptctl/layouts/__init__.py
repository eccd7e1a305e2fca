"""The layout registry: which layouts exist, in which order they are tried, and the run walker.

Layout modules are imported lazily (as fsspec does with its implementations), so that a command that
needs one layout does not pay for all of them.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cache
from typing import Any, TypeVar, cast

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef
from ckptctl.errors import CheckpointNotFound, CkptctlError, UnknownLayout
from ckptctl.layouts.base import Layout

__all__ = [
    "DEFAULT_SCAN_DEPTH",
    "Layout",
    "detect",
    "get_layout",
    "layout_names",
    "open_checkpoint",
    "peek",
    "peek_dir",
    "scan_run",
]

#: Tried in this order: the more specific layouts first. A native checkpoint also holds safetensors files an
#: HF reader would accept, and a native multi-rank one holds a DCP folder. AReaL's recover slot is a DCP
#: folder with a name of its own, and a ROLL `checkpoint-N` holds `scheduler.pt` like a Trainer checkpoint:
#: both come before the layouts they would otherwise pass for. A Trainer `checkpoint-N` holds an HF model
#: folder and possibly a DeepSpeed tag folder, and is one checkpoint with all of them. OpenRLHF and
#: open-instruct tags ARE DeepSpeed tag folders, told apart by the files around them, so they come before
#: `deepspeed`, which takes the tags nothing else claims.
_REGISTRY: tuple[tuple[str, str], ...] = (
    ("native", "ckptctl.frameworks.native.layout:NativeLayout"),
    ("areal", "ckptctl.frameworks.areal.layout:ArealLayout"),
    ("roll", "ckptctl.frameworks.roll.layout:RollLayout"),
    ("dcp", "ckptctl.frameworks.dcp.layout:DcpLayout"),
    ("hf_trainer", "ckptctl.frameworks.hf_trainer.layout:HfTrainerLayout"),
    ("openrlhf", "ckptctl.frameworks.openrlhf.layout:OpenRlhfLayout"),
    ("open_instruct", "ckptctl.frameworks.open_instruct.layout:OpenInstructLayout"),
    ("deepspeed", "ckptctl.frameworks.deepspeed.layout:DeepSpeedLayout"),
    ("hf", "ckptctl.frameworks.hf.layout:HfModelLayout"),
)

#: How deep `list`, `verify` and `prune` look for checkpoints below a run folder: AReaL's recover slots sit
#: 6 levels below its `fileroot` (checkpoints/user/experiment/trial/default/recover_checkpoint).
DEFAULT_SCAN_DEPTH = 6

#: Folders never worth descending into when looking for checkpoints.
_SKIP_DIRS = frozenset({"__pycache__", ".git", ".hg", ".svn", "node_modules", ".ckptctl-trash", "wandb"})


# --------------------------------------------------------------------------------------------------
# Peeks: listings of the folders around a candidate (its parent, its siblings), which some layouts need to
# tell apart frameworks that write the same files (an OpenRLHF tag from a plain DeepSpeed one).
# --------------------------------------------------------------------------------------------------

_PEEK_LIMIT = 4096
_LISTING = "listing"
_peeks: dict[tuple[str, int], dict[Any, Any]] = {}
_peeks_lock = threading.Lock()
T = TypeVar("T")


def peek_dir(url: str) -> list[io.DirEntry] | None:
    """The listing of the folder at `url` (None when it is not a folder), listed once per scan.

    Layouts call it for the parent or the siblings of a folder they are identifying, so a save folder of
    1,000 tags is listed once, not once per tag. A local folder's entry is keyed by its mtime as well, so
    that a folder that gained or lost entries is listed again; remote ones are kept until the next scan.
    """
    slot = _peek_slot(url)
    return None if slot is None else slot[_LISTING]


def peek(url: str, derive: Callable[[str, list[io.DirEntry]], T]) -> T | None:
    """`derive(url, listing)` for the folder at `url`, computed once per scan like `peek_dir` (None when it
    is not a folder). For facts about a folder that every one of its children asks for (whether a save
    folder holds `best_*` tags), which would cost N x N on a folder of N checkpoints otherwise."""
    slot = _peek_slot(url)
    if slot is None or slot[_LISTING] is None:
        return None
    with _peeks_lock:
        if derive in slot:
            return cast(T, slot[derive])
    value = derive(url, slot[_LISTING])
    with _peeks_lock:
        slot[derive] = value
    return value


def _peek_slot(url: str) -> dict[Any, Any] | None:
    version = 0
    if io.is_local(url):
        try:
            version = os.stat(io.local_path(url)).st_mtime_ns
        except OSError:
            return None
    key = (url, version)
    with _peeks_lock:
        slot = _peeks.get(key)
    if slot is not None:
        return slot
    try:
        listing: list[io.DirEntry] | None = io.list_dir(url)
    except CkptctlError:
        listing = None
    slot = {_LISTING: listing}
    with _peeks_lock:
        if len(_peeks) >= _PEEK_LIMIT:
            _peeks.clear()
        _peeks[key] = slot
    return slot


def _forget_peeks() -> None:
    with _peeks_lock:
        _peeks.clear()


def layout_names() -> list[str]:
    return [name for name, _ in _REGISTRY]


@cache
def get_layout(name: str) -> Layout:
    """The layout registered under `name`."""
    for registered, target in _REGISTRY:
        if registered == name:
            module_name, _, class_name = target.partition(":")
            layout: Layout = getattr(importlib.import_module(module_name), class_name)()
            return layout
    raise UnknownLayout(f"no layout named {name!r}", f"known layouts: {', '.join(layout_names())}")


def all_layouts() -> list[Layout]:
    return [get_layout(name) for name in layout_names()]


def _identify(url: str, entries: Sequence[io.DirEntry]) -> tuple[Layout, CheckpointRef] | None:
    for layout in all_layouts():
        ref = layout.identify(url, entries)
        if ref is not None:
            return layout, ref
    return None


def detect(url: str, layout: str | None = None, *, explain: bool = True) -> tuple[Layout, CheckpointRef]:
    """The layout of the checkpoint folder at `url` and its ref (or of a single weights file, see
    `layouts.single_file`).

    Raises:
        CheckpointNotFound: the folder does not exist.
        UnknownLayout: no layout recognises it (the message lists what was tried, and says when the
            folder looks like a run holding checkpoints rather than a checkpoint).
    """
    if not io.is_dir(url):
        if io.exists(url):
            from ckptctl.layouts.single_file import detect_file

            if layout is not None:
                raise UnknownLayout(f"{url} is a file: --layout {layout} names a folder layout", "leave out --layout")
            return detect_file(url)  # a weights file, or an error that says what to pass instead
        raise CheckpointNotFound(f"no such checkpoint folder: {url}")
    _forget_peeks()
    entries = io.list_dir(url)
    candidates = [get_layout(layout)] if layout else all_layouts()
    for candidate in candidates:
        ref = candidate.identify(url, entries)
        if ref is not None:
            return candidate, ref
    tried = ", ".join(c.name for c in candidates)
    hint = "check the path"
    # The hint costs a scan of the folder: callers that only ask "is this a checkpoint?" skip it.
    if explain and layout is None and any(e.is_dir for e in entries):
        inner = scan_run(url, max_depth=2)
        if inner:
            hint = f"this looks like a run folder with {len(inner)} checkpoint(s); use `ckptctl list {url}` or pass one of them"
    raise UnknownLayout(f"{url} is not a checkpoint of any known layout (tried: {tried})", hint)


def open_checkpoint(url: str, layout: str | None = None) -> Checkpoint:
    """Detect and open the checkpoint folder at `url`."""
    found, _ = detect(url, layout)
    return found.open(url)


def scan_run(url: str, max_depth: int = DEFAULT_SCAN_DEPTH) -> list[CheckpointRef]:
    """Every checkpoint below `url` (the folder itself included), in whatever nesting the run uses.

    A folder recognised as a checkpoint is not descended into. Hidden folders are only checked
    themselves (a layout may recognise its own staging folders) and never descended into. Folders that a
    layout names as parts of its checkpoints kept beside them (its optional `companions(url, entries)`:
    open-instruct's shared `ref_policy/`, AReaL's `recover_info/`) are neither listed nor descended into.

    On object stores the run is listed once, recursively (`io.listing_snapshot`), every folder's entries
    and sizes come from that listing, and the checkpoints' marker reads overlap on a bounded pool.
    """
    with io.listing_snapshot(url):
        if not io.is_dir(url):
            if io.exists(url):
                raise CheckpointNotFound(
                    f"{url} is a file, not a run folder", "pass the folder that holds the checkpoints"
                )
            raise CheckpointNotFound(f"no such run folder: {url}")
        _forget_peeks()
        found: list[CheckpointRef] = []
        _walk(url, io.list_dir(url), 0, max_depth, found, parallel=not io.is_local(url))
        return found


def _companions(url: str, entries: Sequence[io.DirEntry]) -> frozenset[str]:
    """Child folders of `url` that belong to checkpoints beside them rather than being checkpoints."""
    found: set[str] = set()
    for layout in all_layouts():
        found |= layout.companions(url, entries)
    return frozenset(found)


def _walk(
    url: str,
    entries: Sequence[io.DirEntry],
    depth: int,
    max_depth: int,
    found: list[CheckpointRef],
    parallel: bool = False,
) -> None:
    """Append the checkpoints at or below `url` to `found`. With `parallel`, the first level holding more
    than one folder is identified on `io.parallel_map`'s threads (for object stores, where a layout's
    marker reads are requests worth overlapping); the levels below it are walked by those threads alone."""
    hit = _identify(url, entries)
    if hit is not None:
        found.append(hit[1])
        return
    if depth >= max_depth:
        return
    parts = _companions(url, entries)
    folders = [e for e in entries if e.is_dir and e.name not in _SKIP_DIRS and e.name not in parts]
    fan_out = parallel and len(folders) > 1

    def visit(entry: io.DirEntry) -> list[CheckpointRef]:
        child_url = io.join(url, entry.name)
        try:
            child_entries = io.list_dir(child_url)
        except CheckpointNotFound:  # removed while we walked
            return []
        if entry.name.startswith("."):
            hidden = _identify(child_url, child_entries)
            return [] if hidden is None else [hidden[1]]
        below: list[CheckpointRef] = []
        _walk(child_url, child_entries, depth + 1, max_depth, below, parallel and not fan_out)
        return below

    visited = io.parallel_map(visit, folders) if fan_out else [visit(e) for e in folders]
    children = [ref for refs in visited for ref in refs]
    pointed = {io.join(url, name) for layout in all_layouts() if (name := layout.latest_pointer(url, entries))}
    found.extend(replace(ref, latest=True) if ref.url in pointed else ref for ref in children)
