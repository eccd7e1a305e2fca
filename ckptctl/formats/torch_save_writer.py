"""Writing torch.save files whose objects were read with the safe unpickler.

`reshard` writes files a framework's own loader `torch.load`s (DeepSpeed's `optimizer_state.pt`), built from
values ckptctl read without running anything: plain Python values, torch tensors it made, and the stand-ins
the safe unpickler handed back for the framework's own classes (`safe_pickle.FrameworkObject`: a
`LossScaler`, a `ZeroStageEnum` member). A stand-in is written back as the class it stands for, by name,
the way pickle wrote it: an enum member as `Class(value)` (GLOBAL + REDUCE), any other object as
`Class.__new__(Class)` given its stored state (GLOBAL + NEWOBJ + BUILD), so that the framework's loader
gets the object it saved. Nothing is imported to write a class name, and no file is ever loaded here.
"""

from __future__ import annotations

import pickle
from typing import Any

from ckptctl.errors import StorageError
from ckptctl.formats.safe_pickle import FrameworkObject

__all__ = ["save_torch"]


#: The pure-Python pickler (typeshed does not describe it), whose `save` a subclass can take over.
_PurePickler: Any = pickle._Pickler


class _Pickler(_PurePickler):
    def _save_framework_object(self, obj: FrameworkObject) -> None:
        module, _, name = obj.stands_for.rpartition(".")
        if not module or not name.isidentifier():
            raise StorageError(f"cannot write an object of {obj.stands_for!r} by name")
        self.write(pickle.GLOBAL + module.encode("utf-8") + b"\n" + name.encode("utf-8") + b"\n")
        if obj.value is not None:  # an enum member: its class called with its value
            self.save((obj.value,))
            self.write(pickle.REDUCE)
            self.memoize(obj)
            return
        self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
        self.memoize(obj)
        state = getattr(obj, "state", None)
        if state is not None:
            self.save(state)
            self.write(pickle.BUILD)

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, FrameworkObject):  # stand-in classes are made per name: no exact-type dispatch
            self._save_framework_object(obj)
            return
        super().save(obj, save_persistent_id)


class _PickleModule:
    """What `torch.save(pickle_module=...)` takes: a module-like object with a `Pickler`."""

    Pickler = _Pickler
    __name__ = "pickle"


def save_torch(obj: Any, path: str) -> None:
    """`torch.save(obj, path)` (the zip format torch 1.6+ writes), with safe-unpickler stand-ins of framework
    classes written as those classes.

    Raises:
        StorageError: the file cannot be written.
    """
    import torch

    try:
        torch.save(obj, path, pickle_module=_PickleModule)
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from exc
