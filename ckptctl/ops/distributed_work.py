"""Splitting `convert`, `verify` and `diff` over the ranks of a job: torchrun on any number of hosts, or
`--workers N` processes on one host.

A rank is one process; `torch.distributed` (gloo, no GPU) carries the little they say to each other: the
plan rank 0 made, each rank's results, and whether any rank failed. The bytes themselves never travel
between ranks: every rank reads its share of the source and writes its share of the output on the
shared filesystem. Work items (output files, files to hash, tensors to read, tensor pairs to compare) go
to ranks by bytes (`balance`), so ranks finish together; `Ranks.share` runs a command's items on this
rank and hands every rank all the results, in item order, so that the report is the one a single process
makes.

What ranks exchange is ckptctl's own data (plans, results of our dataclasses), pickled by
`broadcast_object_list`/`all_gather_object` between processes of one job; nothing read from a checkpoint
is ever unpickled.

A process joins only when a launcher started it as a rank (`launched`): a training script's rank that runs
`ckptctl verify` in a subprocess passes RANK, WORLD_SIZE and MASTER_PORT on to it, and joining the
training job's rendezvous would hang both.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from ckptctl import io
from ckptctl.errors import CkptctlError, RankFailed

__all__ = ["Ranks", "balance", "join", "launched", "leave", "run_workers", "split"]

T = TypeVar("T")
R = TypeVar("R")

#: Set to 1 to join (a launcher this module does not recognise) or 0 to never join.
FORCE_ENV = "CKPTCTL_DISTRIBUTED"
#: How long a rank waits for the others at an exchange. Ranks get balanced shares and reach each exchange
#: together; a rank that dies is noticed by its launcher (or by the broken connection) long before this,
#: so it only bounds a peer that hangs without dying.
_TIMEOUT = timedelta(hours=6)
#: After one rank of `run_workers` fails, how long the others get to fail on their own (they print the
#: failure they agreed on) before they are stopped.
_GRACE_SECONDS = 10.0


def launched() -> bool:
    """Whether this process is one rank of a multi-rank job a launcher started (torchrun, `run_workers`).

    The launcher's own environment has no RANK: a process whose parent has one inherited the variables
    from a rank (a subprocess of a training script) and is a job of its own. `CKPTCTL_DISTRIBUTED=1`/`0`
    overrides the guess.
    """
    forced = os.environ.get(FORCE_ENV)
    if forced is not None:
        return forced == "1"
    if not all(os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return False
    try:
        if int(os.environ["WORLD_SIZE"]) < 2:
            return False
    except ValueError:
        return False
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            parent = f.read().split(b"\0")
    except OSError:  # no /proc: trust the variables
        return True
    return not any(item.startswith(b"RANK=") for item in parent)


def join() -> Ranks | None:
    """This process's place in its job (the gloo process group started when needed), or None when it was
    not launched as one of several ranks.

    Raises:
        RankFailed: the job's rendezvous failed.
    """
    if not launched():
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        # Before the group exists: torch.distributed.nn.functional binds `group.WORLD` as its functions'
        # default when it is first imported, and torch.distributed.checkpoint (convert --to dcp) imports it.
        # Imported under a group, it keeps that group alive past `leave`: its gloo threads then free the
        # last exchange's tensors while the interpreter shuts down, which aborts the process (SIGABRT).
        import torch.distributed.nn.functional  # noqa: F401

        try:
            dist.init_process_group("gloo", timeout=_TIMEOUT)
        except (RuntimeError, ValueError) as exc:
            raise RankFailed(
                f"cannot join the job's ranks: {exc}",
                "check MASTER_ADDR/MASTER_PORT, or unset RANK and WORLD_SIZE to run as one process",
            ) from exc
    return Ranks(dist.get_rank(), dist.get_world_size())


def leave() -> None:
    """Stop the process group `join` started (when there is one)."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(RuntimeError):
            dist.destroy_process_group()


def balance(sizes: Sequence[int], ranks: int) -> list[list[int]]:
    """Indices of `sizes` for each of `ranks` ranks, balanced by their sum: the largest item first to the
    least loaded rank (ties: lowest rank, then the item's order). Each rank's indices are in order."""
    loads = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += sizes[i]
    return [sorted(share) for share in shares]


