"""The framework classes the torch-pickle allowlist reads as inert `FrameworkObject`s, registered from above.

A training-state file pickles objects of the framework that wrote it (a loss scaler, a ZeRO stage enum, a
`TrainingArguments`). Which ones is each framework package's knowledge (its `pickle_classes` module), and
`formats` imports no framework: a source of them is handed in with `add_source` (the `ckptctl` package
does it when imported, with the layout registry's list of the framework packages), and read once, the
first time an allowlist is asked for a name it does not hold itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["FrameworkClasses", "add_source", "registered"]


@dataclass(frozen=True, slots=True)
class FrameworkClasses:
    """Classes of one framework that its files pickle, each read as a `FrameworkObject` stand-in.

    Attributes:
        classes: exact (module, name) pairs.
        modules: (module prefix, name suffix) pairs: every class of a module under the prefix whose name
            ends in the suffix ("" for any) is allowed (modules of plain config classes and enums).
        packages: the framework's top-level packages: a class of theirs outside the above is refused as
            unsupported (a newer version's class), never as the sign of a forged file.
        mappings: exact (module, name) pairs of dict subclasses (Lightning's `AttributeDict`), read as a
            dict stand-in that keeps their items (a pickle fills them item by item).
    """

    classes: frozenset[tuple[str, str]] = frozenset()
    modules: tuple[tuple[str, str], ...] = ()
    packages: frozenset[str] = frozenset()
    mappings: frozenset[tuple[str, str]] = frozenset()


_sources: list[Callable[[], Iterable[FrameworkClasses]]] = []
_assembled: FrameworkClasses | None = None
_lock = threading.Lock()


def add_source(source: Callable[[], Iterable[FrameworkClasses]]) -> None:
    """Register a function that returns framework classes; it is called once, when first needed."""
    global _assembled
    with _lock:
        _sources.append(source)
        _assembled = None


def registered() -> FrameworkClasses:
    """Every registered framework's classes together (the sources are read on the first call)."""
    global _assembled
    with _lock:
        if _assembled is None:
            found = [entry for source in _sources for entry in source()]
            _assembled = FrameworkClasses(
                frozenset(key for entry in found for key in entry.classes),
                tuple(rule for entry in found for rule in entry.modules),
                frozenset(package for entry in found for package in entry.packages),
                frozenset(key for entry in found for key in entry.mappings),
            )
        return _assembled
