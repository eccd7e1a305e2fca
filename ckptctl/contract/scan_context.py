"""The scan context: what one operation has learnt about the folders around the candidates it identified.

Below the shared readers and the registry because readers (a ZeRO tag telling an OpenRLHF tag from a plain
DeepSpeed one) peek at their parent folder while the registry's scan identifies them.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

from ckptctl import io
from ckptctl.errors import CkptctlError

__all__ = ["ScanContext", "peek", "peek_dir", "scan_context"]

_PEEK_LIMIT = 4096
_LISTING = "listing"
T = TypeVar("T")


class ScanContext:
    """The peeks of one operation: listings of the folders around a candidate (its parent, its siblings),
    which some layouts need to tell apart frameworks that write the same files (an OpenRLHF tag from a
    plain DeepSpeed one), and facts derived from them.

    Owned by the operation that opens it with `scan_context()` (a scan, a `detect`, a command that scans
    and then opens every checkpoint it found) and dropped when that ends, so that nothing outlives the
    operation. A local folder's peek is keyed by its mtime as well, so that a folder that gained or lost
    entries within the operation is listed again; a remote one is listed once per context. Thread-safe:
    the walker's threads share their caller's context (`io.parallel_map` copies the context variables).
    """

    def __init__(self) -> None:
        self._peeks: dict[tuple[str, int], dict[Any, Any]] = {}
        self._lock = threading.Lock()

    def peek_dir(self, url: str) -> list[io.DirEntry] | None:
        """See the module function `peek_dir`."""
        slot = self._slot(url)
        return None if slot is None else slot[_LISTING]

    def peek(self, url: str, derive: Callable[[str, list[io.DirEntry]], T]) -> T | None:
        """See the module function `peek`."""
        slot = self._slot(url)
        if slot is None or slot[_LISTING] is None:
            return None
        with self._lock:
            if derive in slot:
                return cast(T, slot[derive])
        value = derive(url, slot[_LISTING])
        with self._lock:
            slot[derive] = value
        return value

    def _slot(self, url: str) -> dict[Any, Any] | None:
        version = 0
        # A local folder's mtime tells a stale peek from a fresh one for one syscall; on an object store that
        # would be a request per peek, and the listing itself is the only version there is.
        if io.is_local(url):
            try:
                version = os.stat(io.local_path(url)).st_mtime_ns
            except OSError:
                return None
        key = (url, version)
        with self._lock:
            slot = self._peeks.get(key)
        if slot is not None:
            return slot
        try:
            listing: list[io.DirEntry] | None = io.list_dir(url)
        except CkptctlError:
            listing = None
        slot = {_LISTING: listing}
        with self._lock:
            if len(self._peeks) >= _PEEK_LIMIT:
                self._peeks.clear()
            self._peeks[key] = slot
        return slot


_current_scan: contextvars.ContextVar[ScanContext | None] = contextvars.ContextVar("ckptctl_scan", default=None)


@contextlib.contextmanager
def scan_context() -> Iterator[ScanContext]:
    """The scan context of the current operation: the one already open (a `detect` inside a scan shares
    the scan's), or a new one for the duration of the block."""
    active = _current_scan.get()
    if active is not None:
        yield active
        return
    context = ScanContext()
    token = _current_scan.set(context)
    try:
        yield context
    finally:
        _current_scan.reset(token)


def peek_dir(url: str) -> list[io.DirEntry] | None:
    """The listing of the folder at `url` (None when it is not a folder), listed once per scan context.

    Layouts call it for the parent or the siblings of a folder they are identifying, so a save folder of
    1,000 tags is listed once, not once per tag. Outside any scan context it lists the folder afresh.
    """
    return (_current_scan.get() or ScanContext()).peek_dir(url)


def peek(url: str, derive: Callable[[str, list[io.DirEntry]], T]) -> T | None:
    """`derive(url, listing)` for the folder at `url`, computed once per scan context like `peek_dir`
    (None when it is not a folder). For facts about a folder that every one of its children asks for
    (whether a save folder holds `best_*` tags), which would cost N x N on a folder of N checkpoints
    otherwise."""
    return (_current_scan.get() or ScanContext()).peek(url, derive)
