"""`ckptctl slim RUN|CKPT`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl import io
from ckptctl.cli.command import add_command
from ckptctl.cli.options import DepthOpt, GraceOpt, JsonOpt, PlanPrompt, QuietOpt, WaitOpt, parsed
from ckptctl.cli.output import Cell, Column, Output, human_bytes, styled
from ckptctl.layouts import DEFAULT_SCAN_DEPTH
from ckptctl.ops.report import display_path

if TYPE_CHECKING:
    from datetime import timedelta

    from ckptctl.ops.slim import SlimPlan, SlimReport

HELP = """Drop the training-only state of old checkpoints (optimizer moments and partitions, schedulers, RNG: what only a resume reads) and keep each one's model, step, metrics and small files, so that `ckptctl convert` of a slimmed checkpoint writes exactly what it wrote before.

RUN is a run folder (every folder of checkpoints below it: the newest --keep-full complete ones of each stay whole) or one checkpoint folder; without --keep-full and --older-than, the \\[slim] table of RUN/ckptctl.toml gives them (keep_full, older_than), for cron. Never slimmed: what a resume would load (as `ckptctl resume-plan` finds it), what prune never deletes (the newest complete checkpoint, what a `latest` pointer names, the Trainer's best_model_checkpoint, OpenRLHF best* folders, anything in progress, links, anything outside RUN), checkpoints that are not complete, and layouts that cannot be slimmed safely, each with its reason (unknown layouts; DCP saves without collectives or holding no training-only items; AReaL and Lightning checkpoints; accelerate FSDP saves; ZeRO-0 tags; Trainer checkpoints holding a DeepSpeed tag or FSDP folders).

Slimmed: ckptctl's own checkpoints (optimizer, scheduler, RNG and data-loader entries dropped, manifest rewritten); HF Trainer checkpoint-N (optimizer.pt, scheduler.pt, scaler.pt, rng_state*.pth); DeepSpeed, OpenRLHF and open-instruct ZeRO 1-3 tags (the *_optim_states.pt partitions, after their fp32 master weights are written as ckptctl-master-weights.safetensors in the tag, which convert then reads); verl global_step_N (each role's optim_* and extra_state_* files, data.pt); accelerate save_state folders (optimizer*.bin, scheduler*.bin, and a DeepSpeed tag's partitions as above); torch DCP folders, torchtitan step-N and Megatron dist-ckpt iter_N (the optim.*/optimizer.*, lr_scheduler.*, dataloader.* and rng_state items dropped; the model items and counters copied byte for byte into new data files of the same names and a new .metadata that torch's dcp.load reads).

Each checkpoint is rebuilt beside itself (kept files hard-linked) with a .ckptctl-slim.json marker written last and swapped in atomically, so a kill at any moment leaves the whole original or the whole slim checkpoint. `list` shows it as `slim`, `verify` checks it as slim, `resume-plan` never picks it. One prune or slim per run at a time.

--json gives run, dry_run, slim (per checkpoint: url, step, freed_bytes, dropped, dropped_files), keep (url, step, reasons), skipped and freed_bytes.

Exit code 0 when done (or nothing to do), 1 when a planned slim failed or was left undone, the prompt was declined, or another prune/slim holds the run's lock; 2 on bad usage (applying without --yes where nothing can prompt, a link where the slim version would be built)."""

EXAMPLES = """\
ckptctl slim runs/llama-sft --dry-run
ckptctl slim runs/llama-sft --keep-full 2 --older-than 3d -y
ckptctl slim runs/llama-sft/checkpoint-2000 -y --json
"""


def register(app: typer.Typer) -> None:
    add_command(app, "slim", slim, HELP, EXAMPLES)


def slim(
    target: Annotated[
        str,
        typer.Argument(
            metavar="RUN|CKPT", help="Run folder, or one checkpoint folder (local path).", show_default=False
        ),
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
    older_than: Annotated[
        str | None,
        typer.Option(
            "--older-than", metavar="AGE", help="Only checkpoints older than this are slimmed (7d, 12h, 30m)."
        ),
    ] = None,
    grace: GraceOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan with the bytes each slim frees; change nothing.")
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Slim without asking for confirmation.")] = False,
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
    if not plan.items:
        out.note(f"no checkpoints found below {plan.run}")
        return
    columns = [
        Column("action"),
        Column("path"),
        Column("step", "right"),
        Column("layout", drop=2),
        Column("size", "right", drop=1),
        Column("frees", "right"),
        Column("why", flexible=True),
    ]
    rows: list[list[Cell]] = []
    for item in plan.items:
        rows.append(
            [
                styled("slim", "yellow") if item.slim else styled("keep", "green"),
                display_path(item.url, plan.run),
                "-" if item.ref.step is None else str(item.ref.step),
                item.ref.layout,
                human_bytes(item.size_bytes),
                human_bytes(item.freed_bytes) if item.slim else "-",
                f"drops {', '.join(item.dropped)}" if item.slim else "; ".join(item.reasons),
            ]
        )
    out.table(columns, rows, title=f"{plan.run}: keep_full={plan.keep_full}")


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
