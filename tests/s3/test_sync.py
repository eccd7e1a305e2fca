"""`sync` between a local run and the local S3 server, both ways: real writers' runs arrive whole (every
checkpoint listed complete at DST verifies there), a second sync reads nothing again, what is not complete at
SRC stays behind with why, pointers only ever name what is whole at DST, a killed sync leaves nothing torn
that lists as complete, and `--keep-local` deletes only what is whole at DST."""

from __future__ import annotations

import json
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptctl import io
from ckptctl.core import mirror as mirror_module
from ckptctl.core.lock import RunLock
from ckptctl.errors import StorageError
from ckptctl.ops.sync import SYNC_LOCK, watch
from tests.conftest import CliResult
from tests.s3._upload_kill import killed_after_uploads

Cli = Callable[..., CliResult]


def sync_json(run_cli: Cli, *args: str | Path, code: int = 0) -> Any:
    result = run_cli("sync", *args, "--json")
    assert result.exit_code == code, result.stderr
    assert "Traceback" not in result.stderr
    return result.json


def actions(doc: Any) -> dict[str, tuple[str, str | None]]:
    return {Path(c["url"]).name: (c["action"], c["reason"]) for c in doc["checkpoints"]}


def listed(run_cli: Cli, url: str | Path) -> dict[str, str]:
    result = run_cli("list", url, "--json")
    assert result.exit_code == 0, result.stderr
    return {io.relative_to(c["url"], str(url)): c["state"] for c in result.json["checkpoints"]}


def assert_whole_at(run_cli: Cli, src: Path, dst: str) -> None:
    """DST lists what SRC lists as complete, complete, and verifies (digests included)."""
    want = {rel: state for rel, state in listed(run_cli, src).items() if state == "complete"}
    got = listed(run_cli, dst)
    assert {rel: got.get(rel) for rel in want} == want
    verified = run_cli("verify", dst, "--json")
    assert verified.exit_code == 0, verified.stdout


