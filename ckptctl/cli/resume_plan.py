"""`ckptctl resume-plan RUN_DIR`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.options import JsonOpt, QuietOpt, RunArg, RunLayoutOpt, WorldSizeOpt
from ckptctl.cli.output import Cell, Output, human_bytes, styled
from ckptctl.ops.report import display_path

if TYPE_CHECKING:
    from ckptctl.ops.resume_plan import ResumePlan

HELP = """Say which checkpoint a resume of the run would load, why newer ones are skipped, what it restores, whether it loads on --world-size ranks, and the exact setting to pass the framework that wrote it. Exit code 0 with a plan that loads as asked, 1 when nothing is resumable, 2 when the run cannot be read."""

EXAMPLES = """\
ckptctl resume-plan runs/llama-sft
ckptctl resume-plan runs/llama-sft --world-size 16 --json | jq -r .resume_hint
ckptctl resume-plan out/ds-run --layout deepspeed --digests
"""

#: The reference of the command (docs/cli.md, by scripts/gen_cli_reference.py): what the help leaves out.
REFERENCE = r"""Which checkpoint a resume of the run would load, and how to ask for it. Checkpoints are tried newest
first: one still being written, broken, or failing structural verify (`--digests` also checks recorded
digests) is skipped with the reason; DeepSpeed, OpenRLHF and open-instruct load what `latest` names, so
tags newer than it are skipped as unfinished saves. For the one chosen: the step, epoch and counters it
continues from (consumed samples, episodes, training steps where the framework records them); the
components the framework restores and those it does not, each with what that means for the run (no
optimizer state, no RNG, no sampler state, AReaL's critic, ...); whether it loads on `--world-size N`
ranks (torch DCP reshards; DeepSpeed ZeRO needs the same data-parallel size, otherwise the plan gives the
`ds_to_universal` command to run first; AReaL and verl need the same parallelism; ckptctl's single-process saves
load anywhere) and roughly how many bytes each rank reads; and the exact setting for the framework that
wrote it (`CheckpointManager(root).restore(state[, step=N])`, `dcp.load(state, checkpoint_id=...)`,
`trainer.train(resume_from_checkpoint=...)`, `accelerator.load_state(dir)`, `engine.load_checkpoint(dir, tag=...)`, `--load_checkpoint
--ckpt_path`, `--checkpoint_state_dir`, `recover.mode=on` with the same experiment and trial names,
`resume_from_checkpoint: <path>`, verl's `trainer.resume_mode=auto` when its tracker names the step, else
`trainer.resume_mode=resume_path trainer.resume_from_path=<global_step_N>`). Paths in these settings and in
the commands to run first are quoted (`shlex.quote` for shell words, Python literals for code, a comment
for what follows), so that pasting one runs exactly that call on exactly that path; human output shows
the control characters of any name from a checkpoint as escapes (`\x1b`), `--json` keeps names exact. Warnings cover each framework's traps: a DCP folder overwritten in place
whose `.metadata` is older than its data, AReaL info files older than its weights, a `latest` naming a tag
with missing rank files, open-instruct's start-up deleting folders with fewer files, RNG keys an older
checkpoint lacks, CUDA generators a CPU save lacks (only when the resume uses CUDA: `--cuda`, or a CUDA
device on the machine that plans), and the Trainer resuming from the highest `checkpoint-N` without
checking it. What the framework loads along with the chosen checkpoint is verified as well: OpenRLHF's
`--load_checkpoint` also loads the tag `_critic/latest` names, and one that does not load (a rank file
missing, a file cut short, a tag that is not there) is a blocker (`blockers` in `--json`) with what to
write into the `latest` files first. `resume-plan RUN/_critic` plans the critic's folder alone. Exit 0 with
a plan that loads as asked, 1 when nothing is resumable, it cannot load on `--world-size` ranks as it is
(the plan then says what to run first) or a blocker stands, 2 on errors.

```console
$ ckptctl resume-plan dcp-run --world-size 4
resume from     dcp-run/step-20 (torch.distributed.checkpoint, step 20)
skipped         dcp-run/step-30 (step 30): in progress: no .metadata yet
continues from  step 20
restores        model, optimizer
not restored    scheduler: no LR scheduler state: the schedule restarts from its first step unless the
                training code sets it from the step
not restored    rng: no RNG state: dropout, sampling and shuffling draw other numbers than an
                uninterrupted run
not restored    dataloader: no data loader/sampler state: the data order restarts, so samples seen before
                the save are seen again unless the code skips them
not restored    trainer_state: no step/epoch counters: the loop counts from 0 unless it is told the step
                (schedules, logging and saves shift)
ranks           4 (saved on 2): ok; torch DCP reshards at load: 4 rank(s) each read their part
reads per rank  ~291.0 KiB
setting         dcp.load(state, checkpoint_id='dcp-run/step-20')
$ ckptctl resume-plan out/ds-run --world-size 16 --json | jq -r '.resume_hint, .world_size.fix'
```
"""


def register(app: typer.Typer) -> None:
    add_command(app, "resume-plan", resume_plan, HELP, EXAMPLES)


def resume_plan(
    run: RunArg,
    world_size: WorldSizeOpt = None,
    digests: Annotated[
        bool,
        typer.Option("--digests", help="Also check every file of each candidate against its recorded digests."),
    ] = False,
    cuda: Annotated[
        bool | None,
        typer.Option(
            "--cuda/--no-cuda",
            help="Whether the resumed run uses CUDA, which decides if missing CUDA generator states matter "
            "(default: whether torch sees a CUDA device on this machine).",
            show_default=False,
        ),
    ] = None,
    layout: RunLayoutOpt = None,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.resume_plan import plan_resume

    out = Output(json_mode=json_output, quiet=quiet)
    plan = plan_resume(
        run,
        world_size=world_size,
        layout=layout,
        digests=digests,
        progress=out.progress(),
        cuda=cuda,
    )
    if json_output:
        out.json(plan.to_json())
    else:
        _render(out, plan)
    if not quiet:
        for warning in plan.warnings:
            out.warn(warning)
    if not plan.resumable and plan.unknown_layout:
        raise typer.Exit(2)
    if not plan.resumable or plan.blockers or (plan.world_size is not None and plan.world_size.ok is False):
        raise typer.Exit(1)


def _unknown(plan: ResumePlan) -> str:
    """The checkpoints of a layout ckptctl does not know, when they are all the run holds to resume from."""
    names = ", ".join(display_path(s.url, plan.run) for s in plan.unknown_layout[:4])
    more = f" and {len(plan.unknown_layout) - 4} more" if len(plan.unknown_layout) > 4 else ""
    return f"{plan.run} holds checkpoints ckptctl cannot read as a training state ({names}{more})"


def _render(out: Output, plan: ResumePlan) -> None:
    facts: list[tuple[str, Cell]] = []
    chosen = plan.checkpoint
    if chosen is None and plan.unknown_layout:
        facts.append(("resume from", styled("unknown layout", "red") + styled(f": {_unknown(plan)}", "")))
    elif chosen is None:
        facts.append(("resume from", styled("nothing resumable", "red") + styled(f" in {plan.run}", "")))
    else:
        step = "" if chosen.step is None else f", step {chosen.step}"
        facts.append(("resume from", styled(chosen.url, "green") + styled(f" ({plan.framework}{step})", "")))
    for skipped in plan.skipped:
        step = "" if skipped.step is None else f" (step {skipped.step})"
        facts.append(("skipped", f"{skipped.url}{step}: {skipped.reason}"))
    if chosen is not None:
        counters = ", ".join(f"{k} {v}" for k, v in plan.continues_from.items() if v is not None)
        facts.append(("continues from", counters or "-"))
        facts.append(("restores", ", ".join(plan.restores) or "-"))
        for name in plan.missing:
            facts.append(("not restored", styled(name, "yellow") + styled(f": {plan.impacts.get(name, '')}", "")))
        check = plan.world_size
        if check is not None:
            verdict = {True: styled("ok", "green"), False: styled("no", "red"), None: styled("unknown", "yellow")}
            saved = "" if check.saved is None else f" (saved on {check.saved})"
            facts.append(
                ("ranks", styled(f"{check.target}{saved}: ", "") + verdict[check.ok] + styled(f"; {check.note}", ""))
            )
            if check.fix:
                facts.append(("first run", check.fix))
            if check.bytes_per_rank is not None:
                facts.append(("reads per rank", f"~{human_bytes(check.bytes_per_rank)}"))
        facts.append(("setting", plan.resume_hint or "-"))
        for blocker in plan.blockers:
            facts.append(("fails", styled(blocker.url, "red") + styled(f": {blocker.reason}", "")))
            facts.append(("first", blocker.fix))
    out.facts(facts)
