"""`ckptctl inspect CKPT`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from ckptctl.checkpoint import Component
from ckptctl.cli.options import JsonOpt, LayoutOpt, QuietOpt
from ckptctl.cli.output import STATE_STYLE, Output, esc, human_bytes, human_count

if TYPE_CHECKING:
    from ckptctl.ops.inspection import InspectReport

HELP = """Show what a checkpoint holds: layout, step, components present and missing, world size, tensors.

Reads headers and metadata only (never tensor data, never unpickles with code execution), so it is
fast on checkpoints of any size and works without torch installed.

[bold]Examples[/bold]

  ckptctl inspect runs/llama-sft/step-1000

  ckptctl inspect runs/llama-sft/step-1000 --filter '*layers.0.*' --component model

  ckptctl inspect hf-export/ --json | jq .totals
"""


def register(app: typer.Typer) -> None:
    app.command("inspect", help=HELP)(inspect_checkpoint)


def inspect_checkpoint(
    checkpoint: Annotated[
        str, typer.Argument(help="Checkpoint folder (local path or fsspec URL).", show_default=False)
    ],
    name_filter: Annotated[
        str | None, typer.Option("--filter", "-f", help="Only tensors whose name matches this glob (or contains it).")
    ] = None,
    component: Annotated[Component | None, typer.Option(help="Only tensors of this component.")] = None,
    limit: Annotated[int, typer.Option(help="Rows of the tensor table to print (JSON has them all).", min=0)] = 40,
    layout: LayoutOpt = None,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.inspection import inspect_checkpoint as run_inspect

    report = run_inspect(checkpoint, layout=layout, name_filter=name_filter, component=component)
    out = Output(json_mode=json_output, quiet=quiet)
    if json_output:
        out.json(report.to_json())
        return
    _render(out, report, limit)


def _render(out: Output, report: InspectReport, limit: int) -> None:
    ckpt = report.checkpoint
    ref = ckpt.ref
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    style = STATE_STYLE.get(ref.state.value, "")
    facts.add_row("checkpoint", esc(ckpt.url))
    facts.add_row("layout", esc(ckpt.layout))
    facts.add_row("step", "-" if ref.step is None else str(ref.step))
    if ref.epoch is not None:
        facts.add_row("epoch", f"{ref.epoch:g}")
    facts.add_row("state", f"[{style}]{ref.state.value}[/{style}]")
    facts.add_row("world size", "-" if ckpt.world_size is None else str(ckpt.world_size))
    facts.add_row("components", ", ".join(sorted(c.value for c in ckpt.components)) or "-")
    facts.add_row("missing", ", ".join(c.value for c in ckpt.missing_components) or "-")
    facts.add_row("size on disk", human_bytes(ref.size_bytes))
    totals = report.totals
    facts.add_row("parameters", f"{human_count(totals.parameters)} ({totals.parameters:,})")
    facts.add_row(
        "tensor bytes", esc(", ".join(f"{d} {human_bytes(b)}" for d, b in totals.bytes_by_dtype.items()) or "-")
    )
    for key, value in ckpt.metadata.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        facts.add_row(esc(key), esc(value))
    out.print(facts)

    if not report.tensors or limit == 0:
        return
    table = Table(title=f"tensors ({len(report.tensors)} of {totals.tensors})", title_justify="left")
    table.add_column("name", overflow="fold")
    table.add_column("component")
    table.add_column("dtype")
    table.add_column("shape")
    table.add_column("size", justify="right")
    for entry in report.tensors[:limit]:
        table.add_row(
            esc(entry.name), entry.component.value, esc(entry.dtype), str(list(entry.shape)), human_bytes(entry.nbytes)
        )
    out.print(table)
    if len(report.tensors) > limit:
        out.note(f"{len(report.tensors) - limit} more tensor(s): use --limit, --filter or --json")
