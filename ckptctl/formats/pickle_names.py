"""What the modules that write pickles naming classes ckptctl never imports share (`torch_save_writer`'s
torch.save files, `dcp_metadata_write`'s DCP `.metadata`): such a class or function as an object the pickle
writes by name (`PickledName`: GLOBAL `module name`), and the pickler whose `save` each takes over to write
its stand-ins (`PurePickler`).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

__all__ = ["PickledName", "PurePickler", "global_opcode"]


@dataclass(frozen=True, slots=True)
class PickledName:
    """A class or function that a pickle names (GLOBAL `module name`) and that is never imported here."""

    module: str
    name: str


def global_opcode(module: str, name: str) -> bytes:
    """The GLOBAL opcode naming `module.name`, as pickle writes a class or function it finds by name."""
    return pickle.GLOBAL + module.encode("utf-8") + b"\n" + name.encode("utf-8") + b"\n"


#: The pure-Python pickler (typeshed does not describe it), whose `save` a subclass can take over.
PurePickler: Any = pickle._Pickler
