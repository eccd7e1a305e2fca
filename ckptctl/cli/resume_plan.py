"""`ckptctl resume-plan RUN_DIR`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from ckptctl.cli.options import JsonOpt, QuietOpt, RunLayoutOpt
from ckptctl.cli.output import Output, esc, human_bytes

if TYPE_CHECKING:
    from ckptctl.ops.resume_plan import ResumePlan

HELP = """Say which checkpoint a resume of the run would load, what it restores, and how to ask for it.

Checkpoints are tried newest first; one still being written, broken, or failing structural verify is
skipped with the reason (frameworks that follow a `latest` pointer load the tag it names). For the one
chosen: the step, epoch and counters it continues from; the components the framework restores and
those it does not, with what that means for the run; whether it loads on --world-size ranks (torch DCP
reshards, DeepSpeed ZeRO needs the same data-parallel size or a universal checkpoint) and what each
rank reads; the exact setting for the framework that wrote it; and warnings about each framework's
traps (a DCP folder overwritten in place, a `latest` naming a broken tag, the Trainer picking the
highest checkpoint-N without checking it, ...).

Exit code 0 with a plan, 1 when nothing is resumable, 2 when the folder cannot be read.

[bold]Examples[/bold]

  ckptctl resume-plan runs/llama-sft

  ckptctl resume-plan runs/llama-sft --world-size 16 --json | jq -r .resume_hint

  ckptctl resume-plan out/ds-run --layout deepspeed --digests
"""


def register(app: typer.Typer) -> None:
    app.command("resume-plan", help=HELP)(resume_plan)


def resume_plan(
    run: Annotated[str, typer.Argument(help="Run folder (local path or fsspec URL).", show_default=False)],
    world_size: Annotated[
        int | None,
        # The upper bound keeps per-rank bookkeeping finite; no job has a million ranks.
        typer.Option(
            "--world-size", metavar="N", help="Ranks of the resumed run (default: as saved).", min=1, max=1 << 20
        ),
    ] = None,
    digests: Annotated[
        bool, typer.Option("--digests", help="Also check every file of each candidate against its recorded digests.")
    ] = False,
    layout: RunLayoutOpt = None,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.resume_plan import plan_resume

    out = Output(json_mode=json_output, quiet=quiet)
    plan = plan_resume(run, world_size=world_size, layout=layout, digests=digests, progress=out.progress())
    if json_output:
        out.json(plan.to_json())
    else:
        _render(out, plan)
    if not quiet:
        for warning in plan.warnings:
            out.warn(warning)
    if not plan.resumable:
        raise typer.Exit(1)


def _render(out: Output, plan: ResumePlan) -> None:
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column(overflow="fold")
    chosen = plan.checkpoint
    if chosen is None:
        facts.add_row("resume from", f"[red]nothing resumable[/red] in {esc(plan.run)}")
    else:
        step = "" if chosen.step is None else f", step {chosen.step}"
        facts.add_row("resume from", f"[green]{esc(chosen.url)}[/green] {esc(f'({plan.framework}{step})')}")
    for skipped in plan.skipped:
        step = "" if skipped.step is None else f" (step {skipped.step})"
        facts.add_row("skipped", esc(f"{skipped.url}{step}: {skipped.reason}"))
    if chosen is not None:
        counters = ", ".join(f"{k} {v}" for k, v in plan.continues_from.items() if v is not None)
        facts.add_row("continues from", esc(counters or "-"))
        facts.add_row("restores", esc(", ".join(plan.restores) or "-"))
        for name in plan.missing:
            facts.add_row("not restored", f"[yellow]{esc(name)}[/yellow]: {esc(plan.impacts.get(name, ''))}")
        check = plan.world_size
        if check is not None:
            verdict = {True: "[green]ok[/green]", False: "[red]no[/red]", None: "[yellow]unknown[/yellow]"}[check.ok]
            saved = "" if check.saved is None else f" (saved on {check.saved})"
            facts.add_row("ranks", f"{check.target}{esc(saved)}: {verdict}; {esc(check.note)}")
            if check.fix:
                facts.add_row("first run", esc(check.fix))
            if check.bytes_per_rank is not None:
                facts.add_row("reads per rank", f"~{human_bytes(check.bytes_per_rank)}")
        facts.add_row("setting", esc(plan.resume_hint or "-"))
    out.print(facts)
