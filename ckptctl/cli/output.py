"""One output object for every command: data to stdout (rich for people, JSON for scripts), the rest to stderr.

Every string a person sees goes through `Output` (and the error boundary through `printable`): names from a
checkpoint (folders, files, tensors, the messages that quote them) are never markup, and their control
characters are shown as escapes (`\\x1b`), so that a folder named `ESC[2J` or holding an OSC 52 sequence
cannot clear the screen, set the title or write the clipboard. JSON output keeps every name exact (JSON
escapes control characters itself).

rich is imported only where it draws: a terminal, a table, a grid of facts, a progress bar. A command whose
human output is a few lines printed to a pipe or a file (`ckptctl verify FILE` in a script or CI) writes them
itself, exactly as rich would (DESIGN §5: a command's fixed cost; rich's import is a tenth of it).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, Protocol, TextIO, TypeVar

from ckptctl.ops.report import finite_json
from ckptctl.quoting import printable
from ckptctl.units import human_bytes  # noqa: F401  (re-exported: the commands print sizes through this module)

if TYPE_CHECKING:  # rich is imported where it draws (the module's docstring)
    from rich.console import Console
    from rich.progress import Progress
    from rich.text import Text

#: Whether the command being run prints JSON lines (`Output(json_lines=True)`: `sync --watch --json`), which
#: `cli.app`'s error boundary reads, so that the error document ending such a stream is one line too.
JSON_LINES: ContextVar[bool] = ContextVar("ckptctl_json_lines", default=False)

#: Between two columns of a table.
_GAP = "  "


@dataclass(frozen=True, slots=True)
class Column:
    """A column of a table `Output.table` prints.

    Attributes:
        header: its title.
        justify: `right` for numbers.
        flexible: prose (notes, reasons) that a narrow terminal may shorten with an ellipsis. Other cells
            (paths, names, numbers, states) are always printed whole.
        drop: in a terminal too narrow for the table, columns are left out in this order (1 first) after
            the flexible ones have been shortened; None: never left out.
    """

    header: str
    justify: Literal["left", "right"] = "left"
    flexible: bool = False
    drop: int | None = None


@dataclass(frozen=True, slots=True)
class Styled:
    """Literal text in styles (`styled`), rich's `Text` once drawn in a terminal; `+` joins (a str is unstyled).

    Attributes:
        parts: (text, style) pairs, each text with its control characters already escaped (`printable`).
    """

    parts: tuple[tuple[str, str], ...]

    @property
    def plain(self) -> str:
        """The text without its styles."""
        return "".join(text for text, _ in self.parts)

    def __add__(self, other: Styled | str) -> Styled:
        return Styled(self.parts + (other.parts if isinstance(other, Styled) else ((printable(other), ""),)))


Cell = str | Styled


class Output:
    """Renders reports; `json_mode` prints one JSON document on stdout (`json_lines`: one document per line,
    for a command that prints one after another), `quiet` silences everything but errors."""

    def __init__(self, *, json_mode: bool = False, quiet: bool = False, json_lines: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        self.json_lines = json_mode and json_lines
        if self.json_lines:
            JSON_LINES.set(True)

    # Both consoles write to whatever sys.stdout/sys.stderr are at the time (tests swap them). Lines are never
    # wrapped by us (soft wrap): a terminal wraps them itself, and a pipe gets them whole.
    @cached_property
    def out(self) -> Console:
        """rich's console on stdout, made on first use."""
        from rich.console import Console

        return Console(highlight=False, soft_wrap=True)

    @cached_property
    def err(self) -> Console:
        """rich's console on stderr, made on first use."""
        from rich.console import Console

        return Console(stderr=True, highlight=False, soft_wrap=True)

    @property
    def is_terminal(self) -> bool:
        """Whether stdout is a terminal (tables fit its width) rather than a pipe, a file or a CI log."""
        return not _plain(sys.stdout) and self.out.is_terminal

    def json(self, document: dict[str, Any]) -> None:
        """The document on stdout, indented; with `json_lines`, on one line (JSON lines, which `jq -c`,
        `pandas.read_json(lines=True)` and line-by-line readers take)."""
        text = json.dumps(finite_json(document), indent=None if self.json_lines else 2, allow_nan=False)
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def print(self, *parts: Cell) -> None:
        """One line of human output (stdout), the parts joined by spaces; strings are literal text (colour
        comes from `styled` parts). Nothing in JSON or quiet mode."""
        if self.json_mode or self.quiet:
            return
        if _plain(sys.stdout):
            _write(sys.stdout, " ".join(_plain_text(part) for part in parts))
            return
        from rich.text import Text

        self.out.print(Text(" ").join(_text(part) for part in parts))

    def table(self, columns: Sequence[Column], rows: Sequence[Sequence[Cell]], *, title: str | None = None) -> None:
        """Rows under a header line, columns aligned, no borders (as `docker ps` and `kubectl get` print).

        Anywhere but a terminal (a pipe, a file, a CI log) every cell is printed whole, rows never wrap,
        empty cells read `-` (so that `awk` counts columns right) and no line ends in spaces. In a terminal
        the table fits its width when it can: flexible columns are shortened, then columns with a `drop`
        rank are left out (said on stderr); paths and names are never shortened. `title` is a line above.
        """
        if self.json_mode or self.quiet:
            return
        from rich.cells import cell_len
        from rich.text import Text

        terminal = self.is_terminal
        cells = [[_text(cell) for cell in row] for row in rows]
        if not terminal:
            cells = [[cell if cell.plain else Text("-") for cell in row] for row in cells]
        widths = [max([cell_len(c.header), *(cell_len(row[i].plain) for row in cells)]) for i, c in enumerate(columns)]
        shown = list(range(len(columns)))
        if terminal:
            shown, widths = _fit(columns, widths, self.out.width)
        if title:
            self.out.print(_text(styled(title, "bold" if terminal else "")))
        header = [_text(styled(c.header, "bold" if terminal else "")) for c in columns]
        for row in (header, *cells):
            line = Text()
            for i in shown:
                cell = row[i]
                if cell_len(cell.plain) > widths[i]:
                    cell = cell.copy()
                    cell.truncate(widths[i], overflow="ellipsis")
                pad = Text(" " * (widths[i] - cell_len(cell.plain)))
                line.append_text(pad + cell if columns[i].justify == "right" else cell + pad)
                line.append(_GAP)
            line.rstrip()
            self.out.print(line, no_wrap=True, overflow="ignore", crop=False)
        left_out = [columns[i].header for i in range(len(columns)) if i not in shown]
        if left_out:
            self.note(f"({', '.join(left_out)} left out to fit {self.out.width} columns; --json shows everything)")

    def facts(self, rows: Sequence[tuple[str, Cell]]) -> None:
        """`name  value` lines (a checkpoint's facts, a plan's verdicts).

        In a terminal, long values wrap inside their column; anywhere else every line is printed whole.
        """
        if self.json_mode or self.quiet:
            return
        from rich.cells import cell_len

        if self.is_terminal:
            from rich.table import Table

            grid = Table.grid(padding=(0, 2))
            grid.add_column(style="bold", no_wrap=True)
            grid.add_column()
            for name, value in rows:
                grid.add_row(_text(name), _text(value))
            self.out.print(grid)
            return
        width = max((cell_len(name) for name, _ in rows), default=0)
        for name, value in rows:
            line = _text(name + " " * (width - cell_len(name)) + _GAP) + _text(value)
            line.rstrip()
            self.out.print(line, no_wrap=True, overflow="ignore", crop=False)

    def note(self, message: str) -> None:
        """A remark for a person (stderr), printed as plain text; nothing in quiet mode."""
        if self.quiet:
            return
        if _plain(sys.stderr):
            _write(sys.stderr, printable(message))
        else:
            self.err.print(_text(message))

    def warn(self, message: str) -> None:
        """A warning (stderr), printed as plain text after a coloured label."""
        line = styled("warning:", "yellow") + " " + message
        if _plain(sys.stderr):
            _write(sys.stderr, line.plain)
        else:
            self.err.print(_text(line))

    def progress(self) -> RichProgress:
        """A progress sink for `ckptctl.ops` that draws on stderr when it is a terminal that can redraw a line
        (not TERM=dumb, where each bar would only leave an empty line behind)."""
        if self.quiet or _plain(sys.stderr):
            return RichProgress(None, enabled=False)
        err = self.err
        return RichProgress(err, enabled=err.is_terminal and not err.is_dumb_terminal)