@dataclass(frozen=True, slots=True)
class Ranks:
    """This process's rank among `size` ranks of a started process group (see `join`)."""

    rank: int
    size: int

    @property
    def leader(self) -> bool:
        """Rank 0: it makes the plans, writes what is written once, and prints."""
        return self.rank == 0

    def broadcast(self, value: T | None) -> T:
        """Rank 0's `value` on every rank (the others pass None)."""
        import torch.distributed as dist

        box = [value]
        self._collective(lambda: dist.broadcast_object_list(box, src=0))
        return box[0]  # type: ignore[return-value]

    def gather(self, value: T) -> list[T]:
        """Every rank's `value`, by rank, on every rank."""
        import torch.distributed as dist

        found: list[Any] = [None] * self.size
        self._collective(lambda: dist.all_gather_object(found, value))
        return found

    def lead(self, work: Callable[[], T]) -> T:
        """`work()` on rank 0, its result (or its error) on every rank."""
        outcome: tuple[T | None, _Failure | None] = (None, None)
        if self.leader:
            try:
                outcome = (work(), None)
            except Exception as exc:
                self.broadcast((None, _Failure.of(exc, self.rank)))
                raise
        result, failure = self.broadcast(outcome)
        if failure is not None:
            raise failure.error()
        return result  # type: ignore[return-value]

    def each(self, work: Callable[[], T]) -> list[T]:
        """`work()` on every rank; every rank's result, by rank, on every rank. A rank whose `work` raises
        makes every rank raise: its own error on that rank, `RankFailed` with the lowest failed rank's
        message and exit code on the others."""
        result: T | None = None
        error: BaseException | None = None
        try:
            result = work()
        except Exception as exc:
            error = exc
        gathered = self.gather((None if error is None else _Failure.of(error, self.rank), result))
        if error is not None:
            raise error
        failures = [failure for failure, _ in gathered if failure is not None]
        if failures:
            raise failures[0].error()
        return [found for _, found in gathered]  # type: ignore[misc]

    def share(self, sizes: Sequence[int], work: Callable[[list[int]], Mapping[int, R]]) -> list[R]:
        """`work(indices)` on this rank's balanced share of the items `sizes` weigh; every item's result,
        in item order, on every rank. A failure fails every rank, as in `each`.

        The bytes the other ranks read for their shares are counted in this rank's open counters
        (`io.counting`), so that a report's `bytes_read` is the job's, as one process would count it.
        """
        mine = balance(sizes, self.size)[self.rank]

        def counted() -> tuple[dict[int, R], int]:
            with io.counting() as read:
                results = dict(work(mine))
            return results, read.bytes_read

        gathered = self.each(counted)
        io.count_read_elsewhere(sum(n for rank, (_, n) in enumerate(gathered) if rank != self.rank))
        merged: dict[int, R] = {}
        for found, _ in gathered:
            merged.update(found)
        return [merged[i] for i in range(len(sizes))]

    def _collective(self, call: Callable[[], Any]) -> None:
        try:
            call()
        except RuntimeError as exc:  # gloo: a peer closed its connection (it died) or timed out
            raise RankFailed(
                f"rank {self.rank} lost contact with the other ranks of the job ({_reason(exc)})",
                "another rank stopped or was killed: see its output (a conversion commits nothing then)",
            ) from exc


def _reason(exc: RuntimeError) -> str:
    """gloo's message without its source location and advice: `Connection closed by peer [host]:port`."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text
    return text.split(". ", 1)[0]


def split(ranks: Ranks | None, sizes: Sequence[int], work: Callable[[list[int]], Mapping[int, R]]) -> list[R]:
    """`ranks.share(...)` over a job's ranks, or `work` on every item in this process."""
    if ranks is None:
        found = work(list(range(len(sizes))))
        return [found[i] for i in range(len(sizes))]
    return ranks.share(sizes, work)


@dataclass(frozen=True, slots=True)
class _Failure:
    """What a failed rank tells the others: enough to raise the same kind of error with the same exit code."""

    rank: int
    message: str
    hint: str
    exit_code: int

    @classmethod
    def of(cls, exc: BaseException, rank: int) -> _Failure:
        if isinstance(exc, CkptctlError):
            return cls(rank, exc.message, exc.hint, exc.exit_code)
        return cls(rank, f"{type(exc).__name__}: {exc}", "", 2)

    def error(self) -> RankFailed:
        return RankFailed(f"rank {self.rank}: {self.message}", self.hint, self.exit_code)


# --------------------------------------------------------------------------------------------------
# `--workers N`: local ranks.
# --------------------------------------------------------------------------------------------------


def run_workers(args: Sequence[str], workers: int) -> int:
    """Run `python -m ckptctl ARGS` as `workers` ranks on this host (the rendezvous a torchrun job has, on
    a free local port) and return the job's exit code: rank 0's, or the first failure's.

    Rank 0 inherits stdout and stderr; the others print only their errors. When one rank fails, the
    others get `_GRACE_SECONDS` to fail as well (they agree on the error) and are then stopped.

    Raises:
        RankFailed: a rank was killed by a signal before rank 0 finished (what it was writing is not
            committed).
    """
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(workers):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(workers),
                "LOCAL_WORLD_SIZE": str(workers),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                FORCE_ENV: "1",
            }
            out = None if rank == 0 else subprocess.DEVNULL
            procs.append(subprocess.Popen([sys.executable, "-m", "ckptctl", *args], env=env, stdout=out))
        _wait_for(procs)
    except BaseException:
        _stop(procs)
        raise
    codes = [p.returncode for p in procs]
    if codes[0] in (0, 1) and all(code <= 0 for code in codes):
        # Rank 0 finished the command (1: it found a problem), past exchanges that every rank's share of
        # the work preceded: a rank killed after them (gloo aborts at teardown on a loaded host) changed
        # nothing, and its own message is on stderr.
        return codes[0]
    for rank, code in enumerate(codes):
        if code < 0 and code != -signal.SIGTERM:
            raise RankFailed(
                f"rank {rank} of {workers} was killed by {signal.Signals(-code).name}",
                "nothing it was part of was committed; run the command again",
            )
    return codes[0] if codes[0] > 0 else next((code for code in codes if code > 0), 0)


def _wait_for(procs: list[subprocess.Popen[bytes]]) -> None:
    """Until every rank exits; once one fails, the rest get a grace period, then SIGTERM."""
    failed_at: float | None = None
    while any(p.poll() is None for p in procs):
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > _GRACE_SECONDS:
            _stop(procs)
            return
        time.sleep(0.05)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every rank still running (they clean up as on Ctrl-C), SIGKILL what outlives that."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + _GRACE_SECONDS
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _free_port() -> int:
    import socket  # imported here: only a launch needs it, and every command imports this module

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
