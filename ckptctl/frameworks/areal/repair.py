"""AReaL keeps one recover slot per model, overwritten in place, and `recover_info/` describing it:
`check_if_recover` / `RecoverHandler.load` (areal/utils/recover.py) load that one dump or nothing. There is no
older dump to point at, so nothing is written: the slots of every model (`default/`, `critic/`) must verify."""

from __future__ import annotations

from ckptctl import io
from ckptctl.contract.capabilities import Pointer
from ckptctl.frameworks.areal.files import RECOVER_SLOT


class _RecoverSlot:
    def roles(self, slot: str) -> tuple[str, ...]:
        """The slot, then the other models' slots of the trial (they share `recover_info/`)."""
        model = io.parent_of(slot)
        trial = io.parent_of(model)
        others = [
            io.join(trial, e.name, RECOVER_SLOT)
            for e in sorted(io.list_dir(trial), key=lambda e: e.name)
            if e.is_dir and e.name != io.name_of(model) and io.is_dir(io.join(trial, e.name, RECOVER_SLOT))
        ]
        return (slot, *others)

    def pointers(self, slot: str) -> tuple[Pointer, ...]:
        return ()

    def picked_over(self, slot: str) -> tuple[str, ...]:
        return ()

    def refusal(self, slot: str) -> str | None:
        return None


POINTER_WRITER = _RecoverSlot()
