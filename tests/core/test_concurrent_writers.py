"""Two writers in one run (issue 33): two managers saving disjoint steps, and a manager beside a `ckptctl
prune`/`slim`/`repair` holding the run's lock. `latest` never goes back from a complete newer step, a restore
loads the newest committed step, and the manager's retention never undoes what the lock's holder is doing.
"""

from __future__ import annotations

import os
import subprocess
import warnings
from pathlib import Path

import pytest

from ckptctl.core import CheckpointManager, CheckpointWarning, RetentionPolicy
from ckptctl.core.lock import RunLock
from ckptctl.formats.native import SUPERSEDED_NAME
from ckptctl.io import trash
from tests.core import _workers
from tests.core.util import REPO, worker_command, worker_env


def _steps(run: Path) -> list[str]:
    return sorted((p.name for p in run.glob("step-*")), key=lambda name: int(name.split("-")[1]))


def test_the_slower_writer_never_moves_latest_back_and_restore_loads_the_newest(tmp_path: Path) -> None:
    """Writer B (another process) is in the middle of saving step 19, its manifest written, when writer A (this
    process) commits step 20; then B commits. The order is forced (B waits on its stdin at the rename that
    commits), not timed. Before issue 33, B's commit took 20 for a step a rollback left behind: it marked it
    superseded and pointed `latest` at step-19, and `restore()` loaded 19."""
    run = tmp_path / "run"
    a = CheckpointManager(run, policy=RetentionPolicy(keep_last=3))
    b = subprocess.Popen(
        worker_command("second-writer", str(run)),
        cwd=REPO,
        env=worker_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert b.stdin is not None and b.stdout is not None

    def tell(line: str, until: str) -> None:
        assert b.stdin is not None and b.stdout is not None
        b.stdin.write(line + "\n")
        b.stdin.flush()
        heard = b.stdout.readline().strip()
        assert heard == until, heard

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # neither writer sees a rollback or a lock it cannot get
            a.save(16, _workers.small_state(16.0))
            tell("save 17", "saved 17")
            a.save(18, _workers.small_state(18.0))
            tell("hold 19", "at rename")
            a.save(20, _workers.small_state(20.0))
            assert (run / "latest").read_text() == "step-20\n"
            tell("go", "saved 19")
        b.stdin.close()
        assert b.wait(timeout=120) == 0, b.stderr.read() if b.stderr else ""
        assert b.stderr is not None and "superseded" not in b.stderr.read()
    finally:
        b.kill()
        b.wait()
    a.close()

    assert (run / "latest").read_text() == "step-20\n"
    assert _steps(run) == ["step-18", "step-19", "step-20"]  # B's retention (keep_last 3) counted A's steps
    assert not list(run.glob(f"step-*/{SUPERSEDED_NAME}"))
    state = _workers.small_state(-1.0)
    fresh = CheckpointManager(run)
    assert fresh.latest_step() == 20
    assert fresh.restore(state) == 20 and state["counter"] == {"step": 20.0}


def test_retention_waits_for_the_run_lock_and_leaves_a_slims_workspace(tmp_path: Path) -> None:
    """While another process holds the run's lock (here as `ckptctl slim` holds it, building the slim version of
    step-1 in the trash), a save still commits, but `latest`, retention and the trash wait for the next save,
    with warnings. Before issue 33 the retention deleted step-1 under the slim and emptied its workspace."""
    run = tmp_path / "run"
    manager = CheckpointManager(run, policy=RetentionPolicy(keep_last=1), lock_wait=0)
    manager.save(1, _workers.small_state(1.0))
    with RunLock(str(run), command="ckptctl slim (keep_full=1)"):
        workspace = Path(trash.workspace(trash.trash_of(str(run / "step-1")), "step-1"))
        (workspace / "model.safetensors").write_bytes(b"slim being built")
        with pytest.warns(CheckpointWarning) as said:
            manager.save(2, _workers.small_state(2.0))
        manager.wait()
        messages = [str(w.message) for w in said]
        assert len(messages) == 2 and "ckptctl slim (keep_full=1)" in messages[0], messages
        assert messages[0].startswith("step-2 is committed, but latest was not updated: ")
        assert messages[1].startswith(f"retention in {run} failed: ")
        assert _steps(run) == ["step-1", "step-2"] and (run / "latest").read_text() == "step-1\n"
        assert (workspace / "model.safetensors").read_bytes() == b"slim being built"
        assert manager.latest_step() == 2  # a restore walks the committed folders, whatever `latest` says
        os.unlink(workspace / "model.safetensors")  # the slim is done (here: given up)
        os.rmdir(workspace)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manager.save(3, _workers.small_state(3.0))
        manager.close()
    assert _steps(run) == ["step-3"] and (run / "latest").read_text() == "step-3\n"
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step-3"]
