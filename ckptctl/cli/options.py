"""Options shared by several commands, defined once, the one way a command rejects an option's value, and the
prompt of the commands that plan changes to a run before making them."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Annotated, Any, Generic, Protocol, TypeVar

import typer

from ckptctl.checkpoint import Component
from ckptctl.cli.output import Output
from ckptctl.errors import CkptctlError
from ckptctl.layouts import layout_names

T = TypeVar("T")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (schema_version 1).")]
QuietOpt = Annotated[
    bool,
    typer.Option("--quiet", "-q", help="Print nothing but errors; the exit code tells the result."),
]
# Layout names are plain strings checked by the library (`layouts.get_layout`), whose error lists the known
# layouts for library and command-line users alike.
LayoutOpt = Annotated[
    str | None,
    typer.Option(
        "--layout",
        metavar="LAYOUT",
        help=f"Skip detection and read the checkpoint as this layout: {', '.join(layout_names())}.",
    ),
]
RunLayoutOpt = Annotated[
    str | None,
    typer.Option(
        "--layout", metavar="LAYOUT", help=f"Consider only checkpoints of this layout: {', '.join(layout_names())}."
    ),
]
ComponentOpt = Annotated[
    Component,
    typer.Option(
        "--component",
        metavar="COMPONENT",
        help=f"The component whose tensors are read: {', '.join(c.value for c in Component)}.",
    ),
]

# prune, slim and repair take the same run lock (`core.lock`), so each waits for any of the three.
WaitOpt = Annotated[
    float,
    typer.Option(
        "--wait",
        metavar="SECONDS",
        help="Seconds to wait for another prune, slim or repair of the run (the run's lock) to finish.",
        min=0,
    ),
]
# prune and slim judge alike whether a checkpoint is still being written (`ops.planned.DEFAULT_GRACE`).
GraceOpt = Annotated[
    str | None,
    typer.Option(
        "--grace", metavar="AGE", help="Checkpoints modified this recently count as being written (default 10m)."
    ),
]
DepthOpt = Annotated[int, typer.Option("--depth", metavar="N", help="How deep to look for nested runs.", min=0)]


def bad_value(option: str, message: str) -> typer.BadParameter:
    """The usage error for a value an option's type accepted but the command cannot use (exit code 2)."""
    return typer.BadParameter(message, param_hint=f"'{option}'")


def parsed(parser: Callable[[str], T], text: str | None, option: str) -> T | None:
    """`parser(text)` (None for None), a ValueError turned into the usage error of `option`."""
    if text is None:
        return None
    try:
        return parser(text)
    except ValueError as exc:
        raise bad_value(option, str(exc)) from exc


class ConfirmationRequired(CkptctlError):
    """A destructive command needs --yes when there is no terminal to ask on (exit code 2)."""


class _Report(Protocol):
    @property
    def plan(self) -> Any: ...

    def to_json(self) -> dict[str, Any]: ...


ReportT = TypeVar("ReportT", bound=_Report)


class PlanPrompt(Generic[ReportT]):
    """The confirmation and the output of a command that plans changes to a run, then makes them (`prune`,
    `slim`): the plan is shown once, before the question when one is asked, else with the outcome.

    Args:
        out: the command's output.
        render_plan: prints a plan (the table of what is done to each checkpoint).
        render_summary: prints the outcome's last line.
        yes, json_output, quiet: the command's --yes, --json and --quiet.
    """

    def __init__(
        self,
        out: Output,
        render_plan: Callable[[Output, Any], None],
        render_summary: Callable[[Output, ReportT], None],
        *,
        yes: bool,
        json_output: bool,
        quiet: bool,
    ) -> None:
        self._out = out
        self._render_plan = render_plan
        self._render_summary = render_summary
        self._yes, self._json_output, self._quiet = yes, json_output, quiet
        self._shown = False

    def confirmed(self, plan: Any, action: str, question: str) -> bool:
        """Whether the user lets the command go on: True with --yes; else show the plan and ask `question` on the
        terminal.

        Args:
            plan: what would be done.
            action: the same in words, for the refusal (`delete 3 checkpoint(s)`).

        Raises:
            ConfirmationRequired: no --yes, and --json or --quiet (which show no plan: a confirmation of a plan
                nobody saw is none, and a script must behave the same with or without a terminal), or stdin is
                not a terminal.
        """
        if self._yes:
            return True
        if self._json_output or self._quiet:
            raise ConfirmationRequired(
                f"refusing to {action} without confirmation: {'--json' if self._json_output else '--quiet'} does "
                "not show the plan or prompt",
                "pass --yes to go on (or --dry-run to see the plan)",
            )
        if not sys.stdin.isatty():
            raise ConfirmationRequired(
                f"refusing to {action} without confirmation: stdin is not a terminal",
                "pass --yes (or --dry-run to see the plan)",
            )
        self._render_plan(self._out, plan)
        self._shown = True
        return typer.confirm(question, default=False, err=True)

    def show(self, report: ReportT) -> None:
        """The outcome: its JSON document, or the plan (unless shown before the question) and the summary; then
        the plan's notes."""
        if self._json_output:
            self._out.json(report.to_json())
        else:
            if not self._shown:
                self._render_plan(self._out, report.plan)
            self._render_summary(self._out, report)
        for note in report.plan.notes:
            self._out.note(f"note: {note}")
