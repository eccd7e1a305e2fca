"""Megatron-LM's pointer: `load_checkpoint` reads the iteration from `latest_checkpointed_iteration.txt`
beside the `iter_NNNNNNN` folders (megatron/training/checkpointing.py, `read_metadata`: an integer, or
`release`), which `save_checkpoint` writes as the bare number."""

from __future__ import annotations

from ckptctl import io
from ckptctl.contract.capabilities import Pointer
from ckptctl.families.pointers import FollowsPointer
from ckptctl.frameworks.megatron.files import RELEASE, TRACKER, iteration_of


def _tracker(folder: str) -> tuple[Pointer, ...]:
    name = io.name_of(folder)
    iteration = iteration_of(name)
    content = RELEASE if name == RELEASE else str(iteration) if iteration is not None else None
    return () if content is None else (Pointer(io.join(io.parent_of(folder), TRACKER), content),)


POINTER_WRITER = FollowsPointer(_tracker)
