"""A save that is killed leaves its staging folder behind: the run's next save deletes it, `list` labels it
`abandoned`, `prune` deletes it; a staging folder whose writer is still running stays through all three.

The saves are real ones, stopped mid-write in child processes and SIGKILLed (`interrupted_saves`), or
killed at random moments and at the moments when a staging folder holds no writer's record
(`_workers.kill_saves`); the next save runs in a fresh process, as a restarted job's would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl.core import CheckpointManager, RetentionPolicy
from ckptctl.formats.native import WRITER_NAME, abandoned_staging, staging_token
from ckptctl.ops.prune import plan_prune
from tests.conftest import CliResult
from tests.core import _workers
from tests.core.conftest import InterruptedSaves
from tests.core.util import run_worker


def staging_folders(run: Path) -> dict[int, Path]:
    found = {int(p.name.split(".")[1].removeprefix("step-")): p for p in run.glob(".step-*.staging-*")}
    assert all(p.is_dir() for p in found.values())
    return found


def staging_names(run: Path) -> list[str]:
    return sorted(p.name for p in run.glob(".step-*.staging-*"))


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


#: Moments of a save at which its staging folder holds no record of its writer (the record is not in
#: place yet, or the commit removed it), or holds the step a re-save swapped out (`exchanged`).
UNRECORDED = ("mkdir", "record", "unrecorded", "rename", "exchanged")
#: What a run folder may hold after a save that followed killed ones: committed steps, the pointer, and a
#: temporary file of the pointer or of the run's lock that a kill left before its rename or link (a few bytes,
#: never read; never a lock: an empty lock left by a kill held the next save off for an hour).
NAMES = re.compile(r"step-\d+|latest|\.latest\.tmp-\d+-\d+|\.ckptctl-prune\.lock\.tmp-\d+-[0-9a-f]+")


def test_random_sigkills_of_sync_and_async_saves_leave_nothing_after_the_next_save_or_prune(
    tmp_path: Path, run_cli: Any
) -> None:
    """50 save loops (sync and async) SIGKILLed at random moments, and a save killed at each `UNRECORDED`
    moment: every staging folder they leave lists as `abandoned` (its writer is dead) and is gone after the
    run's next save, and, in a copy of the runs, after `prune --grace 0s`."""
    runs = [[str(tmp_path / "runs" / f"random-{i}"), i % 2 == 1, None] for i in range(50)]
    runs += [[str(tmp_path / "runs" / point), i % 2 == 1, point] for i, point in enumerate(UNRECORDED)]
    (tmp_path / "kills.json").write_text(json.dumps({"seed": 21, "runs": runs}))
    reports = [json.loads(line) for line in run_worker("kill-saves", str(tmp_path / "kills.json")).stdout.splitlines()]
    assert len(reports) == len(runs) and all(r["killed"] for r in reports), reports
    pruned = tmp_path / "pruned"
    shutil.copytree(tmp_path / "runs", pruned, copy_function=os.link)  # the same files, dates and records

    listed = run_cli("list", pruned, "--json")  # every run at once: they are folders of one tree
    assert listed.exit_code == 0, listed.stderr
    states = {c["url"]: c["state"] for c in listed.json["checkpoints"] if os.path.basename(c["url"]).startswith(".")}
    assert states == dict.fromkeys(states, "abandoned"), {k: v for k, v in states.items() if v != "abandoned"}
    left = {run.name: staging_names(run) for run in pruned.iterdir()}
    assert sorted(states) == sorted(str(pruned / run / name) for run, names in left.items() for name in names)
    assert all(len(left[point]) == 1 for point in UNRECORDED), left
    assert sum(map(len, left.values())) > len(UNRECORDED)  # the random kills left staging folders too

    state = _workers.small_state(1000.0)
    for root, _, _ in runs:  # as a restarted job would, in a process that is none of the killed writers
        manager = CheckpointManager(root)
        manager.save(1000, state)
        manager.close()
        assert staging_names(Path(root)) == [], f"{root}: the next save left {staging_names(Path(root))}"
        assert all(NAMES.fullmatch(name) for name in os.listdir(root)), sorted(os.listdir(root))
        assert manager.latest_step() == 1000

    # Rules that keep every checkpoint: what goes is what no rule keeps, the abandoned saves.
    done = run_cli("prune", pruned, "-y", "--keep-last", "1000", "--grace", "0s", "--json")
    assert done.exit_code == 0, done.stderr
    assert sorted(d["url"] for d in done.json["delete"]) == sorted(states)
    assert all(staging_names(run) == [] for run in pruned.iterdir())


