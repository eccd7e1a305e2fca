"""`ckptctl demo DIR`."""

from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.options import ForceOpt, JsonOpt, QuietOpt
from ckptctl.cli.output import Output
from ckptctl.quoting import shell

HELP = """Train a tiny model for a few steps and write real checkpoints to try every command on: DIR/native, DIR/distributed (2 ranks, FSDP2), DIR/dcp and DIR/hf."""

EXAMPLES = """\
ckptctl demo /tmp/ckptctl-demo && ckptctl list /tmp/ckptctl-demo
ckptctl demo /tmp/ckptctl-demo --force --no-distributed
"""

#: The reference of the command (docs/cli.md, by scripts/gen_cli_reference.py): what the help leaves out.
REFERENCE = r"""Writes `DIR/native` (single process, ckptctl's own format), `DIR/distributed` (2 gloo ranks, FSDP2, sharded through torch DCP), `DIR/dcp` (plain `torch.distributed.checkpoint.save` folders) and `DIR/hf` (a Hugging Face style export), so that every command has real work. Each stage and save is reported on stderr as it happens. `--force` replaces DIR only when an earlier demo wrote it (it holds a `.ckptctl-demo` marker), never any other folder.
"""


def register(app: typer.Typer) -> None:
    add_command(app, "demo", demo, HELP, EXAMPLES)


def demo(
    folder: Annotated[str, typer.Argument(metavar="DIR", help="Where to write the demo runs (a local folder).")],
    steps: Annotated[
        int, typer.Option("--steps", metavar="N", help="Training steps (a checkpoint every 10).", min=10)
    ] = 30,
    distributed: Annotated[
        bool, typer.Option("--distributed/--no-distributed", help="Also run the 2-rank (gloo, FSDP2) part.")
    ] = True,
    force: ForceOpt = False,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.demo import run_demo

    out = Output(json_mode=json_output, quiet=quiet)
    result = run_demo(folder, steps=steps, distributed=distributed, force=force, on_stage=out.note)
    if json_output:
        out.json(result.to_json())
        return
    for run in result.runs:
        out.print(f"wrote {folder}/{run}")
    out.print(f"next: {shell('ckptctl', 'list', folder)}")
