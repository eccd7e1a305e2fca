"""A small parse cache for the whole process, keyed by a file's version (URL, size, mtime).

A module that parses one kind of small file (a DCP `.metadata`, a ByteCheckpoint `.metadata`, a DeepSpeed
states pickle's top level) owns one, not a scan (`contract.scan_context`): `identify`, `open` and `verify` of a
checkpoint ask for the same file in turn, and a cache keyed by its version serves only the bytes it parsed,
whichever operation asks. A store that reports no mtime is not cached (it could not tell a rewritten file
from the cached one); object stores report whole seconds, so a file rewritten in place with the same size
within one second of an earlier read could be served stale.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from ckptctl.io import DirEntry

__all__ = ["ParseCache"]

T = TypeVar("T")


class ParseCache(Generic[T]):
    """The last `size` files parsed, least recently used first out; safe to share between threads."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[tuple[str, int, float], T] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: str, entry: DirEntry, parse: Callable[[], T]) -> T:
        """The parsed file at `path` (`entry`: its listing entry): the cached one when its version is there,
        else `parse()`, kept when the store gave an mtime. What `parse` raises is raised, and nothing kept."""
        key = (path, entry.size, entry.mtime)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        parsed = parse()
        if entry.mtime:
            with self._lock:
                self._items[key] = parsed
                while len(self._items) > self._size:
                    self._items.popitem(last=False)
        return parsed

    def clear(self) -> None:
        """Forget every parsed file (a bench that times the parse itself: `bench/list_inspect.py`)."""
        with self._lock:
            self._items.clear()
