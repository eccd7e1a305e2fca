"""`ckptctl prune RUN_DIR`."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.options import (
    DepthOpt,
    DryRunOpt,
    GraceOpt,
    JsonOpt,
    OlderThanOpt,
    PlanPrompt,
    QuietOpt,
    RunArg,
    WaitOpt,
    YesOpt,
    bad_value,
    parsed,
    plan_table,
)
from ckptctl.cli.output import Cell, Column, Output, human_bytes, styled
from ckptctl.errors import CkptctlError
from ckptctl.layouts import DEFAULT_SCAN_DEPTH

if TYPE_CHECKING:
    from ckptctl.core.retention import RetentionPolicy
    from ckptctl.ops.prune import PruneItem, PrunePlan, PruneReport

HELP = """Delete the checkpoints of a run that the retention rules (--keep-last, --keep-every, --keep-best, --max-total-size, or RUN/ckptctl.toml) do not keep, safely. Never the newest complete one, what a pointer names, anything in progress or pinned; plans, then asks unless --yes."""

EXAMPLES = """\
ckptctl prune runs/llama-sft --keep-last 3 --keep-every 1000 --dry-run
ckptctl prune runs/llama-sft --keep-last 2 --keep-best eval_loss:min --max-total-size 2TB -y
ckptctl prune runs/llama-sft --older-than 7d --pin 5000 --json -y   # cron; rules may live in ckptctl.toml
"""

#: The reference of the command (docs/cli.md, by scripts/gen_cli_reference.py): what the help leaves out.
REFERENCE = r"""Deletes the checkpoints a retention policy does not keep: scan → plan → confirm → delete, as `hf cache
prune`. Rules compose with "any": `--keep-last N` (complete checkpoints), `--keep-every K` (steps),
`--keep-best METRIC[:min|max]` (metrics from ckptctl manifests and the Trainer's `trainer_state.json`;
`*loss` defaults to min), then `--max-total-size 2TB` deletes the oldest checkpoints only rules keep until
the run fits; `--older-than 7d` leaves younger ones alone; `--pin STEP` (repeatable). Nested runs
(`_actor/`, `_critic/`) are planned folder by folder. Without rule options the `[retention]` table of
`RUN_DIR/ckptctl.toml` is used, for cron:

```toml
[retention]
keep_last = 3
keep_every = 5000
keep_best = "eval_loss:min"
max_total_size = "2TB"
grace = "30m"
```

Never deleted, and each kept checkpoint says why: the newest complete one; what a `latest` pointer names
(ckptctl's, DeepSpeed's), the Trainer's `best_model_checkpoint`, OpenRLHF `best*` folders, the highest
accelerate `checkpoint_N` (what `load_state()` without a path loads) and its newest save when the numbering
restarted; anything in
progress (no completion marker, staging names such as `.step-N.staging-*` or `*.tmp`, a live writer's
lock file, a file modified within `--grace`, default 10 minutes); pinned steps; symbolic links (kept and
never followed: neither the link nor what it points to is deleted, and a link inside a deleted checkpoint
is removed as a link).

