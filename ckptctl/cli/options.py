"""Options shared by several commands, defined once."""

from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.checkpoint import Component
from ckptctl.layouts import layout_names

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (schema_version 1).")]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="Print nothing but errors; the exit code tells the result.")
]
LayoutOpt = Annotated[
    str | None,
    typer.Option(
        "--layout", help=f"Skip detection and read the checkpoint as this layout ({', '.join(layout_names())})."
    ),
]
RunLayoutOpt = Annotated[
    str | None,
    typer.Option("--layout", help=f"Consider only checkpoints of this layout ({', '.join(layout_names())})."),
]
ComponentOpt = Annotated[Component, typer.Option("--component", help="The component whose tensors are read.")]
