"""`ckptctl slim RUN|CKPT`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl import io
from ckptctl.cli.command import add_command
from ckptctl.cli.options import (
    DepthOpt,
    DryRunOpt,
    GraceOpt,
    JsonOpt,
    OlderThanOpt,
    PlanPrompt,
    QuietOpt,
    WaitOpt,
    YesOpt,
    parsed,
    plan_table,
)
from ckptctl.cli.output import Cell, Column, Output, human_bytes, styled
from ckptctl.layouts import DEFAULT_SCAN_DEPTH
from ckptctl.ops.report import display_path

if TYPE_CHECKING:
    from datetime import timedelta

    from ckptctl.ops.slim import SlimItem, SlimPlan, SlimReport

HELP = """Drop the training-only state of old checkpoints (optimizer moments, schedulers, RNG) and keep each one's model, so that `ckptctl convert` of a slimmed checkpoint writes what it wrote before. Never what a resume would load or prune protects; atomic per checkpoint; plans, then asks unless --yes."""

EXAMPLES = """\
ckptctl slim runs/llama-sft --dry-run
ckptctl slim runs/llama-sft --keep-full 2 --older-than 3d -y
ckptctl slim runs/llama-sft/checkpoint-2000 -y --json
"""

#: The reference of the command (docs/cli.md, by scripts/gen_cli_reference.py): what the help leaves out.
REFERENCE = r"""Drops the training-only state of old checkpoints (optimizer moments and partitions, schedulers, RNG, data
loader state: what only a resume reads) and keeps each one's model, step, metrics and small files, so that
`convert` of a slimmed checkpoint writes byte for byte what it wrote before. `--keep-full N` (default 1):
the newest N complete checkpoints of each folder stay whole; `--older-than 7d` slims older ones only; a
checkpoint folder (or a Lightning `.ckpt` file) instead of a run slims that one. Never slimmed: what a resume would load (as
`resume-plan` finds it), what `prune` never deletes (the newest complete checkpoint, what a `latest`
pointer names, the Trainer's best checkpoint, OpenRLHF `best*` folders, anything in progress, links),
checkpoints that are not complete, and layouts that cannot be slimmed safely, each with its reason
(unknown layouts; DCP saves without collectives (per-rank `.metadata` files) or with a custom planner's
data, and model-only DCP saves (Megatron `--no-save-optim`), which hold nothing to drop; accelerate FSDP saves;
Lightning `.ckpt` files whose pickle cannot be cut apart without running it (a kept entry sharing a dict or list
with the optimizer state), or whose hyperparameters hold a class Lightning does not write; ROLL's legacy
Megatron saves (`mp_rank_*/model_optim_rng.pt`); ZeRO-0
tags, whose optimizer lies inside the model-states pickle; Trainer checkpoints holding a DeepSpeed tag or
FSDP folders).

| layout | dropped | kept |
|---|---|---|
| `native` | the optimizer, scheduler, RNG and data-loader entries (files and manifest entries) | the model and other entries, a rewritten `ckptctl-manifest.json` with their digests |
| `hf_trainer` | `optimizer.pt`, `scheduler.pt`, `scaler.pt`, `rng_state*.pth` | the model (or adapter), `config.json`, `trainer_state.json`, `training_args.bin` |
| `deepspeed`, `openrlhf`, `open_instruct` (ZeRO 1-3 tags) | every `*_optim_states.pt` | the model-states files, and the fp32 master weights `convert` writes by default, first written as `ckptctl-master-weights.safetensors` in the tag (which `convert` then reads) |
| `verl` | each role's `optim_*` and `extra_state_*` (scheduler, RNG) rank files, `data.pt` | each role's `model_*` rank files, `fsdp_config.json`, `huggingface/` |
| `dcp`, `torchtitan`, `megatron` (dist-ckpt, torch_dist) | the items under `optim.*` / `optimizer.*` (optimizer moments, steps, param groups), `lr_scheduler.*`, `dataloader.*`, `rng_state*`; a data file holding only those | the model items and counters (`train_state.*`, `trainer_state.*`), each copied byte for byte into a new `__R_K.distcp` of the same name, a new `.metadata` placing them (torch's `dcp.load` reads it), Megatron's `common.pt` and `metadata.json` |
| `areal` (the recover slot) | its `dcp.optim.*` items | its `dcp.model.*` items, rewritten as for `dcp` with the original files' times (AReaL tells a finished save by them), `recover_info/`. The slot is what `recover.mode=on` loads, so `slim RUN` keeps it while it is one: it is slimmed when named on its own by `slim_checkpoint` (an archived trial) |
| `lightning` `.ckpt` file | the `optimizer_states` and `lr_schedulers` entries and the storages only they use, cut out of `data.pkl` without unpickling it (`formats.pickle_edit`) | every other entry byte for byte (`state_dict`, `loops`, `callbacks`, `hyper_parameters`, ...), its storages copied byte for byte into a new torch.save zip holding the marker (a record and the zip's comment); `LightningModule.load_from_checkpoint` loads it as the whole file |
| `lightning` sharded / DeepSpeed `.ckpt/` | the DCP items `optimizer_N.*`; a DeepSpeed tag's partitions as above | the `model.*` items as for `dcp`, `meta.pt`; the tag's model states and kept masters |
| `roll` | each role's `dcp/` `optimizer.*`, `scheduler.*`, `rng_state.*` items; Megatron `iter_*/dist_optimizer/`, `scheduler.pt`, `rng_state/`; `pipeline/rng_state_pipeline.pth` | the HF weights, the `dcp/` model items (as for `dcp`), Megatron `dist_model/`, `pipeline/worker_state_pipeline.json` |
| `accelerate` | `optimizer[_i].bin`, `scheduler[_i].bin`; with the DeepSpeed plugin, the tag's partitions as above | the model file (or the tag's model states and kept masters), `random_states_*.pkl` (the marker of a finished save), the sampler state |

Each checkpoint is rebuilt inside the run's `.ckptctl-trash` (kept files hard-linked, new files fsynced,
the marker `.ckptctl-slim.json` written last) and swapped in atomically (renameat2), so a kill at any
moment leaves the whole original or the whole slim checkpoint. `list` shows it as `slim`, `verify` checks
it as slim (the dropped files are expected missing, the kept ones checked against the marker), `resume-plan`
skips it ("slim: training-only state dropped"), `prune` counts it like a complete one. `--dry-run` prints
the plan with the bytes each slim frees; otherwise it asks, unless `--yes`. One prune or slim per run at a
time (the prune lock). Exit codes as `prune`: 1 when a planned slim failed or was left undone, locked, or
declined; 2 on bad usage or a link where the slim version would be built.

```bash
ckptctl slim runs/llama-sft --dry-run
ckptctl slim runs/llama-sft --keep-full 2 --older-than 3d -y --json
```

For cron, `RUN/ckptctl.toml` may hold the rules (`ckptctl slim RUN -y` without options uses them):

```toml
[slim]
keep_full = 2
older_than = "3d"
```

The same table makes `prune` with the policy file keep the checkpoints its rules keep slim beyond the
newest `keep_full` (as `keep_full_last` in `[retention]` does); `prune --slim` slims the complete
checkpoints its rules delete instead of deleting them; and in a training loop,
`CheckpointManager(root, policy=RetentionPolicy(keep_last=10, keep_full_last=2))` keeps ten steps, the
older eight of them slim (slimmed on the manager's background thread; `restore` never picks a slim step).

--json gives run, dry_run, slim (per checkpoint: url, step, freed_bytes, dropped, dropped_files), keep (url, step, reasons), skipped and freed_bytes.
"""


