"""The manager's `mirror` option against the local S3 server: each committed step arrives whole (listed
complete, verified with its digests, `latest` naming it), and a save returns while its upload is held up."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptctl import io
from ckptctl.core import CheckpointManager
from ckptctl.core.retention import RetentionPolicy
from tests.conftest import CliResult

Cli = Callable[..., CliResult]


def states(run_cli: Cli, url: str) -> dict[str, str]:
    result = run_cli("list", url, "--json")
    assert result.exit_code == 0, result.stderr
    return {io.relative_to(c["url"], url): c["state"] for c in result.json["checkpoints"]}


def test_each_committed_step_is_mirrored_whole(run_cli: Cli, bucket: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(8, 8), "optimizer": None}
    state["optimizer"] = torch.optim.SGD(state["model"].parameters(), lr=0.1)
    mirror = f"{bucket}/mirror"
    # keep_last=1: retention deletes each step locally once the next commits; the mirror keeps them all.
    manager = CheckpointManager(tmp_path / "run", policy=RetentionPolicy(keep_last=1), mirror=mirror)
    for step in (10, 20, 30):
        manager.save(step, state)
    manager.close()
    assert states(run_cli, mirror) == {f"step-{n}": "complete" for n in (10, 20, 30)}
    verified = run_cli("verify", mirror, "--json")
    assert verified.exit_code == 0, verified.stdout
    assert io.read_bytes(f"{mirror}/latest") == b"step-30\n"
    model = torch.nn.Linear(8, 8)
    restored = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    assert CheckpointManager(mirror).restore(restored) == 30
    assert torch.equal(restored["model"].weight, state["model"].weight)


def test_a_save_returns_while_its_upload_is_held_up(
    run_cli: Cli, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uploading, gate = threading.Event(), threading.Event()
    real_upload = io.upload_file

    def held_upload(path: str, url: str) -> None:
        uploading.set()
        assert gate.wait(120), "the test never opened the gate"
        real_upload(path, url)

    monkeypatch.setattr(io, "upload_file", held_upload)
    mirror = f"{bucket}/held"
    manager = CheckpointManager(tmp_path / "run", mirror=mirror)
    try:
        manager.save(10, {"model": torch.nn.Linear(4, 4)})  # returns with the mirror's upload held at the gate
        assert manager.all_steps() == [10]
        assert uploading.wait(60)
        assert not io.exists(f"{mirror}/step-10/ckptctl-manifest.json")
    finally:
        gate.set()
    manager.wait()
    assert states(run_cli, mirror) == {"step-10": "complete"}


def test_a_failed_copy_says_what_stays_local_and_the_next_save_copies_it(
    run_cli: Cli, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy that fails (here the store refuses the first step's files) is reported once, with the error and
    the steps kept locally for it whatever the retention policy says; the next save copies both."""
    from ckptctl.core import mirror as mirror_module
    from ckptctl.core.entries import CheckpointWarning
    from ckptctl.errors import StorageError

    send = mirror_module.Mirror._send
    refused: list[str] = []

    def refuse_once(self: mirror_module.Mirror, folder: str, lost: threading.Event) -> None:
        if not refused:
            refused.append(folder)
            raise StorageError("the store refused the upload", "try again")
        send(self, folder, lost)

    monkeypatch.setattr(mirror_module.Mirror, "_send", refuse_once)
    mirror = f"{bucket}/shared"
    state = {"model": torch.nn.Linear(8, 8)}
    manager = CheckpointManager(tmp_path / "run", policy=RetentionPolicy(keep_last=1), mirror=mirror)
    manager.save(10, state)
    warned = r"mirroring to .*shared failed: .*the store refused the upload.*; 1 step\(s\) not yet copied .*: step-10$"
    with pytest.warns(CheckpointWarning, match=warned):
        manager.wait()
    assert refused == ["step-10"] and io.list_tree(mirror) == {}
    assert (tmp_path / "run" / "step-10").is_dir()  # kept locally, keep_last=1 or not
    manager.save(20, state)
    manager.close()
    assert states(run_cli, mirror) == {"step-10": "complete", "step-20": "complete"}


