"""The in-progress-by-age rule: a checkpoint that lacks what its framework writes last is still being
written while its newest file is fresh, and was cut short once that file is older than the window.

Frameworks that write no "started" record (the HF Trainer, accelerate, AReaL, verl, ROLL, open-instruct,
DeepSpeed's universal conversion) leave nothing else to tell a save under way from one that died: one
window and one rule serve them all, so that `list`, `verify --latest` and `prune` judge them alike.
"""

from __future__ import annotations

import time

from ckptctl.checkpoint import CheckpointState

__all__ = ["IN_PROGRESS_WINDOW_S", "recently_written", "unfinished_state"]

#: An unfinished checkpoint whose newest file is younger than this (seconds) is still being written; older,
#: the save was interrupted.
IN_PROGRESS_WINDOW_S = 15 * 60


def recently_written(newest: float | None) -> bool:
    """Whether an unfinished checkpoint whose newest file was modified at `newest` (POSIX seconds; None when
    nothing tells) is still being written."""
    return newest is not None and time.time() - newest < IN_PROGRESS_WINDOW_S


def unfinished_state(newest: float | None) -> CheckpointState:
    """IN_PROGRESS while an unfinished checkpoint is `recently_written`, else BROKEN."""
    return CheckpointState.IN_PROGRESS if recently_written(newest) else CheckpointState.BROKEN
