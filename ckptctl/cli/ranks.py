"""`convert`, `verify` and `diff` over several processes: the ranks of the torchrun job that started this
process, or `--workers N` (`cli.options.WorkersOpt`) ranks this process starts on its host (`ops.distributed_work`).

Every rank runs the same command and gets the same result; rank 0 alone prints it, and every rank exits
with the same code. A rank that fails makes every rank fail (each says which rank failed and why).
"""

from __future__ import annotations

import contextlib
import contextvars
import signal
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from ckptctl.cli.output import Output, R, RichProgress, show_write
from ckptctl.ops.distributed_work import Ranks, join, launched, leave, run_workers

if TYPE_CHECKING:
    from ckptctl.ops.convert.options import OutputOptions

#: The command line being run (without the program name), set by `cli.app`: `--workers` runs it again
#: in each rank it starts.
ARGS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("ckptctl_cli_args", default=())

#: Whether this process only started `--workers` ranks and exits with their code: then rank 0 has reported
#: the command's outcome (an interruption included), and this process reports nothing of its own.
DELEGATED: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptctl_cli_delegated", default=False)


@contextlib.contextmanager
def job_ranks(workers: int | None) -> Iterator[Ranks | None]:
    """The ranks this command runs over (None: this process alone), for the duration of the command.

    With `workers` > 1 outside a job, this process starts the ranks, waits for them and exits with their
    exit code (`typer.Exit`); the block does not run here.
    """
    if not launched():
        if workers is not None and workers > 1:
            DELEGATED.set(True)
            raise typer.Exit(run_workers(ARGS.get(), workers))
        yield None
        return
    ranks = join()
    # A launcher stops the other ranks of a failed job with SIGTERM: clean up (the staging folder) as on
    # Ctrl-C rather than die where the signal finds the process.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield ranks
    finally:
        signal.signal(signal.SIGTERM, previous)
        leave()


def prints(ranks: Ranks | None) -> bool:
    """Whether this process prints the command's result: it runs alone, or it is rank 0."""
    return ranks is None or ranks.leader


OptionsT = TypeVar("OptionsT", bound="OutputOptions")


def write_on_ranks(
    workers: int | None,
    options: OptionsT,
    dst: str,
    write: Callable[[OptionsT, RichProgress], R],
    render: Callable[[Output, R], None],
    *,
    json_output: bool,
    quiet: bool,
) -> None:
    """Run a command that writes a model into DST (`convert`, `average`) on its ranks (`job_ranks`), each rank
    writing with `options` given those ranks, and show its result (`show_write`): rank 0 alone prints."""
    with job_ranks(workers) as ranks:
        show = prints(ranks)
        out = Output(json_mode=json_output, quiet=quiet or not show)
        show_write(out, dst, lambda progress: write(replace(options, ranks=ranks), progress), render, show=show)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
