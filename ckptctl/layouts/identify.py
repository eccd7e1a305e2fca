"""What a folder or file is: the one identification every command goes through (the walker's, for each folder),
with the slim marker and the `latest`-style pointers every layout honours."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState
from ckptctl.contract.base import Layout
from ckptctl.formats.slim_marker import SLIM_MARKER, SLIM_NOTE, is_slim_file
from ckptctl.layouts.generic import generic_layout
from ckptctl.layouts.registry import all_layouts, candidates, file_layout_names, get_layout

__all__ = ["file_checkpoints", "identify_file", "identify_folder", "pointed_children", "unknown_folder"]


def identify_folder(
    url: str, entries: Sequence[io.DirEntry], layout: str | None = None
) -> tuple[Layout, CheckpointRef] | None:
    """The first layout (in registry order, or only `layout`) that recognises the folder, and its ref."""
    for candidate in candidates(layout):
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


def identify_file(url: str, entry: io.DirEntry, layout: str | None = None) -> tuple[Layout, CheckpointRef] | None:
    """The first layout (in registry order, or only `layout`) whose checkpoints are files like `entry`, and
    the file's ref when it recognises it."""
    names = [layout] if layout else file_layout_names(entry.name)
    for candidate in map(get_layout, names):
        if candidate.checkpoint_files and entry.name.endswith(candidate.checkpoint_files):
            ref = candidate.identify_file(url, entry)
            if ref is not None:
                return candidate, _slim_file_state(ref, entry)
    return None


def file_checkpoints(url: str, entries: Sequence[io.DirEntry]) -> list[CheckpointRef]:
    """The files of the folder `url` that are whole checkpoints (hidden ones are staging files)."""
    endings = tuple(ending for layout in all_layouts() for ending in layout.checkpoint_files)
    if not endings:
        return []
    found = []
    for entry in entries:
        if not entry.is_dir and entry.name.endswith(endings) and not entry.name.startswith("."):
            hit = identify_file(io.join(url, entry.name), entry)
            if hit is not None:
                found.append(hit[1])
    return found


def unknown_folder(url: str, entries: Sequence[io.DirEntry], layout: str | None) -> tuple[Layout, CheckpointRef] | None:
    """The generic reader's ref of a folder no plugin recognised, when no layout was asked for."""
    ref = generic_layout().identify(url, entries) if layout is None else None
    return None if ref is None else (get_layout(ref.layout), ref)
