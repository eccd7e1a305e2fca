"""`ckptctl repair RUN [-y] [--undo]`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.options import JsonOpt, QuietOpt, WaitOpt
from ckptctl.cli.output import Cell, Output, styled
from ckptctl.quoting import shell

if TYPE_CHECKING:
    from ckptctl.ops.repair import RepairPlan

HELP = """Make the framework's own resume land on the newest checkpoint of the run whose every role verifies.

The target is the checkpoint `resume-plan` picks (newer ones that are in progress, broken or fail structural verify are skipped), stepping back further while another role the framework loads with it does not verify (OpenRLHF's critic, verl's role folders, AReaL's critic slot). The change is the smallest one the framework's loader honours: its pointer rewritten (DeepSpeed's `latest`, each OpenRLHF role's, open-instruct's, Megatron's and verl's `latest_checkpointed_iteration.txt`, ckptctl's own `latest`, Lightning's `last.ckpt` when it is a link), or, where the loader picks the highest step by name (the Trainer's `checkpoint-N`, torchtitan's `step-N`), the newer checkpoints moved into the run's quarantine (`RUN/.ckptctl-trash/quarantine/`, with a record of where each came from), which prune and trash clean-up never empty. What each rewritten pointer held (or that there was none) is recorded there too, before the first change: `repair --undo -y` moves the quarantined checkpoints back and puts every pointer back as it was (one written anew since the repair is left, and said), so that the run is byte-identical to before and the framework resumes where it did. Nothing is deleted. AReaL keeps a single recover dump: a torn one cannot be repaired, and the plan says what to do.

By default (and with --dry-run) the plan is printed and nothing changes; -y applies it. Pointers are written atomically (temporary file, fsync, rename, fsync of the folder) and never through a link; a run being saved to, or locked by a prune or another repair, is refused.

Exit code 0 when no repair is needed (or, with -y, it was made), 1 when a repair is needed (a resume gate: `ckptctl repair RUN && train ...`), nothing in the run can be resumed or no change can redirect the resume (a `last.ckpt` copy: the plan says what to pass instead), a save is being written or the run is locked; 2 when the run cannot be read, is of a layout ckptctl does not know or cannot redirect, is not writable, or a link is where a pointer should be (nothing changed). With --undo: 0 when everything was put back (or nothing is left to undo), 1 when the plan was only printed or something stays as it is (a checkpoint whose place is taken, a pointer written anew since the repair: the warning says which)."""

EXAMPLES = """\
ckptctl repair runs/llama-sft
ckptctl repair runs/llama-sft -y
ckptctl repair out/ds-run --json | jq '.actions'
ckptctl repair runs/llama-sft --undo -y
"""


def register(app: typer.Typer) -> None:
    add_command(app, "repair", repair, HELP, EXAMPLES)


def repair(
    run: Annotated[
        str, typer.Argument(metavar="RUN", help="Run folder (local path or fsspec URL).", show_default=False)
    ],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Apply the plan (the default only prints it).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing (the default).")] = False,
    undo: Annotated[
        bool,
        typer.Option(
            "--undo", help="Undo earlier repairs: move quarantined checkpoints back, put rewritten pointers back."
        ),
    ] = False,
    wait: WaitOpt = 30.0,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.repair import plan_repair, plan_undo
    from ckptctl.ops.repair import repair as run_repair

    out = Output(json_mode=json_output, quiet=quiet)
    if yes and not dry_run:
        plan = run_repair(run, wait=wait, undo=undo)
    else:
        plan = plan_undo(run) if undo else plan_repair(run)
    if json_output:
        out.json(plan.to_json())
    else:
        _render(out, plan)
    for note in () if quiet else (*plan.notes, *plan.left):  # to stderr also beside --json, whose document holds them
        out.warn(note)
    if plan.undo:
        raise typer.Exit(1 if plan.left or (plan.dry_run and plan.actions) else 0)
    if plan.target is None or plan.refusal is not None or (plan.dry_run and plan.needed):
        raise typer.Exit(1)


def _render(out: Output, plan: RepairPlan) -> None:
    facts: list[tuple[str, Cell]] = []
    if not plan.undo:
        if plan.target is None:
            facts.append(("resume from", styled("nothing resumable", "red") + styled(f" in {plan.run}", "")))
        else:
            step = "" if plan.target.step is None else f", step {plan.target.step}"
            facts.append(("resume from", styled(plan.target.url, "green") + styled(f" ({plan.framework}{step})", "")))
        for skipped in plan.skipped:
            step = "" if skipped.step is None else f" (step {skipped.step})"
            facts.append(("skipped", f"{skipped.url}{step}: {skipped.reason}"))
    verb = {"pointer": "rewrite", "link": "relink", "quarantine": "quarantine", "restore": "move back"}
    done = {"pointer": "rewrote", "link": "relinked", "quarantine": "quarantined", "restore": "moved back"}
    for action in plan.actions:
        what = (done if not plan.dry_run else verb)[action.kind]
        if plan.undo and action.kind in ("pointer", "link"):  # an undo writes back what the pointer held
            what = "restored" if not plan.dry_run else "restore"
        if action.kind in ("pointer", "link"):
            facts.append((what, f"{action.path}: {_shown(action.before)} -> {_shown(action.after)}"))
        else:
            facts.append((what, f"{action.path} -> {action.after}"))
    if not plan.actions:
        facts.append(("changes", "nothing to undo" if plan.undo else "none needed" if plan.target else "none possible"))
    elif plan.dry_run:
        facts.append(("apply with", shell("ckptctl", "repair", plan.run, *(["--undo"] if plan.undo else []), "-y")))
    out.facts(facts)


def _shown(content: str | None) -> str:
    return "(none)" if content is None else repr(content.strip())
