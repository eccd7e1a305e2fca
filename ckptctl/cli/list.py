"""`ckptctl list RUN_DIR`."""

from __future__ import annotations

import enum
from typing import Annotated

import typer

from ckptctl.checkpoint import CheckpointState
from ckptctl.cli.command import add_command
from ckptctl.cli.options import DepthOpt, JsonOpt, LimitOpt, QuietOpt, RunArg, RunLayoutOpt, bad_value
from ckptctl.cli.output import STATE_STYLE, Cell, Column, Output, human_bytes, styled, when
from ckptctl.layouts import DEFAULT_SCAN_DEPTH
from ckptctl.ops.report import display_path

HELP = """List every checkpoint of a run folder (nested runs too): step, epoch, state, layout, size, and which one `latest` names. Reads listings and small markers only, so it stays fast on thousands of checkpoints; checkpoint-like files no layout claims are listed as `unknown`, never "nothing here"."""

EXAMPLES = """\
ckptctl list runs/llama-sft
ckptctl list runs/llama-sft --state complete --sort created --reverse --limit 5
ckptctl list runs/llama-sft --state broken | awk 'NR > 1 {print $1}'
ckptctl list s3://bucket/runs/llama-sft --json | jq '.checkpoints[] | select(.latest)'
"""

#: The reference of the command (docs/cli.md, by scripts/gen_cli_reference.py): what the help leaves out.
REFERENCE = r"""Every checkpoint below a run folder (nested runs too), with step, epoch, state (`complete`,
`in_progress`, `abandoned` for what a killed save left, `superseded` for steps a rollback left behind,
`broken`, `slim`, `unknown`), size and which one the run's `latest` pointer names. Reads listings and tiny markers only. `--state`, `--layout`, `--sort step|created|size|url`, `--reverse`, `--limit`. Why a
checkpoint is in progress or broken is in a `note` column; the count (`3 of 10 checkpoint(s)` with
`--limit`) goes to stderr when stdout is not a terminal.

**Unknown is a state, never "nothing here".** Checkpoint-like files that no layout claims (torch.save zips
by their magic and `data.pkl` entry, safetensors files by their header, DCP `.distcp` data, `*.pt`/`*.pth`/
`*.bin`/`*.ckpt`/`*.safetensors` of 1 MiB or more), written by a framework ckptctl was never taught, are
listed with layout and state `unknown` and a note naming the files (`not a layout ckptctl knows; read as
generic files: train.pth (torch.save zip)`). A file whose name gives a step is a checkpoint of its own
(`ep0-ba10-rank0.pt`, with a `latest-rank0.pt` link marking its target `latest`); other such files make
their folder one (`step-00000010/train.pth`). Steps and epochs come from the names by these rules:
`step-N`, `step_N`, `step-00000010`, `global_stepN`, `global_step_N`, `iter_N`/`iter_000000N`,
`checkpoint-N`, `checkpoint_N`, `epoch_N` (an epoch), `epoch=E-step=S`, `ep{E}-ba{B}` (batches as steps);
`list` orders by step, then epoch, then modification time. On a local disk, a torch DCP folder whose
`.metadata` is no pickle of DCP metadata lists as `broken`, and one whose `.metadata` pickles another
library's metadata class (ByteCheckpoint's) as `unknown`: never `complete` (on object stores `list` judges a
DCP folder from the listing alone, one request for the whole run; `verify` reads the metadata).
`verify` reads each file on its own and exits 2 (`unknown_layout`), `verify --latest` is no fresh start
(exit 2), `prune` never deletes them (kept with the reason `unknown layout: ...`), and `resume-plan` says
"unknown layout" (exit 2). An empty folder, or one of small text files, is still "no checkpoints found".

**The generic reader of the long tail.** A torch.save file whose top-level keys say what it holds (`model`,
`state_dict`, `module`, `model_state_dict`; `optimizer`, `optim`, `optimizers`; `scheduler`, `lr_scheduler`,
`schedulers`; `rng`; counters `step`, `global_step`, `iter_num`, `step_count`, `epoch`, `epochs_run`,
`timestamp`), with a model among them, is a `training_state`: a step-named file of its own (Composer's
`ep0-ba10-rank0.pt`) or the folder holding it (LitGPT's `step-00000010/lit_model.pth`). `inspect` lists its
components and counters, model tensors under the model's own names (`module.`, `_orig_mod.` removed), `verify`,
`diff` and `convert` read it, `prune` orders it by step and `resume-plan` continues from its counters. `latest`
links and tracker files (`latest`, `latest_checkpointed_iteration.txt`) mark the newest. A run-level state file
beside model folders (torchtune's `recipe_state.pt` beside `epoch_N/`, a `trainer_state.json`) makes the newest
of them resumable with the counters it holds; `epoch_N` folders are ordered by epoch. A DCP save's counters
(`epochs_run`, `step`, ...) are read from its non-tensor items.

```console
$ ckptctl list demo-out/native
path     step  state     layout     size  created         latest
step-10    10  complete  native  1.2 MiB  11-24 14:57:26  -
step-20    20  complete  native  1.2 MiB  11-24 14:57:33  -
step-30    30  complete  native  1.2 MiB  11-24 14:57:36  *
$ ckptctl list runs/llama-sft --state broken | awk 'NR > 1 {print $1}'   # one whole path per line
```

A roles column (and `roles` in --json) names the models of an RL run a checkpoint holds in folders of their own (verl's `actor,critic`).
"""


class SortKey(enum.StrEnum):
    step = "step"
    created = "created"
    size = "size"
    url = "url"


def register(app: typer.Typer) -> None:
    add_command(app, "list", list_checkpoints, HELP, EXAMPLES)


def list_checkpoints(
    run: RunArg,
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
    limit: LimitOpt = None,
    depth: DepthOpt = DEFAULT_SCAN_DEPTH,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.listing import list_run

    if limit == 0:
        raise bad_value("--limit", "0 is not in the range x>=1")
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
