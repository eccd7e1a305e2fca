"""Deletions off the training thread: the manager's purges of retired checkpoints run here.

Retention takes a doomed checkpoint out of sight at once (`io.trash.retire`: a rename, or deleting its
manifest on an object store), so that the steps the manager lists are right the moment `save` returns;
deleting its gigabytes is queued to one background thread, as torchtitan's checkpointer does with its
purge thread. A slow filesystem or a throttled object store then delays the deletion, not the next step.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

__all__ = ["BackgroundDeleter", "OneBackgroundThread"]

log = logging.getLogger("ckptctl.core")


class OneBackgroundThread:
    """At most one worker thread of an owner's queue (deletions, mirror copies): started by `_wake` when work is
    queued and none runs, ending when the queue is empty (the subclass's `_run` clears `_thread` under `_lock`).
    Not a daemon thread, so the interpreter waits for queued work at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []

    def _wake(self, name: str) -> None:
        """Start the worker unless it runs (call with `_lock` held). Not alive: a forked child's copy."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=name)
            self._thread.start()

    def _run(self) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Block until the queued work has run (or failed)."""
        while True:
            with self._lock:
                thread = self._thread
            if thread is None or not thread.is_alive():
                return
            thread.join()

    def take_errors(self) -> list[BaseException]:
        """The failures since the last call (without waiting for the work still queued)."""
        with self._lock:
            errors, self._errors = self._errors, []
        return errors


class BackgroundDeleter(OneBackgroundThread):
    """Runs deletion jobs one after another, in submission order, on a background thread.

    The thread starts with the first job and ends when the queue is empty. It is not a daemon thread, so
    the interpreter waits for queued deletions at exit (a process that is killed leaves them in the trash,
    where the next retention or `ckptctl prune` finds them). Failures are kept for the owner to report on
    its own thread (`take_errors`), as a background save's failure is.
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._jobs: collections.deque[Callable[[], object]] = collections.deque()

    def submit(self, job: Callable[[], object]) -> None:
        """Queue `job`; it runs after the jobs queued before it."""
        with self._lock:
            self._jobs.append(job)
            self._wake(self._name)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs.popleft()
            try:
                job()
            except BaseException as exc:  # handed to the owner's thread by take_errors
                log.debug("background deletion failed: %s", exc)
                with self._lock:
                    self._errors.append(exc)
