"""`ckptctl list RUN_DIR`."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from ckptctl.cli.options import JsonOpt, QuietOpt, RunLayoutOpt
from ckptctl.cli.output import STATE_STYLE, Output, esc, human_bytes
from ckptctl.layouts import DEFAULT_SCAN_DEPTH
from ckptctl.ops.report import display_path

HELP = """List every checkpoint of a run folder: step, epoch, layout, state, size, and which one `latest` names.

Reads directory listings and small markers only, so it stays fast on thousands of checkpoints.
Nested runs (several jobs under one folder) are found too.

[bold]Examples[/bold]

  ckptctl list runs/llama-sft

  ckptctl list runs/llama-sft --state complete --sort created --reverse --limit 5

  ckptctl list s3://bucket/runs/llama-sft --json | jq '.checkpoints[] | select(.latest)'
"""


def register(app: typer.Typer) -> None:
    app.command("list", help=HELP)(list_checkpoints)


def list_checkpoints(
    run: Annotated[str, typer.Argument(help="Run folder (local path or fsspec URL).", show_default=False)],
    sort: Annotated[str, typer.Option(help="Sort by step, created, size or url.")] = "step",
    reverse: Annotated[bool, typer.Option("--reverse", "-r", help="Largest/newest first.")] = False,
    state: Annotated[
        list[str] | None, typer.Option("--state", help="Only this state (complete, in_progress, broken); repeatable.")
    ] = None,
    layout: RunLayoutOpt = None,
    limit: Annotated[int | None, typer.Option(help="Show at most this many.", min=1)] = None,
    depth: Annotated[int, typer.Option(help="How deep to look for nested runs.", min=0)] = DEFAULT_SCAN_DEPTH,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.checkpoint import CheckpointState
    from ckptctl.ops.listing import SORT_KEYS, list_run

    if sort not in SORT_KEYS:
        raise typer.BadParameter(f"choose one of {', '.join(SORT_KEYS)}", param_hint="--sort")
    try:
        states = frozenset(CheckpointState(s) for s in state) if state else None
    except ValueError as exc:
        raise typer.BadParameter("choose complete, in_progress or broken", param_hint="--state") from exc
    report = list_run(run, sort=sort, reverse=reverse, states=states, layout=layout, limit=limit, max_depth=depth)
    out = Output(json_mode=json_output, quiet=quiet)
    if json_output:
        out.json(report.to_json())
        return
    if not report.checkpoints:
        out.note(f"no checkpoints found below {run}")
        return
    with_epoch = any(ref.epoch is not None for ref in report.checkpoints)
    table = Table(title=f"{len(report.checkpoints)} checkpoint(s) in {esc(run)}", title_justify="left")
    table.add_column("path", overflow="fold", ratio=1)
    table.add_column("step", justify="right", no_wrap=True)
    if with_epoch:
        table.add_column("epoch", justify="right", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("layout", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("created", no_wrap=True)
    table.add_column("latest", justify="center", no_wrap=True)
    for ref in report.checkpoints:
        style = STATE_STYLE.get(ref.state.value, "")
        row = [
            esc(display_path(ref.url, run)) + (f" [dim]({esc(ref.note)})[/dim]" if ref.note else ""),
            "-" if ref.step is None else str(ref.step),
        ]
        if with_epoch:
            row.append("-" if ref.epoch is None else f"{ref.epoch:g}")
        row += [
            f"[{style}]{ref.state.value}[/{style}]",
            esc(ref.layout),
            human_bytes(ref.size_bytes),
            ref.created.strftime("%m-%d %H:%M") if ref.created else "-",
            "*" if ref.latest else "",
        ]
        table.add_row(*row)
    out.print(table)
