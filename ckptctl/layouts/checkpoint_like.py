"""Checkpoint-like files: which files of a folder no plugin claims hold a checkpoint's bytes (by their content or
size, never by their name alone: `layouts.generic` says what the walker makes of them), which of them is a training
state told by its top-level keys, and which of them a `latest`-style link or tracker file beside them names.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from ckptctl import io
from ckptctl.checkpoint import Component
from ckptctl.contract.step_names import CHECKPOINT_SUFFIXES, name_facts
from ckptctl.errors import CkptctlError
from ckptctl.formats.safetensors import read_header
from ckptctl.io import DirEntry

if TYPE_CHECKING:
    from ckptctl.contract.training_state import TrainingState

__all__ = ["MEANINGFUL_BYTES", "checkpoint_like", "pointed_files", "training_state_of"]

#: A file so named but of no format ckptctl reads counts from this size on (a smaller one is a note, a stub).
MEANINGFUL_BYTES = 1 << 20
#: Names of symbolic links that point at the newest checkpoint beside them (Composer's `latest-rank0.pt`,
#: Lightning's `last.ckpt`).
_POINTER_LINK = re.compile(r"^(?:latest|last)(?:[-_.].*)?$", re.IGNORECASE)

_ZIP_MAGIC = b"PK\x03\x04"
_ZIP_HEADER = 30  # a zip local file header's fixed part; the name's length is at byte 26
_TORCH_ENTRY = b"/data.pkl"
_TORCH_ZIP = "torch.save zip"


def checkpoint_like(url: str, entry: DirEntry) -> str | None:
    """What the file at `url` is, for people (`torch.save zip`), when it holds a checkpoint's bytes; else None.

    Reads at most a small prefix (a safetensors header), and only of files with a checkpoint's suffix; a
    link is never one (it points at one: see `pointed_files`).
    """
    name = entry.name
    if entry.is_dir or name.startswith("."):
        return None
    if name.endswith(".distcp"):
        return "DCP data"
    if not name.endswith(CHECKPOINT_SUFFIXES) or io.is_link(url):
        return None
    return _content(url, entry.size, entry.mtime)


@lru_cache(maxsize=4096)
def _content(url: str, size: int, mtime: float) -> str | None:
    """`checkpoint_like` of a file by its bytes (cached by size and time: the walk asks once per file)."""
    try:
        if url.endswith(".safetensors"):
            read_header(url, size)
            return "safetensors"
        head = io.read_bytes(url, 0, min(size, _ZIP_HEADER + 256))
    except CkptctlError:
        head = b""
    if head.startswith(_ZIP_MAGIC) and len(head) >= _ZIP_HEADER:
        (length,) = struct.unpack_from("<H", head, 26)
        if head[_ZIP_HEADER : _ZIP_HEADER + length].endswith(_TORCH_ENTRY):
            return _TORCH_ZIP
    if size >= MEANINGFUL_BYTES:
        return f"{size >> 20} MiB of a format ckptctl does not read"
    return None


@lru_cache(maxsize=4096)
def _training_state(url: str, size: int, mtime: float) -> TrainingState | None:
    """What a torch.save file holds when its top-level keys make it a training state with a model (the pickle
    read through the allowlist, cached by size and time: the walk asks once per file); else None."""
    # Imported here: the pickle readers cost every command their import, and only torch.save files need them.
    from ckptctl.contract.training_state import read_training_state
    from ckptctl.formats.torch_pickle import open_torch_pickle
    from ckptctl.formats.torch_pickle_classes import OPAQUE_PICKLE_GLOBALS

    try:
        root = open_torch_pickle(url, size, OPAQUE_PICKLE_GLOBALS).root
    except CkptctlError:  # verify says why
        return None
    state = read_training_state(root)
    return state if Component.MODEL in state.components.values() else None


def training_state_of(url: str, entry: DirEntry) -> TrainingState | None:
    """`_training_state` of a checkpoint-like torch.save file (None for any other file)."""
    if checkpoint_like(url, entry) != _TORCH_ZIP:
        return None
    return _training_state(url, entry.size, entry.mtime or 0.0)


def pointed_files(url: str, entries: Sequence[DirEntry]) -> set[str]:
    """The names of the entries beside them that `latest`-style symbolic links (Composer's `latest-rank0.pt`,
    a `latest` link to a folder) or tracker files (`latest`, `latest_checkpointed_iteration.txt`: a name or a
    step) in the folder name."""
    pointed = set()
    names = {e.name for e in entries}
    for entry in entries:
        if not _POINTER_LINK.match(entry.name):
            continue
        path = io.join(url, entry.name)
        if io.is_link(path):
            with contextlib.suppress(OSError):  # removed while we look
                target = os.readlink(io.local_path(path)).rstrip("/")
                if "/" not in target and target in names:
                    pointed.add(target)
        elif not entry.is_dir and entry.size <= _MAX_TRACKER and _TRACKER.match(entry.name):
            pointed |= _tracked(path, entries)
    return pointed


#: Tracker files: a small text file naming the newest checkpoint beside it, or its step (Megatron-style
#: `latest_checkpointed_iteration.txt`, DeepSpeed-style `latest`).
_TRACKER = re.compile(r"^(?:latest|last)(?:[-_.][\w.-]*)?$", re.IGNORECASE)
_MAX_TRACKER = 256


def _tracked(url: str, entries: Sequence[DirEntry]) -> set[str]:
    try:
        text = io.read_bytes(url, 0, _MAX_TRACKER).decode("utf-8", "strict").strip()
    except (CkptctlError, UnicodeDecodeError):
        return set()
    names = {e.name for e in entries}
    if text in names and text != io.name_of(url):
        return {text}
    if text.isdigit() and len(text) <= 18:
        step = int(text)
        return {e.name for e in entries if name_facts(e.name).step == step}
    return set()


# --------------------------------------------------------------------------------------------------
# The walker's fallback.
# --------------------------------------------------------------------------------------------------
