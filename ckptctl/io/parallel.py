"""Threads for I/O that carry the operation's context with them.

An operation's byte counter (`io.counting`) and listing snapshot (`io.listing_snapshot`) are context
variables; a plain thread pool runs its tasks in a fresh context, where neither applies.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["ContextThreadPool"]

R = TypeVar("R")


class ContextThreadPool(ThreadPoolExecutor):
    """A `ThreadPoolExecutor` whose tasks run in a copy of the context they were submitted from (`map` too)."""

    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Future[R]:
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)