def test_a_demo_run_goes_up_whole_and_a_second_sync_reads_nothing(
    run_cli: Cli, demo_dir: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = f"{bucket}/demo"
    doc = sync_json(run_cli, demo_dir, dst)
    assert doc["schema_version"] == 1 and doc["src"] == str(demo_dir) and doc["dst"] == dst
    assert {action for action, _ in actions(doc).values()} == {"copied"}
    assert all(c["bytes"] > 0 and c["seconds"] >= 0 for c in doc["checkpoints"])
    assert {f["path"] for f in doc["run_files"]} >= {"native/latest", "distributed/latest"}
    assert_whole_at(run_cli, demo_dir, dst)

    def no_reads(*args: object) -> None:
        raise AssertionError(f"read again: {args}")

    monkeypatch.setattr(mirror_module, "file_digest", no_reads)
    monkeypatch.setattr(io, "upload_file", no_reads)
    again = sync_json(run_cli, demo_dir, dst)
    assert {v for v in actions(again).values()} == {("skipped", "already whole at DST")}
    assert again["run_files"] == [] and again["bytes"] == 0


def test_what_is_not_complete_stays_behind_and_the_pointer_waits(
    run_cli: Cli, demo_dir: Path, bucket: str, tmp_path: Path
) -> None:
    run = shutil.copytree(demo_dir / "native", tmp_path / "native")
    # The save `latest` names lost its manifest (the native writer renames a save into place with it, so this is
    # broken rather than in progress), and an old one lost a file.
    (run / "step-30" / "ckptctl-manifest.json").unlink()
    (run / "step-10" / "model.safetensors").unlink()
    dst = f"{bucket}/native"
    doc = sync_json(run_cli, run, dst, code=1)
    got = actions(doc)
    assert got["step-20"] == ("copied", None)
    for name in ("step-10", "step-30"):
        assert got[name][0] == "skipped" and got[name][1].startswith("broken at SRC")
    assert {Path(c["url"]).name for c in doc["checkpoints"] if c["problem"]} == {"step-10", "step-30"}
    held = {f["path"]: f for f in doc["run_files"]}
    assert held["latest"]["action"] == "skipped" and "step-30" in held["latest"]["reason"]
    assert not io.exists(f"{dst}/latest") and listed(run_cli, dst) == {"step-20": "complete"}

    shutil.copy(demo_dir / "native" / "step-30" / "ckptctl-manifest.json", run / "step-30")
    doc = sync_json(run_cli, run, dst, code=1)
    assert actions(doc)["step-30"] == ("copied", None)
    assert io.read_bytes(f"{dst}/latest") == (run / "latest").read_bytes()


def test_a_sync_killed_mid_upload_leaves_nothing_torn_complete_and_the_next_finishes(
    run_cli: Cli, demo_dir: Path, bucket: str
) -> None:
    """The DCP run's steps are 3 files each (2 shards, then `.metadata`): killed after 5 uploads, step-20 has
    its shards and no `.metadata`."""
    dst = f"{bucket}/killed"
    killed_after_uploads("tests.s3._sync_kill_worker", str(demo_dir / "dcp"), dst, 5)
    states = listed(run_cli, dst)
    assert states.get("step-20") != "complete" and "step-30" not in states
    complete = [rel for rel, state in states.items() if state == "complete"]
    for rel in complete:
        assert run_cli("verify", f"{dst}/{rel}").exit_code == 0
    doc = sync_json(run_cli, demo_dir / "dcp", dst)
    assert actions(doc)["step-20"] == ("copied", None)
    assert_whole_at(run_cli, demo_dir / "dcp", dst)


def test_latest_pulls_what_a_resume_loads_and_the_manager_restores_it(
    run_cli: Cli, demo_dir: Path, bucket: str, tmp_path: Path
) -> None:
    from ckptctl.core import CheckpointManager

    remote = f"{bucket}/up"
    sync_json(run_cli, demo_dir / "native", remote)
    local = tmp_path / "fresh"
    doc = sync_json(run_cli, remote, local, "--latest")
    assert {name: action for name, (action, _) in actions(doc).items()} == {
        "step-10": "skipped",
        "step-20": "skipped",
        "step-30": "copied",
    }
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == ["latest", "step-30"]
    assert CheckpointManager(str(local)).latest_step() == 30  # the manager's own latest-finder
    assert run_cli("verify", local, "--latest").exit_code == 0
    same = run_cli("diff", local / "step-30", demo_dir / "native" / "step-30", "--json")
    assert same.exit_code == 0 and same.json["equal"] is True


def test_real_writers_runs_go_up_whole_and_come_back_for_their_latest_finders(
    run_cli: Cli, trainer_run: Any, deepspeed_runs: Any, bucket: str, tmp_path: Path
) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    trainer, ds = trainer_run.saved_run, deepspeed_runs[2].save_dir
    for name, run in (("trainer", trainer), ("deepspeed", ds)):
        sync_json(run_cli, run, f"{bucket}/{name}")
        assert_whole_at(run_cli, run, f"{bucket}/{name}")
    back = tmp_path / "trainer"
    sync_json(run_cli, f"{bucket}/trainer", back)
    assert Path(get_last_checkpoint(str(back))).name == Path(get_last_checkpoint(str(trainer))).name
    ds_back = tmp_path / "ds"
    sync_json(run_cli, f"{bucket}/deepspeed", ds_back, "--latest")
    # DeepSpeed's load_checkpoint reads the tag its `latest` file names (deepspeed/runtime/engine.py:
    # DeepSpeedEngine.load_checkpoint, `tag is None` branch): the pulled copy names the same, present tag.
    tag = (ds_back / "latest").read_text().strip()
    assert tag == (ds / "latest").read_text().strip() and (ds_back / tag).is_dir()


def test_watch_copies_a_checkpoint_once_it_is_complete(demo_dir: Path, bucket: str, tmp_path: Path) -> None:
    run = shutil.copytree(demo_dir / "native", tmp_path / "native")
    manifest = run / "step-30" / "ckptctl-manifest.json"
    saved = manifest.read_bytes()
    manifest.unlink()
    dst = f"{bucket}/watched"
    seen = []
    for report in watch(str(run), dst, interval=0, passes=3):
        seen.append({Path(i.url).name: i.action.value for i in report.checkpoints})
        if len(seen) == 1:
            manifest.write_bytes(saved)  # the writer commits between two passes
    assert [s["step-30"] for s in seen] == ["skipped", "copied", "skipped"]
    assert [s["step-20"] for s in seen] == ["copied", "skipped", "skipped"]


def test_keep_local_deletes_only_what_is_whole_at_dst(
    run_cli: Cli, demo_dir: Path, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = shutil.copytree(demo_dir / "native", tmp_path / "native")
    dst = f"{bucket}/kept"
    real_upload = io.upload_file

    def the_store_dies_at_step_20(path: str, url: str) -> None:
        if "/step-20/" in url:
            raise StorageError(f"cannot access {url}: connection reset")
        real_upload(path, url)

    monkeypatch.setattr(io, "upload_file", the_store_dies_at_step_20)
    failed = run_cli("sync", run, dst, "--keep-local", "1", "--grace", "0s", "--json")
    assert failed.exit_code == 2 and "connection reset" in failed.stderr
    assert sorted(p.name for p in run.glob("step-*")) == ["step-10", "step-20", "step-30"]

    monkeypatch.setattr(io, "upload_file", real_upload)
    doc = sync_json(run_cli, run, dst, "--keep-local", "1", "--grace", "0s")
    deleted = sorted(Path(c["url"]).name for c in doc["checkpoints"] if c["action"] == "deleted_local")
    assert deleted == ["step-10", "step-20"]
    assert sorted(p.name for p in run.glob("step-*")) == ["step-30"]
    assert listed(run_cli, dst) == {f"step-{n}": "complete" for n in (10, 20, 30)}


def test_a_second_sync_into_the_same_dst_exits_2(run_cli: Cli, demo_dir: Path, bucket: str) -> None:
    dst = f"{bucket}/busy"
    with RunLock(dst, name=SYNC_LOCK):
        result = run_cli("sync", demo_dir / "native", dst, "--json")
    assert result.exit_code == 2 and result.json["error"]["exit_code"] == 2
    assert io.list_tree(dst).keys() <= {SYNC_LOCK}


def test_dry_run_writes_nothing(run_cli: Cli, demo_dir: Path, bucket: str) -> None:
    dst = f"{bucket}/dry"
    doc = sync_json(run_cli, demo_dir / "native", dst, "--dry-run")
    assert doc["dry_run"] is True and {a for a, _ in actions(doc).values()} == {"copied"}
    assert io.list_tree(dst) == {}


@pytest.mark.long
@pytest.mark.slow
def test_syncs_killed_at_random_points_leave_nothing_torn_complete(
    run_cli: Cli, demo_dir: Path, bucket: str, tmp_path: Path
) -> None:
    """20 syncs of a native and a DCP run (2 steps each), each SIGKILLed before or after a seeded random storage
    call with other uploads in flight (`tests/s3/_sync_kill_trials.py`, one process forking a child per trial;
    odd trials with `--keep-local 1`): what DST lists as complete verifies, `latest` there names a whole
    checkpoint, nothing gone locally is missing at DST, and the next sync completes every checkpoint."""
    import subprocess
    import sys

    from tests.core.util import REPO, worker_env

    template = tmp_path / "template"
    for name in ("native", "dcp"):
        for step in ("step-20", "step-30"):
            shutil.copytree(demo_dir / name / step, template / name / step)
    shutil.copy(demo_dir / "native" / "latest", template / "native" / "latest")
    (tmp_path / "work").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "tests.s3._sync_kill_trials", template, tmp_path / "work", f"{bucket}/kills", "0", "20"],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    header, *trials = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(trials) == 20 and all(n > 0 for n in header["calls"].values())
    whole = {f"{run}/step-{n}": "complete" for run in ("native", "dcp") for n in (20, 30)}
    for trial in trials:
        assert trial["signal"] == signal.SIGKILL, trial
        assert trial["failed_verify"] == [] and trial["latest_not_whole"] == [], trial
        assert trial["gone_locally_not_whole"] == [], trial
        assert trial["after_next_sync"] == whole and trial["after_next_failed_verify"] == [], trial
        # Retention keeps the newest of each run locally, whatever the kill left.
        assert {"native/step-30", "dcp/step-30"} <= set(trial["local_after_next_sync"]), trial
    # The kills landed mid-copy: some trials left a checkpoint at DST that lists as anything but complete.
    assert any(set(t["states"].values()) - {"complete"} for t in trials)
    assert any(len(t["local_after_next_sync"]) == 2 for t in trials if t["keep_local"])
    # `--keep-local 1` deleted nothing whose upload was killed (`gone_locally_not_whole` above), with some kills
    # landing before every checkpoint was whole at DST.
    assert any(list(t["states"].values()).count("complete") < len(whole) for t in trials if t["keep_local"])


@pytest.mark.slow
def test_watch_beside_a_writer_copies_each_step_once_and_stops_on_sigterm(
    run_cli: Cli, bucket: str, tmp_path: Path
) -> None:
    """`sync --watch` in a process of its own while a `CheckpointManager` saves a step every 2 seconds: each step
    is copied once (never while its save is in progress), and SIGTERM stops the watch with exit code 130."""
    import subprocess
    import sys
    import threading
    import time

    import torch

    from ckptctl.core import CheckpointManager
    from tests.core.util import REPO, worker_env

    run, dst = tmp_path / "run", f"{bucket}/watch"
    manager = CheckpointManager(run)
    model = torch.nn.Linear(16, 16)
    manager.save(1, {"model": model})  # a run folder to watch from the start

    def train() -> None:
        for step in (2, 3, 4):
            time.sleep(2)
            with torch.no_grad():
                model.weight.add_(1.0)
            manager.save(step, {"model": model})

    watcher = subprocess.Popen(
        [sys.executable, "-m", "ckptctl", "sync", str(run), dst, "--watch", "--interval", "0.5", "--json"],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    writer = threading.Thread(target=train)
    writer.start()
    try:
        writer.join()
        deadline = time.monotonic() + 120  # not a timing assertion: how long to wait for the last copy at most
        while not (io.exists(f"{dst}/latest") and io.read_bytes(f"{dst}/latest") == b"step-4\n"):
            assert watcher.poll() is None and time.monotonic() < deadline, watcher.stderr
            time.sleep(0.2)
        watcher.send_signal(signal.SIGTERM)
        out, err = watcher.communicate(timeout=60)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert watcher.returncode == 130, err
    assert "Traceback" not in err
    # One line per pass (JSON lines), then one more saying that the command was interrupted: every line a document.
    *passes, interrupted = [json.loads(line) for line in out.splitlines()]
    assert interrupted["error"]["exit_code"] == 130 and all("error" not in doc for doc in passes)
    copied = [Path(c["url"]).name for doc in passes for c in doc["checkpoints"] if c["action"] == "copied"]
    assert sorted(copied) == ["step-1", "step-2", "step-3", "step-4"]  # each once
    assert listed(run_cli, dst) == {f"step-{n}": "complete" for n in (1, 2, 3, 4)}
    assert run_cli("verify", dst).exit_code == 0


def test_a_stopped_pass_leaves_the_old_copies_it_did_not_reach_whole(
    run_cli: Cli, demo_dir: Path, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every checkpoint is out of date at DST, and the pass stops after its first upload: only the checkpoint it
    had begun to replace loses its markers there; the older copies of the others still list complete."""
    import os
    import threading
    import time

    from ckptctl.ops.sync import sync

    run = shutil.copytree(demo_dir / "native", tmp_path / "native")
    dst = f"{bucket}/stopped"
    sync_json(run_cli, run, dst)
    later = time.time() + 3600
    for path in run.rglob("*"):
        os.utime(path, (later, later))  # newer than every copy at DST: each is copied again
    stop = threading.Event()
    real_upload = io.upload_file

    def upload_then_stop(path: str, url: str) -> None:
        real_upload(path, url)
        stop.set()

    monkeypatch.setattr(io, "upload_file", upload_then_stop)
    with pytest.raises(mirror_module.SyncStopped):
        sync(str(run), dst, stop=stop, workers=1)
    assert listed(run_cli, dst) == {"step-10": "in_progress", "step-20": "complete", "step-30": "complete"}
    monkeypatch.setattr(io, "upload_file", real_upload)
    doc = sync_json(run_cli, run, dst)
    assert {name: action for name, (action, _) in actions(doc).items()} == dict.fromkeys(
        ("step-10", "step-20", "step-30"), "copied"
    )
    assert_whole_at(run_cli, run, dst)


def test_a_checkpoint_copy_that_failed_of_a_timeout_is_an_error_not_an_endless_wait() -> None:
    """A copy that raised a timeout of its own (an NFS soft mount's ETIMEDOUT is a TimeoutError) is its
    failure, raised, not taken for the wait for it timing out and waited on again."""
    import errno
    from concurrent.futures import Future

    from ckptctl.ops import sync as sync_module

    failed: Future[dict[str, Any]] = Future()
    failed.set_exception(TimeoutError(errno.ETIMEDOUT, "Connection timed out"))
    raised: list[BaseException] = []

    def wait_for_it() -> None:
        try:
            sync_module._result(failed, None)
        except BaseException as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait_for_it, daemon=True)  # a regression would wait forever: not here
    waiter.start()
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "still waiting on a copy that has failed"
    assert [type(e) for e in raised] == [TimeoutError]


def test_a_sync_that_waited_for_dst_stops_reading_src_ahead(
    demo_dir: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SRC is read ahead while DST's lock is taken; when the lock had to wait, what was read is thrown away
    and SRC read again: the reading ahead stops at its next folder rather than going on behind the sync."""
    from ckptctl.layouts import walk
    from ckptctl.ops.sync import sync

    real_identify = walk.identify_folder
    ahead: list[str] = []  # the folders the reading ahead started to identify
    returned = threading.Event()

    def identify(url: str, entries: Any) -> Any:
        if threading.current_thread().name == "ckptctl-read":
            ahead.append(url)
            assert returned.wait(60), "the sync never returned"
        return real_identify(url, entries)

    monkeypatch.setattr(walk, "identify_folder", identify)
    dst = f"{bucket}/waited"
    holder = RunLock(dst, name=SYNC_LOCK)
    holder.acquire()
    threading.Timer(1.5, holder.release).start()
    report = sync(str(demo_dir / "native"), dst, wait=60)
    assert {item.action.value for item in report.checkpoints} == {"copied"}
    started = len(ahead)
    returned.set()
    for thread in [t for t in threading.enumerate() if t.name == "ckptctl-read"]:
        thread.join(30)
    assert started == 1 and len(ahead) == started  # nothing more read after the sync returned
