"""The slots a framework plugin's capabilities are declared under (`contract.capabilities`), apart from the
capabilities themselves: the registry names every plugin's slots at import, and a command that uses no
capability (`verify`, `list`, `inspect`) should not build the capabilities' dataclasses to do so (DESIGN §5:
a command's fixed cost)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from ckptctl.contract.capabilities import (
        ConvertSource,
        PointerWriter,
        Slimmer,
        TrainingStateSource,
        TrainingStateWriter,
    )

__all__ = ["CONVERT_SOURCE", "POINTER_WRITER", "SLIMMER", "TRAINING_STATE_SOURCE", "TRAINING_STATE_WRITER", "Slot"]

C = TypeVar("C")


@dataclass(frozen=True, slots=True, eq=False)
class Slot(Generic[C]):
    """A kind of capability, the key a registry entry declares one under: `capability(layout, slot)` is a `C`.
    Each slot is one object, compared by identity.

    Attributes:
        name: what the capability is for, for people (`convert source`).
    """

    name: str


#: The capabilities a plugin may provide, by slot.
CONVERT_SOURCE: Slot[ConvertSource] = Slot("convert source")
TRAINING_STATE_WRITER: Slot[TrainingStateWriter] = Slot("training-state writer")
TRAINING_STATE_SOURCE: Slot[TrainingStateSource] = Slot("training-state source")
POINTER_WRITER: Slot[PointerWriter] = Slot("pointer writer")
SLIMMER: Slot[Slimmer] = Slot("slimmer")
