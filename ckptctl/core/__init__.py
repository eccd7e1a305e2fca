"""The save/load core a training loop imports (DESIGN §3): `CheckpointManager`, `AutoSaver`, retention.

Importing it costs little beyond torch itself: torch.distributed.checkpoint is imported only by multi-rank
saves and by restores of sharded checkpoints, and nothing here imports the CLI's libraries.
"""

from __future__ import annotations

from ckptctl.core.entries import CheckpointWarning
from ckptctl.core.hooks import AutoSaver
from ckptctl.core.manager import CheckpointManager
from ckptctl.core.retention import Decision, RetentionPolicy
from ckptctl.layouts.native import StepNaming

__all__ = ["AutoSaver", "CheckpointManager", "CheckpointWarning", "Decision", "RetentionPolicy", "StepNaming"]
