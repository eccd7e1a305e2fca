"""Threads for transfers: a bounded pool (`workers()` threads) whose tasks carry the operation's context.

An operation's byte counter (`io.counting`) and listing snapshot (`io.listing_snapshot`) are context
variables; a plain thread pool runs its tasks in a fresh context, where neither applies.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, CancelledError, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

__all__ = ["ContextThreadPool", "in_background", "parallel_map", "stop_if_cancelled", "workers"]

T = TypeVar("T")
R = TypeVar("R")


def stop_if_cancelled(cancel: threading.Event | None, what: str) -> None:
    """Raise `CancelledError` when `cancel` is set: background work whose answer is no longer wanted stops
    at its next step (`what` it was doing) rather than reading on."""
    if cancel is not None and cancel.is_set():
        raise CancelledError(f"{what} was cancelled")


def workers() -> int:
    """Threads for parallel transfers (`CKPTCTL_IO_WORKERS`, default 8): enough to fill a fast link to an
    object store without opening hundreds of connections."""
    try:
        return max(1, int(os.environ.get("CKPTCTL_IO_WORKERS", "8")))
    except ValueError:
        return 8


class ContextThreadPool(ThreadPoolExecutor):
    """A `ThreadPoolExecutor` whose tasks run in a copy of the context they were submitted from (`map` too).

    Once the interpreter has begun to shut down, a thread pool takes no new task (`RuntimeError`), yet work
    still runs then: a training loop's last save from an `atexit` hook, the background commit of an async
    save that `threading` joins at exit. Such a task runs in the calling thread instead, and its `Future` is
    returned done, so the save completes rather than failing.
    """

    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Future[R]:
        try:
            return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)
        except RuntimeError:
            if not _shutting_down():
                raise
        done: Future[R] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as error:
            done.set_exception(error)
        return done


def in_background(fn: Callable[..., R], /, *args: Any) -> Future[R]:
    """`fn(*args)` started at once on a thread of its own, in a copy of the caller's context; its `Future`.

    A daemon thread: work that only reads, started ahead of what it is for (a command's scan while it takes a
    lock), which a command that fails meanwhile leaves behind rather than waiting for it at exit.
    """
    future: Future[R] = Future()
    context = contextvars.copy_context()

    def run() -> None:
        try:
            future.set_result(context.run(fn, *args))
        except BaseException as error:
            future.set_exception(error)

    threading.Thread(target=run, name=f"ckptctl-{getattr(fn, '__name__', 'background')}", daemon=True).start()
    return future


def _shutting_down() -> bool:
    """Whether `concurrent.futures` refuses new tasks because the interpreter is exiting (it sets this flag
    from `threading`'s exit hook, before `atexit` callbacks run)."""
    from concurrent.futures import thread

    return bool(getattr(thread, "_shutdown", False))


def parallel_map(fn: Callable[[T], R], items: Sequence[T], max_workers: int | None = None) -> list[R]:
    """`[fn(item) for item in items]` on a bounded thread pool, results in order.

    On the first error (or an interrupt) the calls not yet started are cancelled, and the error is raised
    once the running ones have ended, so that no transfer is left running in the background. Each call runs
    in a copy of the caller's context (a `listing_snapshot` or byte counter the caller is inside applies to it).
    """
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ContextThreadPool(max_workers=min(max_workers or workers(), len(items))) as pool:
        futures = [pool.submit(fn, item) for item in items]
        try:
            _done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        except BaseException:  # Ctrl-C: start nothing more, let the running calls end
            for future in futures:
                future.cancel()
            raise
        for future in pending:
            future.cancel()
    for future in futures:
        if not future.cancelled() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]
    return [f.result() for f in futures]
