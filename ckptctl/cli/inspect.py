"""`ckptctl inspect CKPT`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.options import ComponentFilterOpt, JsonOpt, LayoutOpt, QuietOpt, RowsOpt
from ckptctl.cli.output import STATE_STYLE, Cell, Column, Output, human_bytes, human_count, styled

if TYPE_CHECKING:
    from ckptctl.ops.inspection import InspectReport

HELP = """Show what a checkpoint holds: layout, step, components present and missing, world size, parameter count and the tensor table. Reads headers and metadata only (nothing in a pickle runs); CKPT may also be a single weights file."""

EXAMPLES = """\
ckptctl inspect runs/llama-sft/step-1000
ckptctl inspect runs/llama-sft/step-1000 --filter '*layers.0.*' --component model
ckptctl inspect hf-export/model-00001-of-00004.safetensors
ckptctl inspect hf-export/ --json | jq .totals
"""

#: The reference of the command (docs/cli.md, by scripts/gen_cli_reference.py): what the help leaves out.
REFERENCE = r"""Layout, step, components present and missing (model, optimizer, scheduler, rng, dataloader,
trainer_state, config, tokenizer), world size, config summary, the tensor table (`--filter '*attn*'`,
`--component optimizer`, `--limit`), parameter count and bytes by dtype. Headers only. `CKPT` may also be
a single weights file: a `*.safetensors` file, or a torch.save zip (`*.pt`, `*.pth`, `*.bin`) read with the
same allowlisting unpickler (nothing in it runs); `verify` and `diff` take them too. Legacy model folders
(`pytorch_model.bin`, or `pytorch_model-0000i-of-0000N.bin` shards with their index) are read the same way;
a tensor pickled under two names (a tied `lm_head.weight`) is listed and counted once.

```console
$ ckptctl inspect demo-out/native/step-30 --limit 0
checkpoint    demo-out/native/step-30
layout        native
step          30
state         complete
world size    1
components    model, optimizer, rng, scheduler, trainer_state
missing       dataloader, config, tokenizer
size on disk  1.2 MiB
parameters    99.33K (99,328)
tensor bytes  float32 1.1 MiB, uint8 4.9 KiB, uint32 2.4 KiB
metrics       loss=5.675955295562744
versions      ckptctl=0.1.0, torch=2.13.0+cpu, python=3.11.7, numpy=2.4.6
entries       model=module in safetensors, optimizer=optimizer in safetensors, scheduler=scheduler in safetensors, rng=rng in safetensors
$ ckptctl inspect hf-export/model-00001-of-00004.safetensors --json | jq .totals.parameters
```

CKPT is a checkpoint folder of any known layout, a Lightning checkpoint file (`epoch=0-step=100.ckpt`, `last.ckpt`), or a single weights file: `*.safetensors`, or a torch.save zip (`*.pt`, `*.pth`, `*.bin`) read with the same allowlisting reader (nothing in it runs).
"""


def register(app: typer.Typer) -> None:
    add_command(app, "inspect", inspect_checkpoint, HELP, EXAMPLES)


def inspect_checkpoint(
    checkpoint: Annotated[
        str, typer.Argument(metavar="CKPT", help="Checkpoint folder or weights file (local path or fsspec URL).")
    ],
    name_filter: Annotated[
        str | None,
        typer.Option(
            "--filter", "-f", metavar="GLOB", help="Only tensors whose name matches this glob (or contains it)."
        ),
    ] = None,
    component: ComponentFilterOpt = None,
    limit: RowsOpt = 40,
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
