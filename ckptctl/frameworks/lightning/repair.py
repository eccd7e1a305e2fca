"""Lightning's pointer: `trainer.fit(model, ckpt_path="last")` loads the newest `last*.ckpt` of the
ModelCheckpoint folder (lightning/pytorch/callbacks/model_checkpoint.py `_find_last_checkpoints`, then
checkpoint_connector.py `_parse_ckpt_path`). With `save_last="link"` it is a symbolic link to the newest
`epoch=E-step=S.ckpt`, rewritten here; with `save_last=True` it is a copy, which no pointer change redirects."""

from __future__ import annotations

import os

from ckptctl import io
from ckptctl.contract.capabilities import Pointer
from ckptctl.frameworks.lightning.files import LAST


def _last(checkpoint: str) -> str:
    return io.join(io.parent_of(checkpoint), LAST)


def _is_copy(path: str) -> bool:
    # A copy and a link can be told apart only on a local disk (an object store has no links).
    return io.is_local(path) and os.path.lexists(io.local_path(path)) and not os.path.islink(io.local_path(path))


class _LastLink:
    def roles(self, checkpoint: str) -> tuple[str, ...]:
        return (checkpoint,)

    def pointers(self, checkpoint: str) -> tuple[Pointer, ...]:
        last = _last(checkpoint)
        if io.name_of(checkpoint) == LAST or _is_copy(last):
            return ()
        return (Pointer(last, io.name_of(checkpoint), link=True),)

    def picked_over(self, checkpoint: str) -> tuple[str, ...]:
        return ()

    def refusal(self, checkpoint: str) -> str | None:
        last = _last(checkpoint)
        if io.name_of(checkpoint) == LAST or not _is_copy(last):
            return None
        return (
            f"{last} is a copy (save_last=True), not a link: ckpt_path='last' would load it, and no pointer "
            f"change redirects it; resume with trainer.fit(model, ckpt_path={checkpoint!r}), or move "
            f"{LAST} away and let ModelCheckpoint write a new one"
        )


POINTER_WRITER = _LastLink()
