"""`ckptctl repair RUN [-y] [--undo]`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.options import DryRunOpt, JsonOpt, QuietOpt, RunArg, WaitOpt, YesOpt
from ckptctl.cli.output import Cell, Output, styled
from ckptctl.quoting import shell

if TYPE_CHECKING:
    from ckptctl.ops.repair import RepairPlan

HELP = """Make the framework's own resume land on the newest checkpoint of the run whose every role verifies: rewrite its pointer, or quarantine the torn newer checkpoints (restorable with --undo). Prints the plan by default (exit code 1 when a repair is needed); -y applies it."""

EXAMPLES = """\
ckptctl repair runs/llama-sft
ckptctl repair runs/llama-sft -y
ckptctl repair out/ds-run --json | jq '.actions'
ckptctl repair runs/llama-sft --undo -y
"""

#: The reference of the command (docs/cli.md, by scripts/gen_cli_reference.py): what the help leaves out.
REFERENCE = r"""Makes the framework's own resume land on the newest checkpoint of the run whose every role verifies, when
the newest save is torn: the target is what `resume-plan` picks, stepping back further while another role
the framework loads with it fails verify (OpenRLHF's critic tag of the same step, verl's role folders,
AReaL's critic slot). The change is the smallest one the framework's loader honours:

| framework | what `repair -y` changes | proved in the tests by |
|---|---|---|
| ckptctl (`native`) | `latest` rewritten | `CheckpointManager.pointer()` / `latest_step()` |
| DeepSpeed | the save folder's `latest` rewritten | `deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(dir, tag=None)` (reads `latest` as `load_checkpoint(dir, tag=None)` does) |
| OpenRLHF | `_actor/latest` and `_critic/latest`, naming tags of one step that both verify | the two `latest` files |
| open-instruct | the state folder's `latest` rewritten | as DeepSpeed |
| Megatron-LM | `latest_checkpointed_iteration.txt` rewritten | parsed as Megatron-LM's `read_metadata` does |
| verl | its tracker rewritten | `verl.utils.checkpoint.checkpoint_manager.find_latest_ckpt_path` |
| HF Trainer | newer `checkpoint-N/` moved into quarantine | `transformers.trainer_utils.get_last_checkpoint` |
| torchtitan | newer `step-N/` (with `.metadata`) moved into quarantine | torchtitan's `CheckpointManager._find_load_step` |
| Lightning | `last.ckpt` pointed at the good file when it is a link (`save_last="link"`); a copy is reported with the `ckpt_path=` to pass (exit 1, nothing changed) | the link's target and bytes |
| AReaL | nothing (one recover dump): a good one needs nothing, a torn one is reported with what to do (AReaL's `check_if_recover` only checks that the folders exist) | |

Quarantine is `RUN/.ckptctl-trash/quarantine/<name>` with `<name>.origin.json` saying where it came from;
nothing is deleted, and `prune`, the manager's retention and trash clean-up never empty it. Before its first
change a repair also records there what every pointer it rewrites held, byte for byte (or that there was none),
so that `ckptctl repair RUN --undo -y` moves the quarantined checkpoints back and puts each pointer back: the
run is byte-identical to what it was, nothing of ckptctl's is left in it, and the framework resumes where it
did before (tested for every framework above with its own latest-finder). A pointer written anew since the
repair (the training went on) is left as it is, and the undo says so and exits 1. The default (and `--dry-run`) prints the
plan and exits 1 when a repair is needed, 0 when none is, so a resume gate can run it; `-y` applies. Pointers
are written atomically (temporary file, fsync, rename, fsync of the folder) and never through a link (a
link where a pointer should be: exit 2, nothing changed); a run being saved to, or locked by a prune or
another repair, is refused; a killed repair leaves each pointer and checkpoint as it was or as planned, and
running it again finishes the job.

```
$ ckptctl repair out/ds-run                 # plan: exit 1 when a repair is needed
$ ckptctl repair out/ds-run -y --json | jq '.actions'
$ ckptctl repair runs/llama-sft --undo -y   # move quarantined checkpoints back, put pointers back
```

Exit code 0 when no repair is needed (or, with -y, it was made), 1 when a repair is needed (a resume gate: `ckptctl repair RUN && train ...`), nothing in the run can be resumed or no change can redirect the resume (a `last.ckpt` copy: the plan says what to pass instead), a save is being written or the run is locked; 2 when the run cannot be read, is of a layout ckptctl does not know or cannot redirect, is not writable, or a link is where a pointer should be (nothing changed). With --undo: 0 when everything was put back (or nothing is left to undo), 1 when the plan was only printed or something stays as it is (a checkpoint whose place is taken, a pointer written anew since the repair: the warning says which).
"""


def register(app: typer.Typer) -> None:
    add_command(app, "repair", repair, HELP, EXAMPLES)


def repair(
    run: RunArg,
    yes: YesOpt = False,
    dry_run: DryRunOpt = False,
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
