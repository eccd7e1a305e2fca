"""Syncs SIGKILLed at seeded random points, many trials in one process: it imports ckptctl once and forks a
child per trial, which syncs a fresh copy of TEMPLATE into a DST of its own with 4 transfers at once and kills
itself with SIGKILL just before or just after its K-th storage call (`ckptctl.io`'s transfers, listings, reads
and deletions), other uploads in flight. Odd trials sync with `--keep-local 1`. After each death a second child
checks DST as `ckptctl list` and `verify` see it, then runs the next sync and checks again; one JSON line per
trial on stdout (the test's assertions are on those).

K is drawn between 1 and the number of storage calls a whole sync of the same kind makes (counted first, by
two children that are not killed), so that every kill lands inside a sync.

Run: `python -m tests.s3._sync_kill_trials TEMPLATE WORK DST SEED TRIALS` (with the S3 server's AWS_* set).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import random
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import CheckpointState
from ckptctl.errors import CheckpointNotFound
from ckptctl.io import trash
from ckptctl.layouts import scan_run
from ckptctl.ops.sync import sync
from ckptctl.ops.verification import verify_checkpoint

#: The storage calls a kill may come before or after (`io.X`, and the trash's batched deletion).
CALLS = (
    "upload_file",
    "write_bytes_atomic",
    "read_bytes",
    "list_tree",
    "list_dir",
    "exists",
    "delete_file",
    "delete_files",
    "delete_tree",
    "is_dir",
)
WORKERS = 4


def _sync_once(src: str, dst: str, keep_local: bool) -> None:
    sync(src, dst, keep_local=1 if keep_local else None, grace=timedelta(0), workers=WORKERS)


def _killed_sync(src: str, dst: str, keep_local: bool, kill_at: int = 0, before: bool = False) -> str:
    """Sync, counting storage calls, and die by SIGKILL before or after the `kill_at`-th (0: never); the number
    of calls made when it was not killed."""
    counter, lock = itertools.count(1), threading.Lock()

    def counted(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with lock:
                n = next(counter)
            if n == kill_at and before:
                os.kill(os.getpid(), signal.SIGKILL)
            out = real(*args, **kwargs)
            if n == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        return call

    for name in CALLS:
        setattr(io, name, counted(getattr(io, name)))
    trash.delete_objects = counted(trash.delete_objects)  # type: ignore[assignment]
    _sync_once(src, dst, keep_local)
    with lock:
        return str(next(counter) - 1)


def _forked(work: Callable[[], str]) -> tuple[int, str]:
    """Run `work` in a forked child: (the signal that ended it or 0, what it returned). This process itself
    never touches the store nor hashes, so that each child starts without threads: s3fs's event loop thread
    and blake3's thread pool (`max_threads=AUTO`) would not exist in a child forked after they started, and a
    hash waiting on them would wait forever."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into the caller's code
        code = 1
        try:
            os.close(read)
            os.write(write, work().encode())
            code = 0
        except BaseException as exc:
            print(f"a trial's child failed: {exc!r}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        said = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status), said
    if os.WEXITSTATUS(status) != 0:
        raise SystemExit(f"a trial's child failed with exit code {os.WEXITSTATUS(status)}")
    return 0, said


def _states(url: str) -> dict[str, Any]:
    try:
        return {io.relative_to(ref.url, url): ref for ref in scan_run(url)}
    except CheckpointNotFound:  # killed before its first upload
        return {}


def _unverified(refs: dict[str, Any], done: set[str]) -> list[str]:
    """The complete checkpoints not yet verified (adds them to `done`) that fail `verify`."""
    failed = []
    for rel, ref in sorted(refs.items()):
        if ref.state == CheckpointState.COMPLETE and rel not in done:
            done.add(rel)
            result = verify_checkpoint(ref.url)
            if not result.ok:
                failed.append(f"{rel}: {[p.message for p in result.problems]}")
    return failed


def _check(template: str, src: str, dst: str, keep_local: bool) -> str:
    """After a killed sync: what DST lists and whether it verifies, then the next sync and the same again."""
    wanted = {rel for rel, ref in _states(template).items() if ref.state == CheckpointState.COMPLETE}
    after_kill, local = _states(dst), _states(src)
    done: set[str] = set()
    row: dict[str, Any] = {
        "states": {rel: ref.state.value for rel, ref in sorted(after_kill.items())},
        "local": sorted(rel for rel, ref in local.items() if ref.state == CheckpointState.COMPLETE),
        "failed_verify": _unverified(after_kill, done),
        "latest_not_whole": sorted(
            rel for rel, ref in after_kill.items() if ref.latest and ref.state != CheckpointState.COMPLETE
        ),
        # What the killed sync deleted locally (or left half-deleted) must be whole at DST.
        "gone_locally_not_whole": sorted(
            rel
            for rel in wanted
            if getattr(local.get(rel), "state", None) != CheckpointState.COMPLETE
            and getattr(after_kill.get(rel), "state", None) != CheckpointState.COMPLETE
        ),
    }
    _sync_once(src, dst, keep_local)
    after_next = _states(dst)
    row["after_next_sync"] = {rel: ref.state.value for rel, ref in sorted(after_next.items())}
    row["after_next_failed_verify"] = _unverified(after_next, done)
    row["local_after_next_sync"] = sorted(
        rel for rel, ref in _states(src).items() if ref.state == CheckpointState.COMPLETE
    )
    io.delete_tree(dst)  # the server keeps objects in memory
    return json.dumps(row)


def main(template: str, work: str, dst: str, seed: int, trials: int) -> None:
    # Imported here once rather than in each child: the store's client and the layouts the scan finds (a local
    # scan starts no thread that outlives it).
    import botocore.loaders
    import botocore.session
    import s3fs  # noqa: F401

    from ckptctl.io import s3

    _states(template)
    # botocore's data, parsed once here rather than in each child (most of making a client, a tenth of a second
    # of CPU): ckptctl's client made (not used: no connection, no thread), and one loader for every other
    # botocore session, which s3fs makes in each child (for listings), filled by making a client with it.
    s3._client()
    botocore.session.create_loader = functools.lru_cache(maxsize=None)(botocore.loaders.create_loader)
    botocore.session.Session().create_client("s3")
    calls = {}
    for keep_local in (False, True):
        src = str(shutil.copytree(template, Path(work) / f"count-{keep_local}"))
        calls[keep_local] = int(
            _forked(functools.partial(_killed_sync, src, f"{dst}/count-{keep_local}", keep_local))[1]
        )
    print(json.dumps({"calls": {str(k): v for k, v in calls.items()}}), flush=True)
    draw = random.Random(seed)
    for trial in range(trials):
        keep_local = trial % 2 == 1
        kill_at, before = draw.randint(1, calls[keep_local]), draw.random() < 0.5
        src, there = str(shutil.copytree(template, Path(work) / f"t{trial:02d}")), f"{dst}/t{trial:02d}"
        killed, _ = _forked(functools.partial(_killed_sync, src, there, keep_local, kill_at, before))
        _, checked = _forked(functools.partial(_check, template, src, there, keep_local))
        row = {"trial": trial, "keep_local": keep_local, "kill_at": kill_at, "before": before, "signal": killed}
        print(json.dumps({**row, **json.loads(checked)}), flush=True)
        shutil.rmtree(src)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
