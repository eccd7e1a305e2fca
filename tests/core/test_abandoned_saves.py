"""A save that is killed leaves its staging folder behind: the run's next save deletes it, `list` labels it
`abandoned`, `prune` deletes it; a staging folder whose writer is still running stays through all three.

The saves are real ones, stopped mid-write in child processes and SIGKILLed (`interrupted_saves`); the next
save runs in a fresh process, as a restarted job's would.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl.core import CheckpointManager, RetentionPolicy
from ckptctl.formats.native import WRITER_NAME, abandoned_staging
from ckptctl.ops.prune import plan_prune
from tests.conftest import CliResult
from tests.core import _workers
from tests.core.conftest import InterruptedSaves


def staging_folders(run: Path) -> dict[int, Path]:
    found = {int(p.name.split(".")[1].removeprefix("step-")): p for p in run.glob(".step-*.staging-*")}
    assert all(p.is_dir() for p in found.values())
    return found


def by_name(doc: dict[str, Any], key: str = "checkpoints") -> dict[str, dict[str, Any]]:
    return {os.path.basename(c["url"]): c for c in doc[key]}


def test_the_next_save_in_a_fresh_process_removes_a_killed_saves_staging_folder(
    interrupted_saves: InterruptedSaves,
) -> None:
    run, writer = interrupted_saves.resaved, interrupted_saves.killed_writer
    assert writer["host"] == socket.gethostname() and writer["pid"] > 0  # who was writing: a process gone now
    assert interrupted_saves.fresh[0] == {"saved": 30}
    assert sorted(os.listdir(run)) == ["latest", "step-10", "step-20", "step-30"]  # trash emptied too
    assert not (run / "step-30" / WRITER_NAME).exists()  # a committed folder holds what its manifest lists
    state = _workers.small_state(-1.0)
    assert CheckpointManager(run).restore(state) == 30 and state["counter"] == {"step": 30.0}


def test_list_labels_prune_deletes_and_saves_remove_abandoned_staging_but_never_a_live_writers(
    interrupted_saves: InterruptedSaves, run_cli: Any
) -> None:
    run = interrupted_saves.pruned
    stagings = staging_folders(run)
    abandoned, live = stagings[30].name, stagings[5].name

    listed = run_cli("list", run, "--json")
    assert listed.exit_code == 0
    states = {name: (c["state"], c["step"]) for name, c in by_name(listed.json).items()}
    assert states == {
        "step-10": ("complete", 10),
        "step-20": ("complete", 20),
        abandoned: ("abandoned", 30),
        live: ("in_progress", 5),  # a day old and behind step-20, but its writer is running
    }
    human = run_cli("list", run, "--state", "abandoned")
    assert human.exit_code == 0 and abandoned in human.stdout and "is gone" in human.stdout and live not in human.stdout

    dry = run_cli("prune", run, "--keep-last", "5", "--grace", "0s", "--dry-run", "--json")
    assert dry.exit_code == 0, dry.stderr
    (deleted,) = dry.json["delete"]
    assert os.path.basename(deleted["url"]) == abandoned and deleted["state"] == "abandoned"
    assert deleted["reasons"][0].startswith("an interrupted save: its writer (pid ")
    kept = by_name(dry.json, "keep")
    assert kept[live]["state"] == "in_progress" and kept[live]["reasons"][0].startswith("in progress")
    assert set(staging_folders(run)) == {5, 30}  # a dry run changes nothing

    done: CliResult = run_cli("prune", run, "--keep-last", "5", "--grace", "0s", "--yes", "--json")
    assert done.exit_code == 0, done.stderr
    assert [os.path.basename(d["url"]) for d in done.json["delete"]] == [abandoned]
    assert set(staging_folders(run)) == {5}
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["latest", "step-10", "step-20"]

    manager = CheckpointManager(run)
    manager.save(40, _workers.small_state(40.0))
    manager.close()
    assert set(staging_folders(run)) == {5}, "a save removed the staging folder of a writer that is running"

    os.kill(interrupted_saves.live_pid, signal.SIGKILL)  # the writer dies: its folder is abandoned now
    for _ in range(1000):  # SIGKILL takes effect at once; a loaded machine may take a moment to schedule it
        if not _running(interrupted_saves.live_pid):
            break
        time.sleep(0.01)
    assert by_name(run_cli("list", run, "--json").json)[live]["state"] == "abandoned"
    manager.save(50, _workers.small_state(50.0))
    manager.close()
    assert staging_folders(run) == {} and manager.all_steps() == [10, 20, 40, 50]


def _running(pid: int) -> bool:
    """Whether `pid` still runs (not our child: once killed it is reaped by whoever adopted it, or stays a
    zombie, which counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _other_writer(staging: Path, **fields: Any) -> None:
    """A writer record naming a process this machine cannot check (another host, or another pid namespace)."""
    record = {"host": "another-node", "pid": os.getpid(), "started": "2026-01-01T00:00:00+00:00", **fields}
    staging.mkdir(parents=True)
    (staging / WRITER_NAME).write_text(json.dumps(record))
    (staging / "model.safetensors").write_bytes(b"\0" * 64)


@pytest.mark.parametrize(
    "fields",
    [{}, {"host": socket.gethostname(), "pid_namespace": "pid:[1]"}],
    ids=["another host", "another pid namespace"],
)
def test_a_writer_that_cannot_be_checked_is_judged_by_age_and_newer_commits(
    run_dir: Path, fields: dict[str, Any]
) -> None:
    manager = CheckpointManager(run_dir)
    manager.save(10, {"w": torch.zeros(2)})
    staging = run_dir / ".step-20.staging-0a1b"
    _other_writer(staging, **fields)  # our own pid: alive here, yet it proves nothing about that writer
    later = time.time() + 7200
    assert abandoned_staging(str(staging), timedelta(0), now=later) is None  # nothing committed after it

    written = time.time() - 50 * 60
    for path in (staging / "model.safetensors", staging / WRITER_NAME, staging):
        os.utime(path, (written, written))
    assert abandoned_staging(str(staging), timedelta(minutes=30)) is None  # old, but no step committed after it
    manager.save(20, {"w": torch.ones(2)})  # the run went on; the manager's own grace (1h) keeps it for now
    assert staging.is_dir()
    why = abandoned_staging(str(staging), timedelta(minutes=30))
    assert why is not None and "cannot be checked from here" in why and "step-20 was committed after" in why
    assert abandoned_staging(str(staging), timedelta(hours=2)) is None  # within grace

    lenient = plan_prune(str(run_dir), RetentionPolicy(keep_last=5), grace=timedelta(hours=2))
    strict = plan_prune(str(run_dir), RetentionPolicy(keep_last=5), grace=timedelta(minutes=30))
    assert [i.ref.state.value for i in lenient.items if i.url == str(staging)] == ["in_progress"]
    (doomed,) = strict.delete
    assert doomed.url == str(staging) and doomed.ref.state.value == "abandoned"
