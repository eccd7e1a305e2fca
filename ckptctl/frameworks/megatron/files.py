"""The names of what Megatron-LM saves (the tracker, `iter_NNNNNNN` and `release` folders, `common.pt`) and
how to read its small files, which its reader (`layout`), its resume profile (`resume`) and its convert
source (`hf`) all go by."""

from __future__ import annotations

import re
from typing import Any

from ckptctl import io
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.safe_pickle import FrameworkObject, state_fields
from ckptctl.formats.torch_pickle import read_pickled_structure

__all__ = ["COMMON", "RELEASE", "TRACKER", "iteration_of", "read_common", "read_tracker"]

#: Megatron-LM's tracker beside the iteration folders.
TRACKER = "latest_checkpointed_iteration.txt"
#: The non-sharded part of the state dict (torch.save).
COMMON = "common.pt"
#: The folder of a checkpoint saved with `release=True` (what the tracker then says).
RELEASE = "release"
_ITER = re.compile(r"^iter_(\d{7,})$")
#: The tracker holds an integer or "release"; anything longer is not Megatron's.
_MAX_TRACKER = 64
#: `common.pt` holds arguments and small states; a larger one is not Megatron's.
_MAX_COMMON = 256 << 20


def iteration_of(name: str) -> int | None:
    """The iteration an `iter_NNNNNNN` folder name holds (None for `release` and other names)."""
    m = _ITER.match(name)
    return int(m.group(1)) if m else None


def read_tracker(url: str) -> str | None:
    """The folder Megatron-LM's tracker in the save folder `url` names (`iter_0000100` or `release`), as its
    `read_metadata` reads it (an integer, or the word `release`); None when there is none or it is not one."""
    try:
        text = io.read_bytes(io.join(url, TRACKER), max_size=_MAX_TRACKER).decode("ascii").strip()
    except (CkptctlError, UnicodeDecodeError):
        return None
    if text == RELEASE:
        return RELEASE
    return f"iter_{int(text):07d}" if text.isdigit() else None


def read_common(url: str) -> dict[str, Any]:
    """`common.pt` of the dist-ckpt folder at `url`, through the allowlisting reader (tensors as facts,
    Megatron-LM's `args` as a plain dict); nothing in it runs.

    Raises:
        CheckpointNotFound: there is no `common.pt`.
        UnsafePickle, CorruptCheckpoint: it cannot be read safely.
    """
    path = io.join(url, COMMON)
    if io.file_size(path) > _MAX_COMMON:
        raise CorruptCheckpoint(f"{path}: larger than any Megatron common state")
    root = read_pickled_structure(path)
    if not isinstance(root, dict):
        raise CorruptCheckpoint(f"{path}: not a Megatron common state (the top object is not a dict)")
    common = dict(root)
    args = common.get("args")
    if isinstance(args, FrameworkObject):
        common["args"] = state_fields(args, path)
    return common
