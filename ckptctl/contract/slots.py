"""The slots a framework plugin's capabilities are declared under, apart from the capabilities themselves: the
registry names every plugin's slots at import, and a command that uses no capability (`verify`, `list`,
`inspect`) should not build the capabilities' dataclasses to do so (DESIGN §5: a command's fixed cost).

`contract.capabilities` gives each slot its type (`CONVERT_SOURCE: Slot[ConvertSource]`, the same object);
plugins and `ops` take them from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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


CONVERT_SOURCE: Slot[Any] = Slot("convert source")
TRAINING_STATE_WRITER: Slot[Any] = Slot("training-state writer")
TRAINING_STATE_SOURCE: Slot[Any] = Slot("training-state source")
POINTER_WRITER: Slot[Any] = Slot("pointer writer")
SLIMMER: Slot[Any] = Slot("slimmer")
