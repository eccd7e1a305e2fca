"""`ckptctl list RUN_DIR`."""

from __future__ import annotations

import enum
from typing import Annotated

import typer

from ckptctl.checkpoint import CheckpointState
from ckptctl.cli.command import add_command
from ckptctl.cli.options import DepthOpt, JsonOpt, QuietOpt, RunLayoutOpt
from ckptctl.cli.output import STATE_STYLE, Cell, Column, Output, human_bytes, styled, when
from ckptctl.layouts import DEFAULT_SCAN_DEPTH
from ckptctl.ops.report import display_path

HELP = """List every checkpoint of a run folder: step, epoch, layout, state, size, and which one `latest` names.

Reads directory listings and small markers only, so it stays fast on thousands of checkpoints. Nested runs (several jobs under one folder) are found too.

States: complete, in_progress (being written), abandoned (a killed save's leftovers), superseded (left behind by a rollback), broken, slim (training-only state dropped), unknown (checkpoint-like files - torch.save zips, safetensors, DCP data, large *.pt/*.bin/*.ckpt - that no layout claims: layout `unknown`, the files named in the note, a step from the name where the naming rules give one). A folder of such files is never "no checkpoints found".

A roles column (and `roles` in --json) names the models of an RL run a checkpoint holds in folders of their own (verl's `actor,critic`).

In a terminal the table fits its width (the path column is never shortened); in a pipe or a log every row is printed whole on one line, with `-` for an empty cell, and the count goes to stderr."""

EXAMPLES = """\
ckptctl list runs/llama-sft
ckptctl list runs/llama-sft --state complete --sort created --reverse --limit 5
ckptctl list runs/llama-sft --state broken | awk 'NR > 1 {print $1}'
ckptctl list s3://bucket/runs/llama-sft --json | jq '.checkpoints[] | select(.latest)'
"""


class SortKey(enum.StrEnum):
    step = "step"
    created = "created"
    size = "size"
    url = "url"


def register(app: typer.Typer) -> None:
    add_command(app, "list", list_checkpoints, HELP, EXAMPLES)


def list_checkpoints(
    run: Annotated[
        str, typer.Argument(metavar="RUN", help="Run folder (local path or fsspec URL).", show_default=False)
    ],
    sort: Annotated[
        SortKey, typer.Option("--sort", metavar="KEY", help="Sort by step, created, size or url.")
    ] = SortKey.step,
    reverse: Annotated[bool, typer.Option("--reverse", "-r", help="Largest/newest first.")] = False,
    state: Annotated[
        list[CheckpointState] | None,
        typer.Option(
            "--state",
            metavar="STATE",
            help="Only checkpoints in this state: complete, in_progress, broken, abandoned (a save that "
            "stopped), superseded (off the run's branch after a rollback), slim (training-only state dropped by "
            "`ckptctl slim`) or unknown (checkpoint-like files "
            "of a layout ckptctl does not know); repeatable.",
        ),
    ] = None,
    layout: RunLayoutOpt = None,
    limit: Annotated[int | None, typer.Option("--limit", metavar="N", help="Show at most N.", min=1)] = None,
    depth: DepthOpt = DEFAULT_SCAN_DEPTH,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.listing import list_run

    report = list_run(
        run,
        sort=sort.value,
        reverse=reverse,
        states=frozenset(state) if state else None,
        layout=layout,
        limit=limit,
        max_depth=depth,
    )
    out = Output(json_mode=json_output, quiet=quiet)
    if json_output:
        out.json(report.to_json())
        return
    if not report.checkpoints:
        out.note(f"no checkpoints found below {run}" + ("" if report.total == 0 else " that match"))
        return
    shown = len(report.checkpoints)
    count = f"{shown} checkpoint(s)" if shown == report.total else f"{shown} of {report.total} checkpoint(s)"
    with_epoch = any(ref.epoch is not None for ref in report.checkpoints)
    with_notes = any(ref.note for ref in report.checkpoints)
    with_roles = any(ref.roles for ref in report.checkpoints)
    columns = [
        Column("path"),
        Column("step", "right"),
        *([Column("epoch", "right", drop=3)] if with_epoch else []),
        Column("state"),
        Column("layout", drop=2),
        *([Column("roles", drop=5)] if with_roles else []),
        Column("size", "right", drop=4),
        Column("created", drop=1),
        Column("latest"),
        *([Column("note", flexible=True)] if with_notes else []),
    ]
    rows: list[list[Cell]] = []
    for ref in report.checkpoints:
        row: list[Cell] = [display_path(ref.url, run), "-" if ref.step is None else str(ref.step)]
        if with_epoch:
            row.append("-" if ref.epoch is None else f"{ref.epoch:g}")
        row += [
            styled(ref.state.value, STATE_STYLE.get(ref.state.value, "")),
            ref.layout,
            *([",".join(ref.roles) or "-"] if with_roles else []),
            human_bytes(ref.size_bytes),
            when(ref.created),
            "*" if ref.latest else "",
        ]
        if with_notes:
            row.append(ref.note)
        rows.append(row)
    if out.is_terminal:
        out.table(columns, rows, title=f"{count} in {run}")
    else:
        # A pipe gets the rows only, as `docker ps` prints them; the count is for the person watching.
        out.table(columns, rows)
        out.note(f"{count} in {run}")
    unknown = sum(ref.state is CheckpointState.UNKNOWN for ref in report.checkpoints)
    if unknown:
        out.note(
            f"{unknown} checkpoint(s) of a layout ckptctl does not know (state unknown): `verify` cannot pass them "
            "(exit code 2), `prune` never deletes them, a resume gate does not take the run for a fresh start"
        )
