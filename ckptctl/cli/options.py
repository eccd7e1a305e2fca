"""Options shared by several commands, defined once, and the one way a command rejects an option's value."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Annotated, TypeVar

import typer

from ckptctl.checkpoint import Component
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

# prune, slim and repair take the same run lock (`ops.lock`), so each waits for any of the three.
WaitOpt = Annotated[
    float,
    typer.Option(
        "--wait",
        metavar="SECONDS",
        help="Seconds to wait for another prune, slim or repair of the run (the run's lock) to finish.",
        min=0,
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


def confirmed(
    action: str, question: str, *, yes: bool, json_output: bool, quiet: bool, show: Callable[[], None]
) -> bool:
    """Whether the user lets a destructive command go on: True with --yes; else `show()` the plan and ask
    `question` on the terminal.

    Args:
        action: what would be done, for the refusal (`delete 3 checkpoint(s)`).

    Raises:
        ConfirmationRequired: no --yes, and --json or --quiet (which show no plan: a confirmation of a plan
            nobody saw is none, and a script must behave the same with or without a terminal), or stdin is
            not a terminal.
    """
    if yes:
        return True
    if json_output or quiet:
        raise ConfirmationRequired(
            f"refusing to {action} without confirmation: {'--json' if json_output else '--quiet'} does not show "
            "the plan or prompt",
            "pass --yes to go on (or --dry-run to see the plan)",
        )
    if not sys.stdin.isatty():
        raise ConfirmationRequired(
            f"refusing to {action} without confirmation: stdin is not a terminal",
            "pass --yes (or --dry-run to see the plan)",
        )
    show()
    return typer.confirm(question, default=False, err=True)