def test_an_older_versions_staging_folder_holding_only_a_temporary_record_is_judged_by_it(
    tmp_path: Path, run_cli: Any
) -> None:
    """Older versions named staging folders at random and wrote the record after making the folder: a kill
    before the record's rename left a folder holding only its temporary file (here a week old, above every
    committed step, of a writer that is dead). `list` calls it abandoned, `prune --grace 0s` deletes it, and
    so does the next save."""
    killed = tmp_path / "killed"
    (tmp_path / "kill.json").write_text(json.dumps({"seed": 1, "runs": [[str(killed), False, "record"]]}))
    run_worker("kill-saves", str(tmp_path / "kill.json"))
    (left,) = staging_folders(killed).values()
    old = left.rename(killed / ".step-3.staging-0a1b2c3d")  # an older version's name: random, nothing more
    (temporary,) = old.iterdir()
    assert temporary.name.startswith(f".{WRITER_NAME}.tmp-")
    week_ago = time.time() - 7 * 86400
    for path in (temporary, old):
        os.utime(path, (week_ago, week_ago))
    copy = tmp_path / "copy"
    shutil.copytree(killed, copy, symlinks=True)

    listed = by_name(run_cli("list", killed, "--json").json)[old.name]
    assert listed["state"] == "abandoned" and "is gone" in listed["note"], listed
    done = run_cli("prune", killed, "-y", "--keep-last", "1", "--grace", "0s", "--json")
    assert done.exit_code == 0, done.stderr
    assert sorted(os.path.basename(d["url"]) for d in done.json["delete"]) == [old.name, "step-1"]
    assert staging_folders(killed) == {}

    manager = CheckpointManager(copy)
    manager.save(4, _workers.small_state(4.0))
    manager.close()
    assert staging_folders(copy) == {} and manager.all_steps() == [1, 2, 4]


def test_a_staging_folder_without_a_record_is_judged_by_the_writer_its_name_carries(
    run_dir: Path, run_cli: Any
) -> None:
    """A staging folder whose name carries a live writer of this machine (this process) stays in progress
    whatever its age and the steps committed after it; one whose name carries another machine is judged by
    age and newer commits, as another machine's record is."""
    manager = CheckpointManager(run_dir)
    manager.save(10, {"w": torch.zeros(2)})
    live = run_dir / f".step-20.staging-{staging_token()}"
    elsewhere = run_dir / f".step-20.staging-{staging_token()[:-12]}{'0' * 12}"  # another machine's tag
    day_ago = time.time() - 86400
    for folder in (live, elsewhere):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 64)
        for path in (folder / "model.safetensors", folder):
            os.utime(path, (day_ago, day_ago))
    manager.save(30, {"w": torch.ones(2)})  # committed after both, a day after their last write
    manager.close()
    assert staging_names(run_dir) == [live.name]  # the other machine's went

    elsewhere.mkdir()  # written just now: within any grace, and after step-30's commit
    (elsewhere / "model.safetensors").write_bytes(b"\0" * 64)
    states = {name: c["state"] for name, c in by_name(run_cli("list", run_dir, "--json").json).items()}
    assert states[live.name] == "in_progress" and states[elsewhere.name] == "in_progress"
    done = run_cli("prune", run_dir, "-y", "--keep-last", "1", "--grace", "0s", "--json")
    assert done.exit_code == 0, done.stderr
    assert [os.path.basename(d["url"]) for d in done.json["delete"]] == ["step-10"]
    assert staging_names(run_dir) == sorted([live.name, elsewhere.name])