`--dry-run` prints the plan (`--json` for scripts) and changes nothing; otherwise it asks before deleting,
unless `--yes` (without a terminal and without `--yes` it exits 2 and deletes nothing). Each checkpoint is
renamed into the `.ckptctl-trash` folder beside it and deleted there, so an interrupted prune never
leaves a half-deleted checkpoint that lists as complete (the next prune empties the trash, and an empty
trash folder is removed); on object stores the completion markers go first. The trash is opened and
emptied through directory descriptors without following links: a symbolic link (or anything but a folder)
where `.ckptctl-trash` or the lock should be is refused with exit 2 naming it, before anything is moved,
`--dry-run` included, so a link planted in a shared run folder cannot aim a cron prune at other files. One prune per run at a time (`.ckptctl-prune.lock` with host and
pid; a dead holder's lock is taken over with a warning; `--wait` seconds for a live one). Exit 0 when
the run meets the rules, 1 whenever it does not, dry runs included (a protected checkpoint no rule keeps,
still over budget after deleting what it could, locked, failed, a declined prompt), 2 bad usage (a
`--keep-best` metric that no checkpoint records, so a typo never keeps nothing). The same
`RetentionPolicy` runs in `CheckpointManager(policy=...)` after each save.

```bash
ckptctl prune runs/llama-sft --keep-last 3 --keep-every 5000 --dry-run
ckptctl prune runs/llama-sft --keep-last 2 --keep-best eval_loss --max-total-size 2TB -y --json
```
"""


def register(app: typer.Typer) -> None:
    add_command(app, "prune", prune, HELP, EXAMPLES)


def prune(
    run: RunArg,
    keep_last: Annotated[
        int | None, typer.Option("--keep-last", metavar="N", help="Keep the newest N complete checkpoints.", min=1)
    ] = None,
    keep_every: Annotated[
        int | None,
        typer.Option("--keep-every", metavar="K", help="Keep checkpoints whose step is a multiple of K.", min=1),
    ] = None,
    keep_best: Annotated[
        list[str] | None,
        typer.Option(
            "--keep-best",
            metavar="METRIC[:min|max]",
            help="Keep the best by a recorded metric (*loss: min); repeatable.",
        ),
    ] = None,
    max_total_size: Annotated[
        str | None,
        typer.Option(
            "--max-total-size",
            metavar="SIZE",
            help="Then delete the oldest until the run fits (2TB).",
        ),
    ] = None,
    older_than: OlderThanOpt = None,
    pin: Annotated[
        list[int] | None, typer.Option("--pin", metavar="STEP", help="Never delete this step; repeatable.", min=0)
    ] = None,
    grace: GraceOpt = None,
    slim: Annotated[
        bool,
        typer.Option(
            "--slim",
            help="Slim what the rules delete instead (keep the models).",
        ),
    ] = False,
    dry_run: DryRunOpt = False,
    yes: YesOpt = False,
    wait: WaitOpt = 30.0,
    depth: DepthOpt = DEFAULT_SCAN_DEPTH,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.core.retention import KeepBest, RetentionPolicy
    from ckptctl.ops.planned import DEFAULT_GRACE
    from ckptctl.ops.prune import POLICY_FILE, load_policy_file
    from ckptctl.ops.prune import prune as run_prune
    from ckptctl.units import parse_age, parse_size

    out = Output(json_mode=json_output, quiet=quiet)
    try:
        best = tuple(KeepBest.parse(b) for b in keep_best or ())
    except ValueError as exc:
        raise bad_value("--keep-best", str(exc)) from exc
    size = parsed(parse_size, max_total_size, "--max-total-size")
    age = parsed(parse_age, older_than, "--older-than")
    grace_age = parsed(parse_age, grace, "--grace")

    policy: RetentionPolicy
    if keep_last is not None or keep_every is not None or best or size is not None or age is not None:
        policy = RetentionPolicy(keep_last, keep_every, best, size, age, frozenset(pin or ()))
    else:
        from_file = load_policy_file(run)
        if from_file is None:
            raise CkptctlError(
                "no retention rule given",
                f"pass --keep-last, --keep-every, --keep-best, --max-total-size or --older-than, or write a [retention] table into {POLICY_FILE} in the run folder",
            )
        policy, file_grace = from_file
        policy = replace(policy, pin=policy.pin | frozenset(pin or ()))
        grace_age = grace_age if grace_age is not None else file_grace
        out.note(f"rules from {POLICY_FILE}: {policy.describe()}")

    prompt = PlanPrompt(out, _render_plan, _render_summary, yes=yes, json_output=json_output, quiet=quiet)

    def confirm(plan: PrunePlan) -> bool:
        what = f"delete {len(plan.delete)} checkpoint(s)" + (f" and slim {len(plan.slim)}" if plan.slim else "")
        return prompt.confirmed(plan, what, f"{what.capitalize()}, freeing {human_bytes(plan.freed_bytes)}?")

    report = run_prune(
        run,
        policy,
        grace=grace_age if grace_age is not None else DEFAULT_GRACE,
        dry_run=dry_run,
        confirm=confirm,
        wait=wait,
        max_depth=depth,
        progress=out.progress(),
        warn=out.warn,
        require_metrics=bool(best),
        slim_instead=slim,
    )
    prompt.show(report)
    for note in () if quiet else report.plan.protected_notes:
        out.note(f"note: {note}")
    # A declined prompt leaves every planned deletion in place: one line says so, not one per checkpoint.
    unmet = report.plan.unmet if report.cancelled else report.unmet
    if not quiet:
        for problem in unmet:
            out.warn(problem)
    # The rules are met or not, whatever this run managed to delete (and whether it was a dry run): a
    # cron job must see 1 as long as the run stays over its budget or keeps what it cannot judge; what a
    # framework's convention keeps is no failure (a note above).
    if report.failed or report.cancelled or unmet:
        raise typer.Exit(1)


def _render_plan(out: Output, plan: PrunePlan) -> None:
    columns = [Column("state", drop=2), Column("size", "right", drop=1), Column("why", flexible=True)]
    plan_table(out, plan.run, plan.items, _plan_row, columns, title=f"{plan.run}: {plan.policy.describe()}")


def _plan_row(item: PruneItem) -> list[Cell]:
    if not item.keep:
        action = styled("delete", "red")
    elif item.slim:
        action = styled("slim", "yellow")
    elif item.blocked:
        action = styled("protected", "yellow")
    else:
        action = styled("keep", "green")
    return [action, item.ref.state.value, human_bytes(item.size_bytes), "; ".join(item.reasons)]


def _render_summary(out: Output, report: PruneReport) -> None:
    plan = report.plan
    left = len(plan.items) - len(report.deleted)
    kept = f"keeping {left} ({human_bytes(plan.total_bytes - report.freed_bytes)})"
    slims = f" and slim {len(plan.slim)}" if plan.slim else ""
    if report.dry_run:
        out.print(
            f"dry run: would delete {len(plan.delete)} checkpoint(s){slims}, freeing {human_bytes(plan.freed_bytes)}; "
            f"{kept}"
        )
    elif report.cancelled:
        out.print("cancelled: nothing deleted")
    else:
        trash = f" (and {human_bytes(report.trash_freed_bytes)} of leftover trash)" if report.trash_freed_bytes else ""
        slimmed = f", slimmed {len(report.slimmed)}" if report.slimmed else ""
        out.print(
            f"deleted {len(report.deleted)} checkpoint(s){slimmed}, freed {human_bytes(report.freed_bytes)}{trash}; "
            f"{kept}"
        )
