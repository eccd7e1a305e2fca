"""The run walk: every checkpoint at or below a folder, in whatever nesting the run uses (`scan_run`)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef
from ckptctl.contract.scan_context import scan_context
from ckptctl.errors import CheckpointNotFound
from ckptctl.layouts.generic import GENERIC, unclaimed
from ckptctl.layouts.identify import file_checkpoints, identify_folder, pointed_children
from ckptctl.layouts.registry import all_layouts, get_layout
from ckptctl.layouts.run_state import attach_run_state, run_state_files

__all__ = ["DEFAULT_SCAN_DEPTH", "scan_run"]

#: How deep `list`, `verify` and `prune` look for checkpoints below a run folder: AReaL's recover slots sit
#: 6 levels below its `fileroot` (checkpoints/user/experiment/trial/default/recover_checkpoint).
DEFAULT_SCAN_DEPTH = 6

#: Folders never worth descending into when looking for checkpoints.
_SKIP_DIRS = frozenset({"__pycache__", ".git", ".hg", ".svn", "node_modules", ".ckptctl-trash", "wandb"})


def scan_run(
    url: str, max_depth: int = DEFAULT_SCAN_DEPTH, *, cancel: threading.Event | None = None
) -> list[CheckpointRef]:
    """Every checkpoint at or below `url` (the folder itself included), in whatever nesting the run uses.

    A folder can be a checkpoint and hold checkpoints (an HF Trainer `output_dir` with the final model
    beside `checkpoint-N/`; a DCP or DeepSpeed run with an exported model beside its steps). A folder
    recognised as a checkpoint is recorded, and its child folders that are not part of it (the layout's
    `members`) are walked on; the ref names those that hold checkpoints in `CheckpointRef.holds`, and
    comes before them. In a folder that is no checkpoint, files a layout takes for whole checkpoints
    (`Layout.identify_file`: Lightning's `epoch=0-step=100.ckpt`) are listed too, and after every plugin the
    generic reader (`layouts.generic.unclaimed`) lists checkpoint-like files none of them claims, as state
    `unknown`: a step-named file on its own, the others as their folder. Hidden folders are only
    checked themselves (a layout may recognise its own staging folders) and never descended into. Folders
    that a layout names as parts of its checkpoints kept beside them (its `companions(url, entries)`:
    open-instruct's shared `ref_policy/`, AReaL's `recover_info/`) are neither listed nor descended into. A checkpoint that a `latest`-style pointer in
    its parent folder names has `latest` set.

    On object stores the run is listed once, recursively (`io.listing_snapshot`), every folder's entries
    and sizes come from that listing, and the checkpoints' marker reads overlap on a bounded pool.

    `cancel`: set by whoever no longer wants the answer (`ops.sync`'s scan ahead of a lock that had to wait):
    the walk stops at the next folder rather than reading the rest of the run.

    Raises:
        CheckpointNotFound: `url` is not a folder.
        CancelledError: `cancel` was set.
    """
    with io.listing_snapshot(url), scan_context():
        if not io.is_dir(url):
            if io.exists(url):
                raise CheckpointNotFound(
                    f"{url} is a file, not a run folder", "pass the folder that holds the checkpoints"
                )
            raise CheckpointNotFound(f"no such run folder: {url}")
        # A store's listings wait on the network (in parallel they overlap); a local disk's answer at once.
        return _walk(url, io.list_dir(url), 0, max_depth, parallel=not io.is_local(url), cancel=cancel)


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
    url: str,
    entries: Sequence[io.DirEntry],
    depth: int,
    max_depth: int,
    parallel: bool = False,
    cancel: threading.Event | None = None,
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
        io.stop_if_cancelled(cancel, f"the scan of {url}")
        hit = identify_folder(url, entries)
        files: list[CheckpointRef] = []
        if hit is None:  # its whole-checkpoint files, then what only the generic reader finds (after every plugin)
            files = file_checkpoints(url, entries)
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
            visited = io.parallel_map(lambda e: _walk_child(url, e, depth, max_depth, cancel), folders)
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
        io.stop_if_cancelled(cancel, f"the scan of {url}")
        child = _child(level.url, entry)
        if child is None:
            continue
        child_url, child_entries = child
        refs: list[CheckpointRef] = []
        level.children.append((entry.name, refs))
        if entry.name.startswith("."):
            hidden = identify_folder(child_url, child_entries)
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


def _walk_child(
    url: str, entry: io.DirEntry, depth: int, max_depth: int, cancel: threading.Event | None
) -> list[CheckpointRef]:
    """The checkpoints at or below the child folder `entry` of `url` (a hidden folder is only identified)."""
    child = _child(url, entry)
    if child is None:
        return []
    child_url, child_entries = child
    if entry.name.startswith("."):
        hidden = identify_folder(child_url, child_entries)
        return [] if hidden is None else [hidden[1]]
    return _walk(child_url, child_entries, depth + 1, max_depth, cancel=cancel)


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