class RichProgress:
    """Implements `ckptctl.ops.report.Progress` with a rich progress bar (bytes and rate)."""

    def __init__(self, console: Console | None, *, enabled: bool) -> None:
        self._enabled = enabled
        self._console = console
        self._bar: Progress | None = None
        self._task: Any = None

    def start(self, description: str, total: int | None) -> None:
        if not self._enabled:
            return
        self.finish()
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._bar = Progress(
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self._console,
            transient=True,
        )
        self._bar.start()
        self._task = self._bar.add_task(printable(description), total=total)

    def advance(self, amount: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, amount)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _plain(stream: TextIO) -> bool:
    """Whether rich would print to `stream` as to a pipe or a file (no styles, nothing wrapped or cropped), so
    that a line can be written without it: not a terminal, and nothing that makes rich treat it as one or draw
    otherwise (`TTY_COMPATIBLE`, `FORCE_COLOR`, a notebook). Where unsure, False: rich decides."""
    if os.environ.get("TTY_COMPATIBLE") or os.environ.get("FORCE_COLOR") is not None or "IPython" in sys.modules:
        return False
    try:
        return not stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream: rich says "not a terminal" too
        return True


def _write(stream: TextIO, line: str) -> None:
    """`line` as rich prints a text with soft wrap to a pipe: as it is, then a newline."""
    stream.write(line + "\n")


