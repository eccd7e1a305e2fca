"""`CheckpointManager` on an S3 bucket: the same checkpoints as on a local disk, committed by uploading the
manifest last, so that an upload that stops anywhere leaves nothing that lists or restores as complete."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptctl import io
from ckptctl.core import CheckpointManager, CheckpointWarning, RetentionPolicy
from ckptctl.errors import CheckpointNotFound, CorruptCheckpoint, StorageError
from ckptctl.formats.manifest import MANIFEST_NAME
from ckptctl.frameworks.native import layout as native
from tests.conftest import CliResult
from tests.core import _workers
from tests.core.util import REPO, assert_same, worker_env
from tests.s3 import _dist_worker
from tests.s3.server import S3Server

Cli = Callable[..., CliResult]


def trained_state(seed: int = 3) -> dict[str, Any]:
    state = _workers.build_training_state(seed=seed)
    batches = iter(state["sampler"])
    for _ in range(3):
        tokens = torch.tensor([[next(batches) % 32 for _ in range(8)] for _ in range(2)])
        state["model"](tokens).logsumexp(-1).mean().backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state["scheduler"].step()
    return state


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def manifest_of(root: str, step: int) -> dict[str, Any]:
    return json.loads(io.read_bytes(io.join(root, f"step-{step}", MANIFEST_NAME)))


def test_round_trip_equals_a_local_round_trip(bucket: str, tmp_path: Path) -> None:
    state = trained_state()
    local = CheckpointManager(tmp_path / "run")
    remote = CheckpointManager(f"{bucket}/runs/exp1")
    for manager in (local, remote):
        seed_everything(7)  # the same generator states are captured by both saves
        manager.save(3, state, metrics={"loss": torch.tensor(1.5), "epoch": 1})

    a, b = manifest_of(local.root, 3), manifest_of(remote.root, 3)
    for doc in (a, b):
        doc.pop("created")
    assert a == b  # every file, size and blake3 digest; components, metrics, versions
    assert remote.all_steps() == [3] and remote.latest_step() == 3 and remote.pointer() == "step-3"

    restored = {}
    for name, manager in (("local", local), ("remote", remote)):
        fresh = _workers.build_training_state(seed=11)
        seed_everything(99)
        assert manager.restore(fresh) == 3
        restored[name] = {"state": _workers.snapshot(fresh), "draws": _workers.draws()}
    assert_same(restored["remote"], restored["local"])
    assert_same(restored["remote"]["state"]["model"], state["model"].state_dict())


def test_async_saves_with_retention(bucket: str, run_cli: Cli) -> None:
    root = f"{bucket}/run"
    manager = CheckpointManager(root, policy=RetentionPolicy(keep_last=2), async_save=True)
    state = trained_state()
    for step in range(1, 5):
        manager.save(step, state, metrics={"loss": 1.0 / step})
    manager.wait()
    assert manager.all_steps() == [3, 4] and manager.pointer() == "step-4"
    assert {rel.split("/")[0] for rel in io.list_tree(root)} == {"step-3", "step-4", "latest"}

    listed = run_cli("list", root, "--json")
    assert listed.exit_code == 0, listed.stderr
    rows = [(c["step"], c["state"], c["latest"]) for c in listed.json["checkpoints"]]
    assert rows == [(3, "complete", False), (4, "complete", True)]
    verified = run_cli("verify", root, "--json")
    assert verified.exit_code == 0 and all(r["digests_checked"] for r in verified.json["results"])


def test_resaving_a_step_replaces_it_whole(bucket: str) -> None:
    manager = CheckpointManager(f"{bucket}/run")
    manager.save(1, {"a": torch.ones(3), "b": {"n": 1}})
    manager.save(1, {"a": torch.zeros(3)})
    assert not io.exists(io.join(manager.step_dir(1), "b.json"))  # no file of the old save survives
    state: dict[str, Any] = {"a": None}
    assert manager.restore(state) == 1 and torch.equal(state["a"], torch.zeros(3))


def test_an_upload_that_stops_before_the_manifest_is_not_complete(
    bucket: str, run_cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = f"{bucket}/run"
    manager = CheckpointManager(root)
    manager.save(1, {"w": torch.ones(4)})

    real_write = io.write_bytes_atomic

    def stop_at_the_manifest(url: str, data: bytes) -> None:
        if url.endswith(MANIFEST_NAME):
            raise StorageError("connection lost")
        real_write(url, data)

    monkeypatch.setattr(io, "write_bytes_atomic", stop_at_the_manifest)
    with pytest.raises(StorageError, match="connection lost"):
        manager.save(2, {"w": torch.full((4,), 2.0)})
    monkeypatch.setattr(io, "write_bytes_atomic", real_write)
    assert io.exists(io.join(root, "step-2", "w.safetensors"))  # every data file is up, but no manifest

    listed = run_cli("list", root, "--json").json["checkpoints"]
    assert [(c["step"], c["state"], c["latest"]) for c in listed] == [(1, "complete", True), (2, "in_progress", False)]
    assert "being uploaded" in listed[1]["note"]
    assert manager.all_steps() == [1] and manager.latest_step() == 1 and manager.pointer() == "step-1"
    state: dict[str, Any] = {"w": None}
    assert manager.restore(state) == 1 and torch.equal(state["w"], torch.ones(4))
    whole_run = run_cli("verify", root, "--json")
    assert whole_run.exit_code == 0  # a save in progress is not a failure of the run
    assert run_cli("verify", f"{root}/step-2", "--json").json["problems"][0]["kind"] == "in_progress"

    monkeypatch.setattr(native, "REMOTE_UPLOAD_WINDOW", timedelta(0))
    stale = run_cli("list", root, "--json").json["checkpoints"][1]
    assert stale["state"] == "broken" and "stopped midway" in stale["note"]

    manager.save(2, {"w": torch.full((4,), 2.0)})  # saving again completes it
    assert manager.latest_step() == 2
    assert [c["state"] for c in run_cli("list", root, "--json").json["checkpoints"]] == ["complete", "complete"]


@pytest.mark.long
def test_a_save_killed_mid_upload_leaves_the_previous_checkpoint(bucket: str, run_cli: Cli) -> None:
    root = f"{bucket}/killed"
    worker = subprocess.Popen(
        [sys.executable, "-m", "tests.s3._kill_worker", root],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        lines = []
        for line in worker.stdout:
            lines.append(line.strip())
            if line.startswith("uploading"):
                break
        assert lines[-1:] == ["uploading step 2"], (lines, worker.stderr.read() if worker.stderr else "")
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)

    uploaded = io.list_tree(f"{root}/step-2")
    assert uploaded and MANIFEST_NAME not in uploaded and "rng.json" in uploaded
    listed = run_cli("list", root, "--json").json["checkpoints"]
    assert [(c["step"], c["state"], c["latest"]) for c in listed] == [(1, "complete", True), (2, "in_progress", False)]
    manager = CheckpointManager(root)
    state: dict[str, Any] = {"model": torch.nn.Linear(64, 64)}
    assert manager.latest_step() == 1 and manager.restore(state) == 1
    assert torch.all(state["model"].weight == 1.0)


def test_a_corrupted_object_is_caught_while_downloading(bucket: str, s3_server: S3Server) -> None:
    manager = CheckpointManager(f"{bucket}/run")
    manager.save(1, {"w": torch.ones(64)})
    manager.save(2, {"w": torch.full((64,), 2.0)})
    path = f"{manager.step_dir(2)}/w.safetensors".removeprefix("s3://")
    fs = s3_server.filesystem()
    data = bytearray(fs.cat_file(path))
    data[-1] ^= 0x01  # same size, different bytes: only the digest can tell
    fs.pipe_file(path, bytes(data))

    with pytest.raises(CorruptCheckpoint, match="blake3"):
        manager.restore({"w": None}, step=2)
    state: dict[str, Any] = {"w": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert manager.restore(state) == 1
    assert torch.equal(state["w"], torch.ones(64))
    assert any(issubclass(w.category, CheckpointWarning) and "step-2" in str(w.message) for w in caught)


def test_a_missing_bucket_fails_when_the_manager_is_made(s3_server: S3Server) -> None:
    with pytest.raises(CheckpointNotFound, match="bucket 'no-such-bucket-ckptctl' does not exist"):
        CheckpointManager("s3://no-such-bucket-ckptctl/run")


@pytest.mark.slow
def test_two_ranks_save_to_s3_and_restore_in_two_ranks_or_one(bucket: str, tmp_path: Path, run_cli: Cli) -> None:
    root = f"{bucket}/fsdp"
    _dist_worker.main(root, str(tmp_path))  # 2 ranks save and restore, then this process restores
    expected = torch.load(tmp_path / "expected.pt")
    assert_same(torch.load(tmp_path / "restored-2-ranks.pt"), expected)
    assert_same(torch.load(tmp_path / "restored-1-process.pt")["model"], expected["model"])
    assert not any((tmp_path / "staging").iterdir())  # nothing left behind locally

    files = io.list_tree(f"{root}/step-3")
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "rng.rank-0.json", "rng.rank-1.json"} <= set(files)
    listed = run_cli("list", root, "--json").json["checkpoints"]
    assert [(c["step"], c["state"], c["latest"]) for c in listed] == [(3, "complete", True)]
    verified = run_cli("verify", root, "--json")
    assert verified.exit_code == 0 and verified.json["results"][0]["digests_checked"] == len(files) - 1
