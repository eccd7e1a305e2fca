"""`ckptctl sync SRC DST`."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.options import DryRunOpt, GraceOpt, JsonOpt, LatestOpt, QuietOpt, WaitOpt, parsed, renamed
from ckptctl.cli.output import Cell, Column, Output, human_bytes, styled
from ckptctl.ops.report import display_path

if TYPE_CHECKING:
    from ckptctl.ops.sync import SyncReport

HELP = """Mirror a run between a local folder and an object store (either way), checkpoint by checkpoint: complete checkpoints only, each one's completing files and the run's pointers last, already-whole ones skipped. --watch follows a training run; --keep-local N then frees the local disk."""

EXAMPLES = """\
ckptctl sync runs/llama-sft s3://bucket/runs/llama-sft
ckptctl sync runs/llama-sft s3://bucket/runs/llama-sft --watch --interval 60 --keep-local 2
ckptctl sync s3://bucket/runs/llama-sft /nvme/llama-sft --latest   # a fresh node, then resume
"""

#: The reference of the command (docs/cli.md, by scripts/gen_cli_reference.py): what the help leaves out.
REFERENCE = r"""Mirrors a run between a local folder and an object store, either way, checkpoint-aware: copies every
checkpoint complete at SRC that is not already whole at DST, keeping the run's layout. Each checkpoint's files
go up in parallel and the files that complete it (`.metadata`, `trainer_state.json`, `ckptctl-manifest.json`,
...) after all the others, then a `ckptctl-digests.json` holding the digests read at SRC, so DST never lists a
partial checkpoint as complete and `verify` there checks every byte; a killed sync leaves a copy that lists as
in progress or broken, and the next sync replaces it. Pointers and trackers (`latest`,
`latest_checkpointed_iteration.txt`) go last, and only while what they name is whole at DST. A checkpoint
already whole at DST is skipped from the two listings, without reading it. In-progress, abandoned, broken and
unknown checkpoints stay behind, listed with why (exit 1 when one is broken). `--watch` follows a training run
(`--interval`, Ctrl-C/SIGTERM stop it after the files in flight, exit 130); `--keep-local N` then deletes older
local checkpoints once they are whole at DST, through prune's plan, lock and trash; `--latest` pulls only what
a resume would load, plus its pointers. One sync per DST at a time (`.ckptctl-sync.lock`; a second exits 2).
With `--watch --json`, each pass is one JSON document on one line. Inside training, `CheckpointManager(root,
mirror=URL)` does the same copy of each step it commits, in the background (its manifest last, then `latest`),
and its retention keeps a step until the copy is whole.

```bash
ckptctl sync runs/llama-sft s3://bucket/runs/llama-sft --watch --keep-local 2
ckptctl sync s3://bucket/runs/llama-sft /nvme/llama-sft --latest --json
```

Exit code 0 when every complete checkpoint is whole at DST; 1 when a checkpoint was skipped as broken at SRC (or --latest finds nothing to resume); 2 when a store fails, SRC cannot be read or another sync into DST is running; 130 when stopped.

`--transfers N` (formerly `--workers`, still accepted with a warning: everywhere else `--workers` counts processes) copies N files at once, and the completing files of up to N checkpoints besides (default 8, `CKPTCTL_IO_WORKERS`).
"""


def register(app: typer.Typer) -> None:
    add_command(app, "sync", sync, HELP, EXAMPLES)


def sync(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Run folder to copy from (path or URL).")],
    dst: Annotated[str, typer.Argument(metavar="DST", help="Run folder to copy into (path or URL).")],
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
            help="Then keep N local checkpoints, delete older synced ones.",
            min=1,
        ),
    ] = None,
    latest: LatestOpt = False,
    transfers: Annotated[
        int | None,
        typer.Option(
            "--transfers",
            metavar="N",
            help="Files copied at once, and the completing files of as many checkpoints besides (default 8; formerly --workers).",
            min=1,
        ),
    ] = None,
    old_workers: Annotated[int | None, typer.Option("--workers", hidden=True, min=1)] = None,
    dry_run: DryRunOpt = False,
    grace: GraceOpt = None,
    wait: WaitOpt = 0.0,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.planned import DEFAULT_GRACE
    from ckptctl.ops.sync import watch as run_watch
    from ckptctl.units import parse_age

    out = Output(json_mode=json_output, quiet=quiet, json_lines=watch)
    grace_age = parsed(parse_age, grace, "--grace")
    transfers = renamed(out, "--workers", "--transfers", old_workers, transfers)
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
            workers=transfers,
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
