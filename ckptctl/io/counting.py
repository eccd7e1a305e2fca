"""How many bytes an operation read: a counter each operation opens for itself.

`with io.counting() as read:` opens a counter for the block; every read made in the block through `io`
(and through the format readers, which report with `count_read`) adds to it, also from the threads of
`io.parallel_map` and of an `io.ContextThreadPool` started in the block, and to every enclosing counter.
Operations running at the same time (two threads of one process) count apart, unlike a global counter
read before and after. Commands report the count as `bytes_read`.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

__all__ = ["READ_STATS", "ByteCounter", "ReadStats", "count_read", "count_read_elsewhere", "counting"]


class ByteCounter:
    """Bytes read so far by one operation (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0

    def add(self, n: int) -> None:
        with self._lock:
            self._bytes += n

    @property
    def bytes_read(self) -> int:
        return self._bytes


class ReadStats(ByteCounter):
    """The bytes this process has read through `io` since it started (or since `reset`), whatever the
    operation: for benchmarks and tests; commands count with `counting`."""

    def reset(self) -> None:
        with self._lock:
            self._bytes = 0


#: Every byte read in this process.
READ_STATS = ReadStats()

_COUNTERS: contextvars.ContextVar[tuple[ByteCounter, ...]] = contextvars.ContextVar("ckptctl_io_counters", default=())


@contextlib.contextmanager
def counting() -> Iterator[ByteCounter]:
    """A counter of the bytes read in the block (by this thread and the threads it starts through `io`)."""
    counter = ByteCounter()
    token = _COUNTERS.set((*_COUNTERS.get(), counter))
    try:
        yield counter
    finally:
        _COUNTERS.reset(token)


def count_read(n: int) -> None:
    """Count `n` bytes read: in every counter open in the caller's context, and in `READ_STATS`."""
    READ_STATS.add(n)
    for counter in _COUNTERS.get():
        counter.add(n)


def count_read_elsewhere(n: int) -> None:
    """Count `n` bytes that other processes read for the caller's operation (the other ranks of a job,
    `ops.distributed_work`): in every counter open in the caller's context, not in this process's
    `READ_STATS`."""
    for counter in _COUNTERS.get():
        counter.add(n)
