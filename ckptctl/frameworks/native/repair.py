"""ckptctl's own pointer: `CheckpointManager.restore(state)` without a step takes the step folder `latest`
names when it verifies (`core.manager`), which the manager writes as the folder name and a newline."""

from __future__ import annotations

from ckptctl import io
from ckptctl.contract.capabilities import Pointer
from ckptctl.families.pointers import FollowsPointer
from ckptctl.formats.native import POINTER_NAME

POINTER_WRITER = FollowsPointer(
    lambda step: (Pointer(io.join(io.parent_of(step), POINTER_NAME), f"{io.name_of(step)}\n"),)
)
