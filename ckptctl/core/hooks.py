"""`AutoSaver`: checkpoint a plain training loop every N steps and/or seconds, and once more at exit."""

from __future__ import annotations

import atexit
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from ckptctl.core.entries import CheckpointWarning
from ckptctl.core.manager import CheckpointManager

__all__ = ["AutoSaver"]


class AutoSaver:
    """Decides when a loop saves: call `step()` once per iteration, after the optimizer step.

    At exit (leaving the `with` block, `close()`, or interpreter exit through `atexit`) the last step
    seen is saved unless it was saved already. Exits caused by an exception do not save: the state may be
    half-way through an update, and a checkpoint that looks complete but is not is worse than none. In a
    multi-rank run every rank must reach that save: leave the `with` block (or call `close()`) before
    destroying the process group rather than relying on `atexit`.

    Args:
        manager: where to save.
        state: the state dict to save (the same object every time; its entries are read at save time).
        every_steps: save when `step % every_steps == 0`.
        every_seconds: save when this many seconds have passed since the last save (or since creation).
        save_on_exit: save the last step seen at exit.
        clock: seconds, monotonic; tests pass a fake.

    Example:
        >>> with AutoSaver(manager, state, every_steps=500, every_seconds=1800) as saver:
        ...     for step in range(start, total):
        ...         train_step()
        ...         saver.step(step, metrics={"loss": loss.item()})
    """

    def __init__(
        self,
        manager: CheckpointManager,
        state: Mapping[str, Any],
        every_steps: int | None = None,
        every_seconds: float | None = None,
        save_on_exit: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if every_steps is not None and every_steps < 1:
            raise ValueError(f"every_steps must be positive, not {every_steps}")
        if every_seconds is not None and every_seconds <= 0:
            raise ValueError(f"every_seconds must be positive, not {every_seconds}")
        self.manager = manager
        self.state = state
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.save_on_exit = save_on_exit
        self._clock = clock
        self._last_save_time = clock()
        self._last_step: int | None = None
        self._last_metrics: Mapping[str, Any] | None = None
        self._saved_step: int | None = None
        self._closed = False
        atexit.register(self._at_exit)

    @property
    def last_saved_step(self) -> int | None:
        return self._saved_step

    def step(self, step: int, metrics: Mapping[str, Any] | None = None) -> bool:
        """Record that `step` is done; save it if a rule says so. Returns whether it saved."""
        self._last_step, self._last_metrics = step, metrics
        due = bool(self.every_steps and step % self.every_steps == 0) or bool(
            self.every_seconds and self._clock() - self._last_save_time >= self.every_seconds
        )
        if due and step != self._saved_step:
            self._save(step, metrics)
            return True
        return False

    def close(self) -> None:
        """Save the last step seen (if `save_on_exit` and not saved yet) and wait for it to commit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        if self.save_on_exit and self._last_step is not None and self._last_step != self._saved_step:
            self._save(self._last_step, self._last_metrics)
        self.manager.wait()

    def _save(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        self.manager.save(step, self.state, metrics=metrics)
        self._saved_step = step
        self._last_save_time = self._clock()

    def _at_exit(self) -> None:
        # An uncaught exception sets sys.last_value before atexit handlers run: do not save then.
        if getattr(sys, "last_value", None) is not None:
            self._closed = True
            self.manager.wait()
            return
        # Python 3.12+ refuses to start threads at interpreter shutdown: the exit save is synchronous.
        self.manager.async_save = False
        self.close()

    def __enter__(self) -> AutoSaver:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        try:
            self.manager.wait()
        except Exception as error:  # the loop's own exception is the one to propagate
            warnings.warn(f"the last background save failed too: {error}", CheckpointWarning, stacklevel=2)
