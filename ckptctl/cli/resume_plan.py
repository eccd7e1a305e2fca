"""`ckptctl resume-plan RUN_DIR`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.options import JsonOpt, QuietOpt, RunLayoutOpt
from ckptctl.cli.output import Cell, Output, human_bytes, styled
from ckptctl.ops.report import display_path

if TYPE_CHECKING:
    from ckptctl.ops.resume_plan import ResumePlan

HELP = """Say which checkpoint a resume of the run would load, what it restores, and how to ask for it.

Checkpoints are tried newest first; one still being written, broken, or failing structural verify is skipped with the reason (frameworks that follow a `latest` pointer load the tag it names). For the one chosen: the step, epoch and counters it continues from; the components the framework restores and those it does not, with what that means for the run; whether it loads on --world-size ranks (torch DCP reshards, DeepSpeed ZeRO needs the same data-parallel size or a universal checkpoint) and what each rank reads; the exact setting for the framework that wrote it; and warnings about each framework's traps (a DCP folder overwritten in place, a `latest` naming a broken tag, the Trainer picking the highest checkpoint-N without checking it, ...).

What the framework loads along with it is verified too (OpenRLHF's critic, from `_critic/latest`): one that does not load blocks the resume, and the plan says what to write first.

Exit code 0 with a plan that loads as asked, 1 when nothing is resumable, the checkpoint cannot load on --world-size ranks as it is, or what loads along with it does not load, 2 when the folder cannot be read or holds only checkpoints of a layout ckptctl does not know (state `unknown` in `ckptctl list`: "unknown layout", never "nothing resumable")."""

EXAMPLES = """\
ckptctl resume-plan runs/llama-sft
ckptctl resume-plan runs/llama-sft --world-size 16 --json | jq -r .resume_hint
ckptctl resume-plan out/ds-run --layout deepspeed --digests
"""


def register(app: typer.Typer) -> None:
    add_command(app, "resume-plan", resume_plan, HELP, EXAMPLES)


def resume_plan(
    run: Annotated[
        str, typer.Argument(metavar="RUN", help="Run folder (local path or fsspec URL).", show_default=False)
    ],
    world_size: Annotated[
        int | None,
        # The upper bound keeps per-rank bookkeeping finite; no job has a million ranks.
        typer.Option(
            "--world-size", metavar="N", help="Ranks of the resumed run (default: as saved).", min=1, max=1 << 20
        ),
    ] = None,
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
