"""One output object for every command: data to stdout (rich for people, JSON for scripts), the rest to stderr."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from ckptctl.ops.report import finite_json


class Output:
    """Renders reports; `json_mode` prints one JSON document on stdout, `quiet` silences everything but errors."""

    def __init__(self, *, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        # Consoles are created per call so that they follow sys.stdout/sys.stderr as tests swap them.
        self.out = Console(highlight=False, soft_wrap=False)
        self.err = Console(stderr=True, highlight=False)

    def json(self, document: dict[str, Any]) -> None:
        with _closed_pipe_is_fine():
            sys.stdout.write(json.dumps(finite_json(document), indent=2, allow_nan=False) + "\n")
            sys.stdout.flush()

    def print(self, *renderables: Any) -> None:
        """Human output (stdout); nothing in JSON or quiet mode."""
        if not self.json_mode and not self.quiet:
            with _closed_pipe_is_fine():
                self.out.print(*renderables)

    def note(self, message: str) -> None:
        """A remark for a person (stderr), printed as plain text; nothing in quiet mode."""
        if not self.quiet:
            self.err.print(message, markup=False)

    def warn(self, message: str) -> None:
        """A warning (stderr), printed as plain text after a coloured label."""
        self.err.print(f"[yellow]warning:[/yellow] {esc(message)}")

    def progress(self) -> RichProgress:
        """A progress sink for `ckptctl.ops` that draws on stderr when it is a terminal."""
        return RichProgress(self.err, enabled=not self.quiet and self.err.is_terminal)


class RichProgress:
    """Implements `ckptctl.ops.report.Progress` with a rich progress bar (bytes and rate)."""

    def __init__(self, console: Console, *, enabled: bool) -> None:
        self._enabled = enabled
        self._console = console
        self._bar: Progress | None = None
        self._task: Any = None

    def start(self, description: str, total: int | None) -> None:
        if not self._enabled:
            return
        self.finish()
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self._console,
            transient=True,
        )
        self._bar.start()
        self._task = self._bar.add_task(description, total=total)

    def advance(self, amount: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, amount)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextlib.contextmanager
def _closed_pipe_is_fine() -> Iterator[None]:
    """`ckptctl list --json | head` closes stdout early: the reader got what it wanted, so exit 0 quietly."""
    try:
        yield
    except BrokenPipeError:
        # Point stdout at /dev/null so that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


def esc(value: object) -> str:
    """`value` as literal text inside rich markup.

    Every string that comes from the user or the checkpoint (paths, tensor names, notes, messages) goes
    through this before it meets markup: a folder named `exp[lr=3e-4]` would otherwise lose its brackets
    and one named `run[/bold]` would crash the renderer.
    """
    return escape(str(value))


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


STATE_STYLE = {"complete": "green", "in_progress": "yellow", "broken": "red"}
