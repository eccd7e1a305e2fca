"""`ckptctl diff A B`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from ckptctl.checkpoint import Component
from ckptctl.cli.options import ComponentOpt, JsonOpt, QuietOpt
from ckptctl.cli.output import Output, esc, human_bytes, human_count

if TYPE_CHECKING:
    from ckptctl.ops.diff import DiffReport, TensorDiff

HELP = """Compare two checkpoints tensor by tensor, also across layouts (a DCP step against its HF export).

Tensors are matched by name after the same namespace rules convert uses (the model. prefix of DCP
state dicts, the entry name of ckptctl's own checkpoints); --rename handles the rest. Reported: names
only in A or only in B, shape and dtype changes, and per tensor the largest absolute difference and
the relative L2 difference ||a-b|| / max(||a||, ||b||), most changed first. Values are compared after
upcasting both sides to float64, one pair of tensors at a time; equal tensors are counted, not listed
(--all lists them). Pairs whose bytes the recorded digests (ckptctl-digests.json, native manifests)
prove identical are not read (--read-all reads them anyway). Metadata differences (step, config
fields, counters) are shown but do not count as differences.

Exit code 0 when the tensors are equal (within --atol/--rtol), 1 when they differ, 2 on errors.

[bold]Examples[/bold]

  ckptctl diff runs/llama/step-1000 hf-export/

  ckptctl diff runs/llama/step-900 runs/llama/step-1000 --top 10

  ckptctl diff train-fp32/ export-bf16/ --ignore-dtype --rtol 1e-2 --atol 1e-3
"""


def register(app: typer.Typer) -> None:
    app.command("diff", help=HELP)(diff_checkpoints)


def diff_checkpoints(
    a: Annotated[str, typer.Argument(help="First checkpoint folder (local path or fsspec URL).", show_default=False)],
    b: Annotated[str, typer.Argument(help="Second checkpoint folder (local path or fsspec URL).", show_default=False)],
    component: ComponentOpt = Component.MODEL,
    atol: Annotated[
        float, typer.Option("--atol", help="Absolute tolerance: |b - a| <= atol + rtol * |a|.", min=0)
    ] = 0.0,
    rtol: Annotated[float, typer.Option("--rtol", help="Relative tolerance (relative to A).", min=0)] = 0.0,
    strip_prefix: Annotated[
        str | None,
        typer.Option(
            "--strip-prefix",
            metavar="PREFIX",
            help="Prefix removed from the names of both sides (default: detected per side; '' keeps names as stored).",
        ),
    ] = None,
    rename: Annotated[
        list[str] | None,
        typer.Option(
            "--rename",
            metavar="PATTERN=REPL",
            help="PATTERN=REPL regex substitution on the names of both sides (repeatable, in order).",
        ),
    ] = None,
    ignore_dtype: Annotated[
        bool,
        typer.Option(
            "--ignore-dtype", help="A dtype change whose values agree within the tolerance is not a difference."
        ),
    ] = False,
    show_all: Annotated[bool, typer.Option("--all", help="Also list the equal tensors.")] = False,
    top: Annotated[
        int | None, typer.Option("--top", metavar="N", help="List only the N most changed tensors.", min=0)
    ] = None,
    read_all: Annotated[
        bool, typer.Option("--read-all", help="Read every pair, even those recorded digests prove identical.")
    ] = False,
    layout_a: Annotated[
        str | None, typer.Option("--layout-a", metavar="LAYOUT", help="Read A as this layout instead of detecting it.")
    ] = None,
    layout_b: Annotated[
        str | None, typer.Option("--layout-b", metavar="LAYOUT", help="Read B as this layout instead of detecting it.")
    ] = None,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.diff import DiffOptions, diff
    from ckptctl.ops.naming import compile_renames, parse_rename

    try:
        renames = compile_renames(parse_rename(r) for r in rename or ())
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--rename") from exc
    options = DiffOptions(
        component=component,
        atol=atol,
        rtol=rtol,
        strip_prefix=strip_prefix,
        renames=renames,
        ignore_dtype=ignore_dtype,
        keep_equal=show_all,
        read_all=read_all,
        layout_a=layout_a,
        layout_b=layout_b,
        top=top,
    )
    out = Output(json_mode=json_output, quiet=quiet)
    report = diff(a, b, options, out.progress())
    if json_output:
        out.json(report.to_json())
    else:
        _render(out, report)
    if not report.equal:
        raise typer.Exit(1)


def _render(out: Output, report: DiffReport) -> None:
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    facts.add_row("A", esc(f"{report.a} ({report.a_layout})"))
    facts.add_row("B", esc(f"{report.b} ({report.b_layout})"))
    tolerance = "exact" if report.atol == 0 and report.rtol == 0 else f"atol={report.atol:g}, rtol={report.rtol:g}"
    proven = f", {report.proven_count} proven by digests without reading" if report.proven_count else ""
    facts.add_row(
        "compared",
        f"{report.compared} {report.component.value} tensor(s), {tolerance}: {report.equal_count} equal "
        f"({report.identical_count} bit-identical{proven}), {len(report.changed)} changed; "
        f"read {human_bytes(report.bytes_read)}",
    )
    for label, names in (("only in A", report.only_in_a), ("only in B", report.only_in_b)):
        if names:
            shown = ", ".join(names[:10]) + (f" (+{len(names) - 10} more)" if len(names) > 10 else "")
            facts.add_row(label, esc(f"{len(names)}: {shown}"))
    out.print(facts)
    listed = report.listed_changes()
    if listed:
        out.print(_tensor_table(f"changed ({len(listed)} of {len(report.changed)}, most changed first)", listed))
    if report.equal_tensors:
        out.print(_tensor_table(f"equal ({len(report.equal_tensors)})", report.equal_tensors))
    if report.metadata:
        table = Table(title="metadata", title_justify="left")
        table.add_column("field", overflow="fold")
        table.add_column("A", overflow="fold")
        table.add_column("B", overflow="fold")
        for item in report.metadata:
            table.add_row(esc(item.field), esc(_value(item.a)), esc(_value(item.b)))
        out.print(table)
    verdict = "[green]equal[/green]" if report.equal else "[red]different[/red]"
    out.print(verdict)


def _tensor_table(title: str, rows: tuple[TensorDiff, ...]) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("name", overflow="fold")
    table.add_column("change")
    table.add_column("max |a-b|", justify="right")
    table.add_column("rel L2", justify="right")
    table.add_column("mismatched", justify="right")
    table.add_column("A → B")
    for row in rows:
        change = row.kind.value if row.kind is not None else ("identical" if row.identical else "within tolerance")
        mismatched = "-" if row.mismatched is None else f"{human_count(row.mismatched)} of {human_count(row.numel)}"
        if row.nonfinite_mismatched:
            mismatched += f" ({row.nonfinite_mismatched} NaN/Inf)"
        a_side = f"{row.a_dtype}{list(row.a_shape)}"
        b_side = f"{row.b_dtype}{list(row.b_shape)}"
        table.add_row(
            esc(row.name),
            change,
            _number(row.max_abs_diff),
            _number(row.rel_l2),
            mismatched,
            esc(a_side if a_side == b_side else f"{a_side} → {b_side}"),
        )
    return table


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _value(value: object) -> str:
    return "-" if value is None else str(value)
