"""The names of what AReaL's recover saves write (the recover slot and `recover_info/`), and which info files a
later save tore, which its reader (`layout`) and its resume profile (`resume`) both go by."""

from __future__ import annotations

from collections.abc import Iterable

from ckptctl.families.dcp_folder import MTIME_SLACK_S
from ckptctl.io import DirEntry

__all__ = ["DATALOADER_INFO", "INFO_FILES", "RECOVER_INFO", "RECOVER_SLOT", "STEP_INFO", "torn_info_files"]

RECOVER_SLOT = "recover_checkpoint"
RECOVER_INFO = "recover_info"
STEP_INFO = "step_info.json"
DATALOADER_INFO = "dataloader_info.pkl"
#: The files of `recover_info/`, in the order `RecoverInfo.dump` writes them.
INFO_FILES = (
    STEP_INFO,
    "saver_info.json",
    "evaluator_info.json",
    "stats_logger_info.json",
    "checkpoint_info.json",
    DATALOADER_INFO,
)


def torn_info_files(weights_mtime: float, info: Iterable[DirEntry]) -> list[str]:
    """The files of `recover_info/` older than the slot's `.metadata` (modified at `weights_mtime`) beyond
    the slack: AReaL writes the slot first and its info files after, so these are left from an earlier
    save that the last one tore (a recover pairs the new weights with the old counters)."""
    return sorted(e.name for e in info if e.name in INFO_FILES and e.mtime and e.mtime + MTIME_SLACK_S < weights_mtime)
