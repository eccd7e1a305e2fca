"""The save/load core a training loop imports (DESIGN §3): `CheckpointManager`, `AutoSaver`, retention.

Importing it costs little beyond torch itself: torch.distributed.checkpoint is imported only by multi-rank
saves and by restores of sharded checkpoints, and nothing here imports the CLI's libraries. The manager and
the hooks (which need torch) are imported on first use, so that `ckptctl.core.retention`, which
`ckptctl prune` shares with the manager, is importable where torch is not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckptctl.core.retention import Candidate, Decision, KeepBest, RetentionPolicy

if TYPE_CHECKING:
    from ckptctl.core.entries import CheckpointWarning
    from ckptctl.core.hooks import AutoSaver
    from ckptctl.core.manager import CheckpointManager
    from ckptctl.formats.native import StepNaming

__all__ = [
    "AutoSaver",
    "Candidate",
    "CheckpointManager",
    "CheckpointWarning",
    "Decision",
    "KeepBest",
    "RetentionPolicy",
    "StepNaming",
]

_LAZY = {
    "AutoSaver": "ckptctl.core.hooks",
    "CheckpointManager": "ckptctl.core.manager",
    "CheckpointWarning": "ckptctl.core.entries",
    "StepNaming": "ckptctl.formats.native",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptctl.core' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