def test_the_mirror_writes_nothing_while_a_sync_holds_dst(
    run_cli: Cli, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mirror takes DST's sync lock for each step it copies: while a `ckptctl sync` into the same DST holds
    it, the mirror writes nothing there (its clearing of a step could follow the sync's finding it whole),
    keeps the step, says why, and copies it once DST is free; a step the sync copied whole meanwhile is done."""
    from ckptctl.core import mirror as mirror_module
    from ckptctl.core.entries import CheckpointWarning
    from ckptctl.core.lock import RunLock
    from ckptctl.ops.sync import SYNC_LOCK
    from tests.s3.server import copy_to_store

    monkeypatch.setattr(mirror_module, "LOCK_WAIT", 0.5, raising=False)
    mirror = f"{bucket}/locked"
    state = {"model": torch.nn.Linear(8, 8)}
    manager = CheckpointManager(tmp_path / "run", policy=RetentionPolicy(keep_last=1), mirror=mirror)
    with RunLock(mirror, name=SYNC_LOCK, command="ckptctl sync"):
        manager.save(10, state)
        with pytest.warns(CheckpointWarning, match=r"locked by .*ckptctl sync.*not yet copied .*: step-10$"):
            manager.wait()
        assert set(io.list_tree(mirror)) == {SYNC_LOCK}
        assert (tmp_path / "run" / "step-10").is_dir()
    manager.save(20, state)
    manager.wait()
    assert states(run_cli, mirror) == {"step-10": "complete", "step-20": "complete"}
    assert io.read_bytes(f"{mirror}/latest") == b"step-20\n"

    copied = threading.Event()  # the mirror looks at DST once the sync holding it has copied step-30
    real_whole_there = mirror_module.Mirror._whole_there
    monkeypatch.setattr(
        mirror_module.Mirror, "_whole_there", lambda self, folder: copied.wait(60) and real_whole_there(self, folder)
    )
    with RunLock(mirror, name=SYNC_LOCK, command="ckptctl sync"):
        manager.save(30, state)
        copy_to_store(tmp_path / "run" / "step-30", f"{mirror}/step-30")  # what the sync holding DST copies
        copied.set()
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointWarning)
            manager.wait()  # no warning: the step is whole there
    manager.close()
    assert states(run_cli, mirror) == {f"step-{n}": "complete" for n in (10, 20, 30)}
    assert not (tmp_path / "run" / "step-20").exists()  # not kept back for the mirror


def test_while_dst_is_held_one_step_a_save_waits_for_it(
    run_cli: Cli, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `sync --watch` holds DST throughout: the steps a save queues behind the ones that failed do not each
    wait `LOCK_WAIT` for it (the interpreter waits for the mirror at exit: a minute a step kept back)."""
    from ckptctl.core import mirror as mirror_module
    from ckptctl.core.entries import CheckpointWarning
    from ckptctl.core.lock import RunLock
    from ckptctl.ops.sync import SYNC_LOCK

    monkeypatch.setattr(mirror_module, "LOCK_WAIT", 0.3)
    waits: list[float] = []

    class Recorded(RunLock):
        def acquire(self) -> None:
            waits.append(self.wait)
            super().acquire()

    monkeypatch.setattr(mirror_module, "RunLock", Recorded)
    mirror = f"{bucket}/held"
    state = {"model": torch.nn.Linear(8, 8)}
    manager = CheckpointManager(tmp_path / "run", policy=RetentionPolicy(keep_last=1), mirror=mirror)
    with RunLock(mirror, name=SYNC_LOCK, command="ckptctl sync --watch"):
        for step in (10, 20, 30):
            manager.save(step, state)
            with pytest.warns(CheckpointWarning, match="locked by"):
                manager.wait()
    assert waits == [0.3, 0.3, 0.0, 0.3, 0.0, 0.0]  # each save's first step waits, the ones after it do not
    manager.save(40, state)
    manager.close()
    assert states(run_cli, mirror) == {f"step-{n}": "complete" for n in (10, 20, 30, 40)}


def test_a_mirror_that_loses_dst_lock_mid_copy_writes_no_marker_or_latest(
    run_cli: Cli, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer taking DST's lock over while the mirror copies a step (the mirror looked dead to it): the
    mirror starts no file after it finds out, so the step's markers and `latest` are not written, and it says so.
    Before, the keeper only logged the loss and the copy went on to complete the step without the lock."""
    import json

    from ckptctl.core import mirror as mirror_module
    from ckptctl.core.entries import CheckpointWarning
    from ckptctl.core.lock import RunLock
    from ckptctl.formats.manifest import MANIFEST_NAME
    from ckptctl.ops.sync import SYNC_LOCK

    monkeypatch.setattr(mirror_module, "_REFRESH_EVERY", 0.05)
    uploading, gate, found_out = threading.Event(), threading.Event(), threading.Event()
    real_upload, real_refresh = io.upload_file, RunLock.refresh

    def held_upload(path: str, url: str) -> None:
        uploading.set()
        assert gate.wait(120), "the test never opened the gate"
        real_upload(path, url)

    def refresh(self: RunLock) -> None:
        try:
            real_refresh(self)
        except Exception:
            found_out.set()
            raise

    monkeypatch.setattr(io, "upload_file", held_upload)
    monkeypatch.setattr(RunLock, "refresh", refresh)
    mirror = f"{bucket}/taken"
    manager = CheckpointManager(tmp_path / "run", mirror=mirror)
    try:
        manager.save(10, {"model": torch.nn.Linear(4, 4)})
        assert uploading.wait(60)
        theirs = {"host": "another-host", "pid": 1, "token": "theirs", "started": "2026-01-01T00:00:00"}
        io.write_bytes_atomic(f"{mirror}/{SYNC_LOCK}", json.dumps(theirs).encode())
        assert found_out.wait(60)
    finally:
        gate.set()
    with pytest.warns(CheckpointWarning, match="lost the lock of"):
        manager.wait()
    manager.close()
    assert not io.exists(f"{mirror}/step-10/{MANIFEST_NAME}")
    assert not io.exists(f"{mirror}/latest")
    assert json.loads(io.read_bytes(f"{mirror}/{SYNC_LOCK}"))["token"] == "theirs"  # not ours to remove
    assert (tmp_path / "run" / "step-10").is_dir()
