"""Options shared by several commands, defined once, and the one way a command rejects an option's value."""

from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.checkpoint import Component
from ckptctl.layouts import layout_names

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


def bad_value(option: str, message: str) -> typer.BadParameter:
    """The usage error for a value an option's type accepted but the command cannot use (exit code 2)."""
    return typer.BadParameter(message, param_hint=f"'{option}'")
