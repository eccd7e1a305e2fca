"""The one checkpoint a command that takes a path acts on: `detect` (the folder or file itself), `resolve` (or
what a pointer in it names) and `open_checkpoint`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState
from ckptctl.contract.base import Layout
from ckptctl.contract.scan_context import peek_dir, scan_context
from ckptctl.errors import CheckpointNotFound, UnknownLayout
from ckptctl.layouts.identify import identify_file, identify_folder, pointed_children, unknown_folder
from ckptctl.layouts.registry import layout_names
from ckptctl.layouts.walk import scan_run
from ckptctl.quoting import shell

__all__ = ["detect", "open_checkpoint", "resolve"]


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
        hit = identify_folder(url, entries, layout) or unknown_folder(url, entries, layout)
        if hit is not None:
            return hit
        raise _not_a_checkpoint(url, entries, layout, explain)


def _detect_file(url: str, layout: str | None) -> tuple[Layout, CheckpointRef]:
    """A file a layout takes for a whole checkpoint (`Layout.identify_file`), a single weights file, or the
    error that says what to pass instead."""
    if io.exists(url):
        from ckptctl.layouts.single_file import detect_file

        name = io.name_of(url)
        entry = next((e for e in peek_dir(io.parent_of(url)) or () if e.name == name and not e.is_dir), None)
        hit = identify_file(url, entry, layout) if entry is not None else None
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
        hit = identify_folder(url, entries, layout)
        if hit is not None:
            return hit
        folders = {io.join(url, e.name) for e in entries if e.is_dir}
        files = {io.join(url, e.name): e for e in entries if not e.is_dir}
        pointed = pointed_children(url, entries)
        named = [
            found
            for child in sorted(pointed & folders)
            if (found := identify_folder(child, io.list_dir(child), layout)) is not None
        ]
        named += [
            found for child in sorted(pointed & set(files)) if (found := identify_file(child, files[child], layout))
        ]
        if len(named) == 1:
            return named[0]
        if len(named) > 1:  # a DeepSpeed save folder's `latest` and `latest_universal`
            names = ", ".join(f"{io.name_of(ref.url)} ({found.name})" for found, ref in named)
            raise UnknownLayout(f"{url} is not a checkpoint; pointers in it name {names}", "pass one of them")
        unknown = unknown_folder(url, entries, layout)
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
