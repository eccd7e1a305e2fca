"""`ckptctl sync SRC DST`."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.options import GraceOpt, JsonOpt, QuietOpt, WaitOpt, parsed
from ckptctl.cli.output import Cell, Column, Output, human_bytes, styled
from ckptctl.ops.report import display_path

if TYPE_CHECKING:
    from ckptctl.ops.sync import SyncReport

HELP = """Mirror a run between a local folder and an object store (either way), checkpoint by checkpoint.

Copies every checkpoint that is complete at SRC and not already whole at DST, keeping the run's layout (nested runs, role folders, trackers). Each checkpoint's files go up in parallel, and the files that complete it (.metadata, trainer_state.json, ckptctl-manifest.json, ...) after all the others, then a ckptctl-digests.json with the digests read at SRC: DST never lists a partial checkpoint as complete, and `ckptctl verify` checks every byte there. Pointers and trackers (latest, latest_checkpointed_iteration.txt) go last, and only while what they name is whole at DST. A checkpoint already whole at DST (same files and sizes, its digest record no older than SRC) is skipped without reading it. In-progress, abandoned, broken and unknown checkpoints are not copied; each is listed with why. Files of the run outside any checkpoint are copied beside them (hidden ones are not); nothing at DST is ever deleted.

--watch syncs again every --interval seconds, copying each checkpoint once it is complete; Ctrl-C or SIGTERM stops it after the files in flight. --keep-local N (local SRC, remote DST) then keeps the N newest local checkpoints and deletes older ones that are whole at DST, with prune's plan, lock and trash (never the newest, what a pointer names, or what prune would keep). --latest copies only the checkpoint a resume would load (see `ckptctl resume-plan`) and the pointers, to start a fresh node.

Exit code 0 when every complete checkpoint is whole at DST; 1 when a checkpoint was skipped as broken at SRC (or --latest finds nothing to resume); 2 when a store fails, SRC cannot be read or another sync into DST is running; 130 when stopped."""

EXAMPLES = """\
ckptctl sync runs/llama-sft s3://bucket/runs/llama-sft
ckptctl sync runs/llama-sft s3://bucket/runs/llama-sft --watch --interval 60 --keep-local 2
ckptctl sync s3://bucket/runs/llama-sft /nvme/llama-sft --latest   # a fresh node, then resume
"""


def register(app: typer.Typer) -> None:
    add_command(app, "sync", sync, HELP, EXAMPLES)


def sync(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Run folder to copy from (local path or fsspec URL).")],
    dst: Annotated[str, typer.Argument(metavar="DST", help="Run folder to copy into (local path or fsspec URL).")],
    watch: Annotated[bool, typer.Option("--watch", help="Keep following SRC until interrupted.")] = False,
    interval: Annotated[
        float, typer.Option("--interval", metavar="SECONDS", help="Seconds between passes of --watch.", min=0)
    ] = 30.0,
    passes: Annotated[
        int | None,
        typer.Option("--passes", metavar="N", help="Stop --watch after N passes (default: until interrupted).", min=1),
    ] = None,
    keep_local: Annotated[
        int | None,
        typer.Option(
            "--keep-local",
            metavar="N",
            help="Then keep the N newest local checkpoints; delete older ones once whole at DST.",
            min=1,
        ),
    ] = None,
    latest: Annotated[
        bool, typer.Option("--latest", help="Copy only what a resume of SRC would load, and the pointers.")
    ] = False,
    workers: Annotated[
        int | None, typer.Option("--workers", metavar="N", help="Parallel transfers (default 8).", min=1)
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be copied and deleted.")] = False,
    grace: GraceOpt = None,
    wait: WaitOpt = 0.0,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.prune import DEFAULT_GRACE
    from ckptctl.ops.sync import watch as run_watch
    from ckptctl.units import parse_age

    out = Output(json_mode=json_output, quiet=quiet)
    grace_age = parsed(parse_age, grace, "--grace")
    stop = threading.Event()
    problems = False
    with _stopped_by_signals(stop):
        reports = run_watch(
            src,
            dst,
            interval=interval,
            passes=passes if watch else 1,
            latest=latest,
            keep_local=keep_local,
            dry_run=dry_run,
            grace=grace_age if grace_age is not None else DEFAULT_GRACE,
            wait=wait,
            workers=workers,
            progress=out.progress(),
            stop=stop,
            warn=out.warn,
        )
        for report in reports:
            # With --watch and --json, one document per pass (JSON lines), as each pass ends.
            if json_output:
                out.json(report.to_json())
            elif not quiet:
                _render(out, report)
            problems = problems or bool(report.problems)
    if stop.is_set():
        raise typer.Exit(130)
    if problems:
        raise typer.Exit(1)


@contextmanager
def _stopped_by_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set `stop` (the sync ends after the files in flight) instead of raising mid-file."""
    handlers: dict[int, Any] = {}

    def handle(signum: int, frame: object) -> None:
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            handlers[signum] = signal.signal(signum, handle)
        except ValueError:  # not the main thread (an embedding application): signals stay as they are
            continue
    try:
        yield
    finally:
        for number, previous in handlers.items():
            signal.signal(number, previous)


def _render(out: Output, report: SyncReport) -> None:
    from ckptctl.ops.sync import Action

    columns = [
        Column("action"),
        Column("path"),
        Column("step", "right"),
        Column("size", "right", drop=1),
        Column("time", "right", drop=2),
        Column("why", flexible=True),
    ]
    colour = {Action.COPIED: "green", Action.SKIPPED: "yellow", Action.DELETED_LOCAL: "red"}
    rows: list[list[Cell]] = []
    for item in report.checkpoints:
        action = item.action.value.replace("_", " ")
        rows.append(
            [
                styled(action, "red" if item.problem else colour[item.action]),
                display_path(item.url, report.src),
                "-" if item.step is None else str(item.step),
                human_bytes(item.bytes),
                f"{item.seconds:.1f}s" if item.seconds else "",
                item.reason,
            ]
        )
    for f in report.run_files:
        rows.append([styled(f.action.value, colour[f.action]), f.path, "-", human_bytes(f.bytes), "", f.reason])
    title = f"{report.src} -> {report.dst}" + (" (dry run)" if report.dry_run else "")
    out.table(columns, rows, title=title)
    copied = sum(1 for i in report.checkpoints if i.action is Action.COPIED)
    verb = "would copy" if report.dry_run else "copied"
    out.print(f"{verb} {copied} checkpoint(s), {human_bytes(report.bytes_copied)} in {report.seconds:.1f}s")
