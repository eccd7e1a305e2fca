"""One pruner per run, and pruning while a training process saves: the lock, stale locks, a live writer."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptctl.core import CheckpointManager, RetentionPolicy
from ckptctl.core.lock import LOCK_NAME, RunLock, RunLocked
from ckptctl.ops.prune import prune
from ckptctl.ops.verification import verify_checkpoint
from tests.conftest import CliResult
from tests.ops._saving_writer import save_until_stopped
from tests.ops.test_prune import NO_GRACE, write_run
from tests.writers.ranks import run_ranks

Cli = Callable[..., CliResult]
REPO = Path(__file__).resolve().parents[2]


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def write_lock(folder: Path, **fields: object) -> Path:
    doc = {"host": socket.gethostname(), "pid": os.getpid(), "token": "theirs", "started": "2026-01-01T00:00:00"}
    path = folder / LOCK_NAME
    path.write_text(json.dumps({**doc, **fields}))
    return path


# ------------------------------------------------------------------------------------------ the lock


def test_the_lock_is_exclusive_and_released(tmp_path: Path) -> None:
    with RunLock(str(tmp_path)) as held:
        info = json.loads((tmp_path / LOCK_NAME).read_text())
        assert (info["host"], info["pid"]) == (socket.gethostname(), os.getpid())
        with pytest.raises(RunLocked, match=f"locked by pid {os.getpid()}"):
            RunLock(str(tmp_path), wait=0.2).acquire()
        held.refresh()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_waiting_lock_gets_it_when_released(tmp_path: Path) -> None:
    first = RunLock(str(tmp_path))
    first.acquire()
    threading.Timer(0.3, first.release).start()
    started = time.monotonic()
    with RunLock(str(tmp_path), wait=10):
        assert time.monotonic() - started >= 0.25


def test_stale_locks_are_taken_over_with_a_warning(tmp_path: Path) -> None:
    warnings: list[str] = []
    write_lock(tmp_path, pid=dead_pid())
    with RunLock(str(tmp_path), warn=warnings.append):
        pass
    assert len(warnings) == 1 and "is gone" in warnings[0]

    old = write_lock(tmp_path, host="another-host")  # alive for all we know, but silent for two hours
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    with RunLock(str(tmp_path), warn=warnings.append):
        pass
    assert "nobody has refreshed it for 2:00:00" in warnings[1]

    write_lock(tmp_path, pid=os.getpid(), pid_start="1")  # our pid, but another process (pid reuse)
    with RunLock(str(tmp_path), warn=warnings.append):
        pass
    assert len(warnings) == 3


def test_a_lock_refreshed_on_a_timer_is_stale_after_missed_refreshes_not_an_hour(tmp_path: Path) -> None:
    # A trainer killed while its mirror held a DST lock: another host takes it over after ten missed refreshes
    # of a minute, not after an hour; a lock that promises no refresh interval still waits the hour.
    warnings: list[str] = []
    timed = write_lock(tmp_path, host="another-host", refresh_every=60)
    os.utime(timed, (time.time() - 300, time.time() - 300))  # five missed refreshes: maybe a slow store
    with pytest.raises(RunLocked):
        RunLock(str(tmp_path), wait=0).acquire()
    os.utime(timed, (time.time() - 660, time.time() - 660))
    with RunLock(str(tmp_path), warn=warnings.append):
        pass
    assert len(warnings) == 1 and "nobody has refreshed it for 0:11:00" in warnings[0]

    silent = write_lock(tmp_path, host="another-host")
    os.utime(silent, (time.time() - 660, time.time() - 660))
    with pytest.raises(RunLocked):
        RunLock(str(tmp_path), wait=0).acquire()

    short = write_lock(tmp_path, host="another-host", refresh_every=1)  # no sooner than clocks may differ
    os.utime(short, (time.time() - 120, time.time() - 120))
    with pytest.raises(RunLocked):
        RunLock(str(tmp_path), wait=0).acquire()


def test_a_holder_that_was_taken_over_notices(tmp_path: Path) -> None:
    lock = RunLock(str(tmp_path))
    lock.acquire()
    write_lock(tmp_path, token="new-holder")
    with pytest.raises(RunLocked, match="lost the lock"):
        lock.refresh()
    lock.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == "new-holder"  # not ours to remove


def test_a_half_written_lock_counts_as_held(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text("")
    with pytest.raises(RunLocked):
        RunLock(str(tmp_path), wait=0).acquire()


def test_prune_exits_cleanly_when_another_prune_holds_the_run(run_cli: Cli, tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    with RunLock(str(run)):
        result = run_cli("prune", run, "--keep-last", "1", "--grace", "0", "-y", "--wait", "0")
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: {run} is locked by pid {os.getpid()}")
    assert len(list(run.glob("step-*"))) == 6


def test_two_prunes_started_at_once(tmp_path: Path) -> None:
    """Both wait for the lock the test holds; when it is released, one prunes and the other finds nothing
    left to do. With --wait 0 they both exit 1 without touching anything."""
    run = write_run(tmp_path / "run", [*range(1, 21)])
    argv = [sys.executable, "-m", "ckptctl", "prune", str(run), "--keep-last", "2", "--grace", "0", "-y", "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with RunLock(str(run)):
        refused = [
            subprocess.Popen([*argv, "--wait", "0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        outcomes = [(p.wait(60), p.stderr.read() if p.stderr else "") for p in refused]
        assert all(code == 1 and "is locked by" in err for code, err in outcomes), outcomes
        assert len(list(run.glob("step-*"))) == 20
        waiting = [
            subprocess.Popen(
                [*argv, "--wait", "30"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        time.sleep(1.0)
    results = [p.communicate(timeout=60) for p in waiting]
    assert [p.returncode for p in waiting] == [0, 0], results
    deleted = [[d["step"] for d in json.loads(out)["delete"]] for out, _ in results]
    assert sorted(deleted, key=len) == [[], list(range(1, 19))]
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step-19", "step-20"]


# ------------------------------------------------------------------------------------------ a live writer


@pytest.mark.slow
def test_pruning_while_a_writer_saves(run_cli: Cli, tmp_path: Path) -> None:
    run, stop = tmp_path / "run", tmp_path / "stop"
    out, err = tmp_path / "writer.out", tmp_path / "writer.err"
    # The training process: a process of its own (tests/ops/_saving_writer.py), saving until `stop` exists.
    writer = run_ranks(save_until_stopped, (str(run), str(stop), 60.0, str(out), str(err)), 1, join=False)
    process = writer.processes[0]
    while not (out.exists() and out.read_text()) and process.is_alive():
        time.sleep(0.05)
    assert out.read_text().split()[:1] == ["1"], err.read_text()
    deleted: list[tuple[str, str]] = []
    prunes = 0
    # Prune while the writer saves, until enough has happened rather than for a fixed time: 7 deletions with 2
    # steps kept mean the writer committed at least 9 saves meanwhile. (It stops by itself after 60 s.)
    while not (prunes > 10 and len(deleted) > 6) and process.is_alive():
        result = run_cli("prune", run, "--keep-last", "2", "-y", "--grace", "0", "--json")
        assert result.exit_code == 0, result
        doc = result.json
        deleted += [(d["url"], d["state"]) for d in doc["delete"]]
        assert not doc["skipped"] or all(not s["error"] for s in doc["skipped"]), doc["skipped"]
        prunes += 1
        time.sleep(0.05)
    stop.touch()
    process.join(60)
    assert process.exitcode == 0, err.read_text()  # every save committed: nothing in progress was touched
    last = int(out.read_text().split()[-1])
    assert last > 8 and prunes > 10 and len(deleted) > 5
    assert all(state == "complete" and os.path.basename(url).startswith("step-") for url, state in deleted)

    final = run_cli("prune", run, "--keep-last", "2", "-y", "--grace", "0", "--json")
    assert final.exit_code == 0, final
    assert sorted(p.name for p in run.iterdir()) == sorted(["latest", f"step-{last - 1}", f"step-{last}"])
    for step in (last - 1, last):
        assert verify_checkpoint(str(run / f"step-{step}")).ok
    assert CheckpointManager(run).latest_step() == last


def test_prune_and_the_managers_retention_share_the_trash(tmp_path: Path) -> None:
    run = tmp_path / "run"
    manager = CheckpointManager(run, policy=RetentionPolicy(keep_last=3))
    write_run(run, [1, 2, 3, 4])
    assert manager.all_steps() == [1, 2, 3, 4]  # the writer above kept everything
    report = prune(str(run), RetentionPolicy(keep_last=2), grace=NO_GRACE)
    assert [d.ref.step for d in report.deleted] == [1, 2]
    import torch

    manager.save(5, {"w": torch.zeros(2)})
    assert manager.all_steps() == [3, 4, 5]