def _plain_text(cell: Cell) -> str:
    """A cell's text with its control characters escaped (as `_text` draws it, without the styles)."""
    return printable(cell) if isinstance(cell, str) else cell.plain


def _text(cell: Cell) -> Text:
    """A cell as rich text with its control characters escaped (`Styled` parts were escaped when made)."""
    from rich.text import Text

    if isinstance(cell, str):
        return Text(printable(cell))
    text = Text()
    for part, style in cell.parts:
        text.append(part, style=style or None)
    return text


def _fit(columns: Sequence[Column], widths: list[int], available: int) -> tuple[list[int], list[int]]:
    """Which columns to show, and their widths, for a terminal `available` cells wide.

    Flexible columns shrink first (widest first, to 12 cells), then columns are left out in their `drop`
    order, then flexible ones shrink to their header. A table that still does not fit is printed as it is
    (the terminal wraps its lines): whole values beat cut ones.
    """
    from rich.cells import cell_len

    widths = list(widths)
    shown = list(range(len(columns)))

    def excess() -> int:
        return sum(widths[i] for i in shown) + len(_GAP) * (len(shown) - 1) - available

    def shrink(floor: int) -> None:
        while excess() > 0:
            flexible = [i for i in shown if columns[i].flexible and widths[i] > max(floor, cell_len(columns[i].header))]
            if not flexible:
                return
            widths[max(flexible, key=lambda i: widths[i])] -= 1

    shrink(12)
    for i in sorted((i for i, c in enumerate(columns) if c.drop is not None), key=lambda i: columns[i].drop or 0):
        if excess() <= 0:
            break
        shown.remove(i)
    shrink(0)
    return shown, widths


def styled(text: str, style: str) -> Styled:
    """`text` (literal, never markup; control characters escaped) in `style` (colours show in a terminal only).

    Strings from a checkpoint become rich text only through here and `Output`: rich's `Text` would silently drop
    some control characters (BEL, CR) that `printable` shows. The style is a span, not the text's own style,
    so that `styled(url, "green") + styled(" (DeepSpeed)", "")` colours the url alone."""
    return Styled(((printable(text), style),))


def when(value: datetime | None, *, now: datetime | None = None) -> str:
    """A local time to the second, with the year when it is not this year's (`05-14 09:31:02`,
    `2023-11-02 17:04:55`)."""
    if value is None:
        return "-"
    local = value.astimezone()
    current = (now or datetime.now()).astimezone()
    return local.strftime("%m-%d %H:%M:%S" if local.year == current.year else "%Y-%m-%d %H:%M:%S")


class WriteResult(Protocol):
    """What `show_write` needs of a writing command's result (`ConvertResult`, `AverageResult`)."""

    @property
    def warnings(self) -> Sequence[str]: ...

    def to_json(self) -> dict[str, Any]: ...


R = TypeVar("R", bound=WriteResult)


def show_write(
    out: Output, dst: str, run: Callable[[RichProgress], R], render: Callable[[Output, R], None], *, show: bool = True
) -> None:
    """Run a command that writes DST (`convert`, `average`) with a progress bar, and show its result: its warnings,
    then its JSON document or `render`. An interrupt says what was left at DST (`interrupted_write`). `show` False:
    a rank of a job that is not the one that prints."""
    try:
        result = run(out.progress())
    except KeyboardInterrupt:
        out.note(interrupted_write(dst))
        raise
    if not show:
        return
    if not out.quiet:
        for note in result.warnings:
            out.warn(note)
    if out.json_mode:
        out.json(result.to_json())
        return
    render(out, result)


def interrupted_write(dst: str) -> str:
    """What an interrupted `convert` or `reshard` left at DST: nothing (its staging folder removed, and on an
    object store, the objects it had uploaded)."""
    if "://" in dst and not dst.startswith("file://"):
        return f"interrupted: the staging folder and the objects uploaded so far to {dst} were removed"
    return f"interrupted: the staging folder was removed and nothing was written to {dst}"


def human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


STATE_STYLE = {
    "complete": "green",
    "in_progress": "yellow",
    "abandoned": "magenta",
    "superseded": "dim",
    "broken": "red",
    "unknown": "cyan",
}
