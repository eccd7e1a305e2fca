"""Inert stand-ins for the modules a framework imports but that are not installed here (GPU, cluster, logging
and data packages its save path never uses), served only to imports made by that framework's own modules.

A real writer (tests/writers/<framework>_writer.py) runs the framework's own saving code in its ranks. Its
modules import `ray`, `triton`, `omegaconf`, ... at module level; `StandIns` answers those imports with
`InertModule`s, whose every attribute is an `Inert` class that can be subclassed, called, indexed and
combined with `|` and does nothing. Being last on `sys.meta_path`, an installed module always wins, and
imports made by anything but the framework (torch or transformers probing for triton) still see the
module missing.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

__all__ = ["Inert", "InertModule", "StandIns"]


class _InertMeta(type):
    """Classes whose every attribute is another inert class: `openai.types.chat.X | None`, `Foo[int]`,
    subclassing and calling all work, and do nothing."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _InertMeta(name, (Inert,), {})
        setattr(cls, name, value)
        return value

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls

    def __getitem__(cls, item: Any) -> Any:
        return cls


class Inert(metaclass=_InertMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Inert()


class InertModule(types.ModuleType):
    """A module whose attributes are `attributes`, and an inert class for any other name."""

    def __init__(self, name: str, **attributes: Any) -> None:
        super().__init__(name)
        self.__dict__.update(attributes)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _InertMeta(name, (Inert,), {})
        setattr(self, name, value)
        return value


class StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a stand-in for every module under the top-level names `stood_in`, to imports made by the
    modules of `framework` only; `make(full_name)` builds one (an `InertModule` unless given)."""

    def __init__(
        self,
        framework: str,
        stood_in: Collection[str],
        make: Callable[[str], types.ModuleType] = InertModule,
    ) -> None:
        self.framework = framework
        self.stood_in = frozenset(stood_in)
        self.make = make

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname.partition(".")[0] not in self.stood_in or not self._asked_by_framework():
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = self.make(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass

    def _asked_by_framework(self) -> bool:
        """Whether the import being resolved was asked for by a module of the framework (the first frame
        outside the import machinery, above `find_spec`)."""
        frame = sys._getframe(2)
        while frame is not None:
            filename = frame.f_code.co_filename
            if not filename.startswith("<frozen") and "importlib" not in filename:
                return str(frame.f_globals.get("__name__", "")).partition(".")[0] == self.framework
            frame = frame.f_back  # type: ignore[assignment]
        return False

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """The stand-ins for the imports made inside the block; after it they leave `sys.modules` again (the
        framework's modules keep their references)."""
        sys.meta_path.append(self)
        try:
            yield
        finally:
            sys.meta_path.remove(self)
            for name in [n for n, m in sys.modules.items() if getattr(m, "__loader__", None) is self]:
                del sys.modules[name]