def register(app: typer.Typer) -> None:
    add_command(app, "slim", slim, HELP, EXAMPLES)


def slim(
    target: Annotated[
        str, typer.Argument(metavar="RUN|CKPT", help="Run folder, or one checkpoint folder (local path).")
    ],
    keep_full: Annotated[
        int | None,
        typer.Option(
            "--keep-full",
            metavar="N",
            help="The newest N complete checkpoints of each folder stay whole (default 1).",
            min=1,
        ),
    ] = None,
    older_than: OlderThanOpt = None,
    grace: GraceOpt = None,
    dry_run: DryRunOpt = False,
    yes: YesOpt = False,
    wait: WaitOpt = 30.0,
    depth: DepthOpt = DEFAULT_SCAN_DEPTH,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.planned import DEFAULT_GRACE
    from ckptctl.ops.slim import DEFAULT_KEEP_FULL, load_slim_settings
    from ckptctl.ops.slim import slim as run_slim
    from ckptctl.units import parse_age

    out = Output(json_mode=json_output, quiet=quiet)
    age = parsed(parse_age, older_than, "--older-than")
    grace_age = parsed(parse_age, grace, "--grace")
    if keep_full is None and age is None and io.is_dir(target):
        keep_full, age = load_slim_settings(target)
        if keep_full is not None or age is not None:
            out.note(
                f"rules from ckptctl.toml [slim]: keep_full={keep_full or DEFAULT_KEEP_FULL}, older_than={_older_than_text(age)}"
            )
    prompt = PlanPrompt(out, _render_plan, _render_summary, yes=yes, json_output=json_output, quiet=quiet)

    def confirm(plan: SlimPlan) -> bool:
        what = f"slim {len(plan.slim)} checkpoint(s)"
        return prompt.confirmed(plan, what, f"{what.capitalize()}, freeing about {human_bytes(plan.freed_bytes)}?")

    report = run_slim(
        target,
        keep_full=keep_full or DEFAULT_KEEP_FULL,
        older_than=age,
        grace=grace_age if grace_age is not None else DEFAULT_GRACE,
        dry_run=dry_run,
        confirm=confirm,
        wait=wait,
        max_depth=depth,
        progress=out.progress(),
        warn=out.warn,
    )
    prompt.show(report)
    if not quiet and not report.cancelled:
        for skipped in report.skipped:
            out.warn(f"{display_path(skipped.item.url, report.plan.run)} was not slimmed: {skipped.reason}")
    if report.skipped or report.cancelled:
        raise typer.Exit(1)


def _render_plan(out: Output, plan: SlimPlan) -> None:
    columns = [
        Column("layout", drop=2),
        Column("size", "right", drop=1),
        Column("frees", "right"),
        Column("why", flexible=True),
    ]
    plan_table(out, plan.run, plan.items, _plan_row, columns, title=f"{plan.run}: keep_full={plan.keep_full}")


def _plan_row(item: SlimItem) -> list[Cell]:
    return [
        styled("slim", "yellow") if item.slim else styled("keep", "green"),
        item.ref.layout,
        human_bytes(item.size_bytes),
        human_bytes(item.freed_bytes) if item.slim else "-",
        f"drops {', '.join(item.dropped)}" if item.slim else "; ".join(item.reasons),
    ]


def _render_summary(out: Output, report: SlimReport) -> None:
    plan = report.plan
    if report.dry_run:
        out.print(f"dry run: would slim {len(plan.slim)} checkpoint(s), freeing {human_bytes(plan.freed_bytes)}")
    elif report.cancelled:
        out.print("cancelled: nothing slimmed")
    else:
        out.print(f"slimmed {len(report.slimmed)} checkpoint(s), freed {human_bytes(report.freed_bytes)}")


def _older_than_text(age: timedelta | None) -> str:
    from ckptctl.units import format_age

    return "-" if age is None else format_age(age)
