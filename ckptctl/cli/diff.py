"""`ckptctl diff A B`."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.checkpoint import Component
from ckptctl.cli.command import add_command
from ckptctl.cli.options import ComponentOpt, JsonOpt, QuietOpt, RenameOpt, StripPrefixOpt, WorkersOpt, parsed_renames
from ckptctl.cli.output import Cell, Column, Output, human_bytes, human_count, styled
from ckptctl.cli.ranks import job_ranks, prints

if TYPE_CHECKING:
    from ckptctl.ops.diff import DiffReport, TensorDiff

HELP = """Compare two checkpoints tensor by tensor, also across layouts (a DCP step against its HF export): names on one side only, shape and dtype changes, max-abs and relative-L2 difference per tensor. Exit code 0 when equal, 1 when they differ, 2 on errors."""

EXAMPLES = """\
ckptctl diff runs/llama/step-1000 hf-export/
ckptctl diff runs/llama/step-900 runs/llama/step-1000 --top 10
ckptctl diff hf-export/model.safetensors other-export/model.safetensors
ckptctl diff train-fp32/ export-bf16/ --ignore-dtype --rtol 1e-2 --atol 1e-3
ckptctl diff runs/llama/step-900 runs/llama/step-1000 --html drift.html
"""

#: The reference of the command (docs/cli.md, by scripts/gen_cli_reference.py): what the help leaves out.
REFERENCE = r"""What differs between two checkpoints, of one layout or two (a DCP step against its HF export, DeepSpeed
against HF, two steps of a run). Tensors of one component (`--component`, default `model`) are matched
by name after the namespace rules `convert` uses (the `model.` of DCP state dicts, the entry name of
ckptctl's own checkpoints; `--strip-prefix` overrides them, `--rename PATTERN=REPL` maps the rest).
Reported: names only in A or only in B, shape and dtype changes, and per tensor the largest absolute
difference and the relative L2 difference `||a-b|| / max(||a||, ||b||)`, most changed first (`--top N`).
Values are compared after upcasting both sides (float64; int64 for integers; NaN equals NaN) in
cache-sized blocks, streamed from the raw bytes on all cores: blocks that both sides hold byte for byte
are compared as bytes and never decoded, and memory stays at a few blocks per core whatever the tensor
sizes (`bench/diff.py` measures it against a naive torch script and `cat`). Equal means every element
satisfies `|b - a| <= atol + rtol * |a|` (`--atol`, `--rtol`; exact by default); equal tensors are
counted, not listed (`--all`). `--ignore-dtype` compares an fp32 checkpoint with its bf16 export by value.
A pair is not read at all when both sides provably hold the same bytes: the same file, or files whose
recorded blake3 digests (native manifests, `ckptctl-digests.json`) are equal at the same byte range and
whose sizes still match the record (this trusts the records as `verify` checks them; `--read-all` reads
every pair). Metadata differences (step, epoch, config fields, counters, metrics) are shown but do not
count. Exit 0 when equal, 1 when different, 2 on errors.

```console
$ ckptctl diff demo-out/native/step-20 demo-out/native/step-30 --top 3
A         demo-out/native/step-20 (native)
B         demo-out/native/step-30 (native)
compared  16 model tensor(s), exact: 0 equal (0 bit-identical), 16 changed; read 1.0 MiB

changed (3 of 16, most changed first)
name             change  max |a-b|  rel L2  mismatched  A → B
norm.bias        values     0.0158   0.635    64 of 64  float32[64]
blocks.0.0.bias  values      0.016   0.502    64 of 64  float32[64]
blocks.1.0.bias  values     0.0177   0.433    64 of 64  float32[64]

metadata
field         A                  B
step          20                 30
metrics.loss  5.676208019256592  5.675955295562744
different
$ ckptctl diff demo-out/dcp/step-30 hf-export/ -q && echo "the export holds the training weights"
```

Launched by torchrun (or with --workers N on this host), the ranks share the pairs to read by bytes; rank 0 prints the one report and every rank exits with its code.

`--atol` and `--rtol` are 0 by default: equal means bit for bit after the upcast.
"""


def register(app: typer.Typer) -> None:
    add_command(
        app, "diff", diff_checkpoints, HELP, EXAMPLES, more=("--strip-prefix", "--read-all", "--layout-a", "--layout-b")
    )


def diff_checkpoints(
    a: Annotated[str, typer.Argument(metavar="A", help="First checkpoint folder or weights file (path or URL).")],
    b: Annotated[str, typer.Argument(metavar="B", help="Second checkpoint folder or weights file (path or URL).")],
    component: ComponentOpt = Component.MODEL,
    atol: Annotated[
        float,
        typer.Option("--atol", metavar="X", help="Absolute tolerance (default 0: exact).", min=0, show_default=False),
    ] = 0.0,
    rtol: Annotated[
        float,
        typer.Option(
            "--rtol", metavar="X", help="Relative tolerance, to A (default 0: exact).", min=0, show_default=False
        ),
    ] = 0.0,
    strip_prefix: StripPrefixOpt = None,
    rename: RenameOpt = None,
    ignore_dtype: Annotated[
        bool,
        typer.Option("--ignore-dtype", help="Compare values across dtypes, within the tolerance."),
    ] = False,
    show_all: Annotated[bool, typer.Option("--all", help="Also list the equal tensors.")] = False,
    top: Annotated[
        int | None, typer.Option("--top", metavar="N", help="List only the N most changed tensors.", min=0)
    ] = None,
    read_all: Annotated[
        bool, typer.Option("--read-all", help="Also read pairs that recorded digests prove identical.")
    ] = False,
    layout_a: Annotated[
        str | None,
        typer.Option("--layout-a", metavar="LAYOUT", help="Read A as this layout instead of detecting it."),
    ] = None,
    layout_b: Annotated[
        str | None,
        typer.Option("--layout-b", metavar="LAYOUT", help="Read B as this layout instead of detecting it."),
    ] = None,
    html: Annotated[
        str | None,
        typer.Option("--html", metavar="FILE", help="Also write a page of the per-layer difference."),
    ] = None,
    workers: WorkersOpt = None,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.diff import DiffOptions, diff
    from ckptctl.ops.naming import compile_renames

    renames = compile_renames(parsed_renames(rename))
    options = DiffOptions(
        component=component,
        atol=atol,
        rtol=rtol,
        strip_prefix=strip_prefix,
        renames=renames,
        ignore_dtype=ignore_dtype,
        keep_equal=show_all or html is not None,  # the page draws every layer, the unchanged ones too
        read_all=read_all,
        layout_a=layout_a,
        layout_b=layout_b,
        top=top,
    )
    with job_ranks(workers) as ranks:
        out = Output(json_mode=json_output, quiet=quiet or not prints(ranks))
        report = diff(a, b, replace(options, ranks=ranks), out.progress())
    if prints(ranks):
        if html is not None:
            _write_page(out, html, report)
            report = replace(report, equal_tensors=report.equal_tensors if show_all else ())
        if json_output:
            out.json(report.to_json())
        else:
            _render(out, report)
    if not report.equal:
        raise typer.Exit(1)


def _write_page(out: Output, path: str, report: DiffReport) -> None:
    from ckptctl import io
    from ckptctl.ops.report_html import render_diff
    from ckptctl.ops.report_page import layer_changes

    layers = layer_changes(report)
    page = render_diff(report, layers).encode()
    io.write_bytes_atomic(path, page)
    out.note(f"wrote {path} ({human_bytes(len(page))}): {len(layers)} layer(s)")


def _render(out: Output, report: DiffReport) -> None:
    tolerance = "exact" if report.atol == 0 and report.rtol == 0 else f"atol={report.atol:g}, rtol={report.rtol:g}"
    proven = f", {report.proven_count} proven by digests without reading" if report.proven_count else ""
    facts: list[tuple[str, Cell]] = [
        ("A", f"{report.a} ({report.a_layout})"),
        ("B", f"{report.b} ({report.b_layout})"),
        (
            "compared",
            f"{report.compared} {report.component.value} tensor(s), {tolerance}: {report.equal_count} equal "
            f"({report.identical_count} bit-identical{proven}), {len(report.changed)} changed; "
            f"read {human_bytes(report.bytes_read)}",
        ),
    ]
    for label, names in (("only in A", report.only_in_a), ("only in B", report.only_in_b)):
        if names:
            shown = ", ".join(names[:10]) + (f" (+{len(names) - 10} more)" if len(names) > 10 else "")
            facts.append((label, f"{len(names)}: {shown}"))
    out.facts(facts)
    listed = report.listed_changes()
    if listed:
        _tensor_table(out, f"changed ({len(listed)} of {len(report.changed)}, most changed first)", listed)
    if report.equal_tensors:
        _tensor_table(out, f"equal ({len(report.equal_tensors)})", report.equal_tensors)
    if report.metadata:
        out.print()
        out.table(
            [Column("field"), Column("A", flexible=True), Column("B", flexible=True)],
            [[item.field, _value(item.a), _value(item.b)] for item in report.metadata],
            title="metadata",
        )
    out.print(styled("equal", "green") if report.equal else styled("different", "red"))


def _tensor_table(out: Output, title: str, rows: tuple[TensorDiff, ...]) -> None:
    columns = [
        Column("name"),
        Column("change"),
        Column("max |a-b|", "right"),
        Column("rel L2", "right"),
        Column("mismatched", "right", drop=2),
        Column("A → B", drop=1),
    ]
    cells = []
    for row in rows:
        change = row.kind.value if row.kind is not None else ("identical" if row.identical else "within tolerance")
        mismatched = "-" if row.mismatched is None else f"{human_count(row.mismatched)} of {human_count(row.numel)}"
        if row.nonfinite_mismatched:
            mismatched += f" ({row.nonfinite_mismatched} NaN/Inf)"
        a_side = f"{row.a_dtype}{list(row.a_shape)}"
        b_side = f"{row.b_dtype}{list(row.b_shape)}"
        cells.append(
            [
                row.name,
                change,
                _number(row.max_abs_diff),
                _number(row.rel_l2),
                mismatched,
                a_side if a_side == b_side else f"{a_side} → {b_side}",
            ]
        )
    out.print()
    out.table(columns, cells, title=title)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _value(value: object) -> str:
    return "-" if value is None else str(value)
