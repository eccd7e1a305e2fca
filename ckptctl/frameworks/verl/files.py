"""The names of verl's run folder (`global_step_N/` and the trackers beside them) and how to read a tracker,
which its reader (`layout`) and its resume profile (`resume`) both go by."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ckptctl import io
from ckptctl.errors import CkptctlError
from ckptctl.io import DirEntry
from ckptctl.layouts import peek_dir

__all__ = ["STEP_RE", "TRACKERS", "read_tracker", "tracker_of"]

STEP_RE = re.compile(r"^global_step_(\d+)$")
#: verl's tracker, SkyRL's: each names the last saved step (an integer).
TRACKERS = ("latest_checkpointed_iteration.txt", "latest_ckpt_global_step.txt")


def read_tracker(url: str, entries: Sequence[DirEntry]) -> tuple[str, int] | None:
    """(tracker file name, step) of the first tracker in a run folder that holds an integer."""
    for name in TRACKERS:
        if any(e.name == name and not e.is_dir for e in entries):
            try:
                text = io.read_bytes(io.join(url, name), 0, 64)
            except CkptctlError:
                continue
            value = text.strip()
            if value.isdigit() and len(value) < 19:
                return name, int(value)
    return None


def tracker_of(run: str) -> tuple[str, int] | None:
    """The tracker of a run folder (its name and step), if any."""
    entries = peek_dir(run)
    return None if entries is None else read_tracker(run, entries)
