"""Pointer writers (`contract.capabilities.PointerWriter`) of the two kinds most frameworks are: a loader that
reads one pointer file beside its checkpoints (DeepSpeed's `latest`, Megatron's tracker), and one that takes
the highest step it finds by name (the Trainer's `checkpoint-N`, torchtitan's `step-N`). A framework package
makes its writer from one of these with its own facts; `ops.repair` applies what the writer says.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ckptctl import io
from ckptctl.contract.capabilities import Pointer
from ckptctl.errors import CheckpointNotFound

__all__ = ["FollowsPointer", "PicksNewestByName", "newer_by_name"]


def _itself(checkpoint: str) -> tuple[str, ...]:
    return (checkpoint,)


@dataclass(frozen=True, slots=True)
class FollowsPointer:
    """A loader that resumes from what pointer files beside the checkpoints name (DeepSpeed's `latest`).

    Attributes:
        pointers: `(checkpoint) -> pointers`: each pointer file and what it holds when it names `checkpoint`.
        roles: `(checkpoint) -> checkpoints`: every checkpoint a resume from it loads, itself first.
    """

    pointers: Callable[[str], tuple[Pointer, ...]]
    roles: Callable[[str], tuple[str, ...]] = _itself

    def picked_over(self, checkpoint: str) -> tuple[str, ...]:
        return ()

    def refusal(self, checkpoint: str) -> str | None:
        return None


def newer_by_name(checkpoint: str, pattern: re.Pattern[str], holds: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The folders beside `checkpoint` whose names `pattern` matches (its first group: the step, searched as
    the framework searches) with a higher step than `checkpoint`'s own, holding one of `holds` when given."""
    found = pattern.search(io.name_of(checkpoint))
    if found is None:
        return ()
    step = int(found.group(1))
    parent = io.parent_of(checkpoint)
    newer = []
    for entry in io.list_dir(parent):
        match = pattern.search(entry.name)
        if not entry.is_dir or match is None or int(match.group(1)) <= step:
            continue
        url = io.join(parent, entry.name)
        if holds and not _holds_any(url, holds):
            continue
        newer.append(url)
    return tuple(sorted(newer))


def _holds_any(url: str, names: tuple[str, ...]) -> bool:
    try:
        return any(e.name in names and not e.is_dir for e in io.list_dir(url))
    except CheckpointNotFound:
        return False


@dataclass(frozen=True, slots=True)
class PicksNewestByName:
    """A loader that resumes from the highest step it finds by name, keeping no pointer (transformers'
    `get_last_checkpoint`): what it would pick over the chosen checkpoint goes into quarantine.

    Attributes:
        pattern: the loader's own pattern (searched, as the loader does: anchor it where the loader does);
            its first group is the step.
        holds: files a folder must hold for the loader to take it (torchtitan's `.metadata`); () for any.
    """

    pattern: re.Pattern[str]
    holds: tuple[str, ...] = ()

    def roles(self, checkpoint: str) -> tuple[str, ...]:
        return (checkpoint,)

    def pointers(self, checkpoint: str) -> tuple[Pointer, ...]:
        return ()

    def picked_over(self, checkpoint: str) -> tuple[str, ...]:
        return newer_by_name(checkpoint, self.pattern, self.holds)

    def refusal(self, checkpoint: str) -> str | None:
        return None
