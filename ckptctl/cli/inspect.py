"""`ckptctl inspect CKPT`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.checkpoint import Component
from ckptctl.cli.command import add_command
from ckptctl.cli.options import JsonOpt, LayoutOpt, QuietOpt
from ckptctl.cli.output import STATE_STYLE, Cell, Column, Output, human_bytes, human_count, styled

if TYPE_CHECKING:
    from ckptctl.ops.inspection import InspectReport

HELP = """Show what a checkpoint holds: layout, step, components present and missing, world size, tensors.

Reads headers and metadata only (never tensor data, never unpickles with code execution), so it is fast on checkpoints of any size and works without torch installed.

CKPT is a checkpoint folder of any known layout, a Lightning checkpoint file (`epoch=0-step=100.ckpt`, `last.ckpt`), or a single weights file: `*.safetensors`, or a torch.save zip (`*.pt`, `*.pth`, `*.bin`) read with the same allowlisting reader (nothing in it runs)."""

EXAMPLES = """\
ckptctl inspect runs/llama-sft/step-1000
ckptctl inspect runs/llama-sft/step-1000 --filter '*layers.0.*' --component model
ckptctl inspect hf-export/model-00001-of-00004.safetensors
ckptctl inspect hf-export/ --json | jq .totals
"""


def register(app: typer.Typer) -> None:
    add_command(app, "inspect", inspect_checkpoint, HELP, EXAMPLES)


def inspect_checkpoint(
    checkpoint: Annotated[
        str,
        typer.Argument(
            metavar="CKPT",
            help="Checkpoint folder or weights file (local path or fsspec URL).",
            show_default=False,
        ),
    ],
    name_filter: Annotated[
        str | None,
        typer.Option(
            "--filter", "-f", metavar="GLOB", help="Only tensors whose name matches this glob (or contains it)."
        ),
    ] = None,
    component: Annotated[
        Component | None,
        typer.Option(
            "--component",
            metavar="COMPONENT",
            help=f"Only tensors of this component: {', '.join(c.value for c in Component)}.",
        ),
    ] = None,
    limit: Annotated[
        int, typer.Option("--limit", metavar="N", help="Rows of the tensor table to print (JSON has them all).", min=0)
    ] = 40,
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
    _render(out, report, limit, filtered=name_filter is not None or component is not None)


def _render(out: Output, report: InspectReport, limit: int, *, filtered: bool) -> None:
    ckpt = report.checkpoint
    ref = ckpt.ref
    totals = report.totals
    facts: list[tuple[str, Cell]] = [
        ("checkpoint", ckpt.url),
        ("layout", ckpt.layout),
        ("step", "-" if ref.step is None else str(ref.step)),
    ]
    if ref.epoch is not None:
        facts.append(("epoch", f"{ref.epoch:g}"))
    facts += [
        ("state", styled(ref.state.value, STATE_STYLE.get(ref.state.value, ""))),
        ("world size", "-" if ckpt.world_size is None else str(ckpt.world_size)),
        ("components", ", ".join(sorted(c.value for c in ckpt.components)) or "-"),
        ("missing", ", ".join(c.value for c in ckpt.missing_components) or "-"),
        ("size on disk", human_bytes(ref.size_bytes)),
        ("parameters", f"{human_count(totals.parameters)} ({totals.parameters:,})"),
        ("tensor bytes", ", ".join(f"{d} {human_bytes(b)}" for d, b in totals.bytes_by_dtype.items()) or "-"),
    ]
    warnings: list[str] = []
    for key, value in ckpt.metadata.items():
        if key == "warnings" and isinstance(value, list):  # what a layout says a person must know
            warnings += map(str, value)
            continue
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        facts.append((key, str(value)))
    if report.wrapped is not None:
        summary = ", ".join(f"{k}={v}" for k, v in report.wrapped.summary.items())
        facts.append(("wrapped model", f"{report.wrapped.kind}; {summary}; convert merges it (--lora merge)"))
    out.facts(facts)
    for warning in warnings:
        out.warn(warning)

    if not report.tensors:
        if filtered and totals.tensors:
            out.note(f"no tensor matches the filter (of {totals.tensors} tensors)")
        return
    if limit == 0:
        return
    columns = [
        Column("name"),
        Column("component", drop=1),
        Column("dtype"),
        Column("shape"),
        Column("size", "right", drop=2),
    ]
    rows = [
        [entry.name, entry.component.value, entry.dtype, str(list(entry.shape)), human_bytes(entry.nbytes)]
        for entry in report.tensors[:limit]
    ]
    out.print()
    out.table(columns, rows, title=f"tensors ({len(report.tensors)} of {totals.tensors})")
    if len(report.tensors) > limit:
        out.note(f"{len(report.tensors) - limit} more tensor(s): use --limit, --filter or --json")
