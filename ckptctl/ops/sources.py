"""The source of a command that writes a new checkpoint from it (`convert`, `reshard`): opened only when it is
committed and passes its layout's structural verification.

A module of its own, so that `reshard` does not import `convert` (and what `convert` pulls in: the model
check, `slim`'s rules, the HF writer) to open its source: a command's fixed cost (DESIGN §5).
"""

from __future__ import annotations

from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState
from ckptctl.errors import CheckpointInProgress, CorruptCheckpoint
from ckptctl.layouts import Layout
from ckptctl.quoting import shell

__all__ = ["open_verified"]


def open_verified(layout: Layout, ref: CheckpointRef) -> Checkpoint:
    """The checkpoint of `ref`, opened by `layout`.

    Raises:
        CheckpointInProgress: it is still being written.
        CorruptCheckpoint: it was abandoned, is broken, or fails its layout's structural verification.
    """
    url = ref.url
    if ref.state is CheckpointState.IN_PROGRESS:
        raise CheckpointInProgress(
            f"{url} is still being written ({ref.note or 'no completion marker'})", "wait for the save to finish"
        )
    if ref.state is CheckpointState.ABANDONED:
        raise CorruptCheckpoint(f"{url} is {ref.note}", "use a committed checkpoint instead")
    checkpoint = layout.open(url)
    problems = list(layout.verify(checkpoint))
    slim = ref.state is CheckpointState.SLIM  # its layout may take the dropped optimizer for damage
    if slim:
        from ckptctl.ops.slim import slim_problems  # only a slim source needs `slim`'s rules

        problems = slim_problems(layout.name, url, problems)
    problems = [p for p in problems if p.severity == "error"]
    if problems or (checkpoint.ref.state is CheckpointState.BROKEN and not slim):
        first = problems[0].message if problems else checkpoint.ref.note
        raise CorruptCheckpoint(
            f"{url} fails structural verification: {first}",
            f"run `{shell('ckptctl', 'verify', url)}` for the full report",
        )
    return checkpoint
