"""CheckpointManager in one process: the commit protocol, what restore picks, errors, plain values."""

from __future__ import annotations

import json
import os
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptctl.core import CheckpointManager, CheckpointWarning, StepNaming
from ckptctl.errors import CheckpointNotFound, CorruptCheckpoint, SerializationError
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import MANIFEST_NAME, read_manifest
from tests.core import _workers
from tests.core.util import assert_same


def fresh_state(seed: int = 9) -> dict[str, Any]:
    return _workers.build_training_state(seed=seed)


def test_every_data_file_is_fsynced_before_the_manifest_is_written(
    run_dir: Path, trained_state: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files are fsynced together after all are written (one journal commit), still before the
    manifest that names them: a crash never leaves a manifest naming bytes that are not on the disk."""
    events: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        events.append("fsync " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    real_open = open

    def tracking_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "w" in mode and os.path.basename(str(file)).startswith(MANIFEST_NAME):
            events.append("write manifest")
        return real_open(file, mode, *args, **kwargs)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name an fd")
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr("builtins.open", tracking_open)
    CheckpointManager(run_dir).save(3, trained_state)
    data = {p.name for p in (run_dir / "step-3").iterdir()} - {MANIFEST_NAME}
    manifest_at = events.index("write manifest")
    assert {f"fsync {name}" for name in data} <= set(events[:manifest_at])


def test_save_writes_the_documented_layout(run_dir: Path, trained_state: dict[str, Any]) -> None:
    trained_state["trainer"] = {"tokens": 10}
    CheckpointManager(run_dir).save(
        7, trained_state, metrics={"loss": torch.tensor(0.5), "epoch": 2, "lr": np.float32(0.25)}
    )
    step_dir = run_dir / "step-7"
    assert (run_dir / "latest").read_text() == "step-7\n"
    assert {p.name for p in step_dir.iterdir()} == {
        MANIFEST_NAME,
        *(f"{e}.json" for e in ("model", "optimizer", "scheduler", "sampler", "trainer", "rng")),
        *(f"{e}.safetensors" for e in ("model", "optimizer", "sampler", "rng")),
    }
    manifest = read_manifest(str(step_dir))
    assert manifest is not None and manifest.native
    assert (manifest.step, manifest.epoch, manifest.world_size) == (7, 2.0, 1)
    assert manifest.metrics == {"loss": 0.5, "epoch": 2, "lr": 0.25}
    assert set(manifest.versions) == {"ckptctl", "torch", "python", "numpy"}
    kinds = {name: (c.kind, c.storage) for name, c in manifest.components.items()}
    assert kinds == {
        "model": ("module", "safetensors"),
        "optimizer": ("optimizer", "safetensors"),
        "scheduler": ("scheduler", "safetensors"),
        "sampler": ("dataloader", "safetensors"),
        "trainer": ("value", "safetensors"),
        "rng": ("rng", "safetensors"),
    }
    assert set(manifest.files) == {p.name for p in step_dir.iterdir()} - {MANIFEST_NAME}
    for name, record in manifest.files.items():
        assert record.size == (step_dir / name).stat().st_size
        assert record.blake3 == file_digest(str(step_dir / name))
    assert json.loads((step_dir / "trainer.json").read_text()) == {"tree": {"tokens": 10}}


def test_restore_in_process_equals_what_was_saved(run_dir: Path, trained_state: dict[str, Any]) -> None:
    trained_state["trainer"] = {"tokens": 10, "history": (1.5, float("nan"))}
    expected = _workers.snapshot(trained_state)
    manager = CheckpointManager(run_dir)
    manager.save(3, trained_state)
    state = fresh_state()
    state["trainer"] = None
    assert manager.restore(state) == 3
    assert_same(expected, _workers.snapshot(state))


def test_rng_is_saved_and_restored_without_being_asked(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    manager.save(1, {"x": 1})
    expected = _workers.draws()
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    manager.restore({"x": 0})
    assert_same(expected, _workers.draws())


def test_missing_rng_key_warns_and_restores_the_rest(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptctl.core import rng

    real_capture = rng.capture
    monkeypatch.setattr(rng, "capture", lambda: {k: v for k, v in real_capture().items() if k != "numpy"})
    manager = CheckpointManager(run_dir)
    random.seed(1), torch.manual_seed(1)
    manager.save(1, {"x": 1})
    expected = _workers.draws()
    monkeypatch.undo()

    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    np_before = np.random.get_state(legacy=False)
    with pytest.warns(CheckpointWarning, match="numpy"):
        manager.restore({"x": 0})
    np_after = np.random.get_state(legacy=False)
    got = _workers.draws()
    assert got["python"] == expected["python"] and torch.equal(got["torch"], expected["torch"])
    assert np.array_equal(np_before["state"]["key"], np_after["state"]["key"])  # numpy was left as it was
    assert np_before["state"]["pos"] == np_after["state"]["pos"]


def test_plain_values_are_replaced_and_missing_entries_warn(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir)
    manager.save(1, {"epoch": 4, "ids": np.arange(3), "t": torch.ones(2)})
    state: dict[str, Any] = {"epoch": 0, "ids": None, "t": None, "new_entry": 5}
    with pytest.warns(CheckpointWarning, match="new_entry"):
        manager.restore(state)
    assert_same({"epoch": 4, "ids": np.arange(3), "t": torch.ones(2), "new_entry": 5}, state)


def test_resaving_a_step_replaces_it(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir)
    manager.save(1, {"w": torch.zeros(3)})
    manager.save(2, {"w": torch.ones(3)})
    manager.save(1, {"w": torch.full((3,), 7.0)})
    state: dict[str, Any] = {"w": None}
    assert manager.restore(state, step=1) == 1
    assert torch.equal(state["w"], torch.full((3,), 7.0))
    assert manager.all_steps() == [1, 2]
    assert (run_dir / "latest").read_text() == "step-1\n"
    manager.wait()  # the replaced step-1 is deleted in the background
    assert sorted(p.name for p in run_dir.iterdir()) == ["latest", "step-1", "step-2"]  # no (empty) trash left


def test_restore_without_checkpoint_is_a_clear_error(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir)
    assert manager.latest_step() is None and manager.all_steps() == []
    with pytest.raises(CheckpointNotFound, match="no valid committed checkpoint"):
        manager.restore({"x": 0})
    manager.save(4, {"x": 1})
    with pytest.raises(CheckpointNotFound, match="step 5") as info:
        manager.restore({"x": 0}, step=5)
    assert "4" in info.value.hint


def test_restore_skips_broken_newer_checkpoints(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir)
    for step in (1, 2, 3, 4, 5):
        manager.save(step, {"w": torch.full((100,), float(step))})
    (run_dir / "step-5" / MANIFEST_NAME).write_text("{garbage")  # corrupt manifest
    (run_dir / "step-4" / "w.safetensors").unlink()  # missing file
    with open(run_dir / "step-3" / "w.safetensors", "ab") as f:  # size mismatch
        f.write(b"\0")
    os.unlink(run_dir / "step-2" / MANIFEST_NAME)  # not committed: not a step at all
    assert manager.all_steps() == [1, 3, 4, 5]
    assert manager.latest_step() == 1
    state: dict[str, Any] = {"w": None}
    with pytest.warns(CheckpointWarning, match="restoring step-1") as caught:
        assert manager.restore(state) == 1
    (message,) = (str(w.message) for w in caught)
    assert all(f"step-{n}:" in message for n in (3, 4, 5))
    assert torch.equal(state["w"], torch.full((100,), 1.0))
    with pytest.raises(CorruptCheckpoint, match=r"w\.safetensors"):
        manager.restore(state, step=4)


def test_verify_catches_a_flipped_bit(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir)
    manager.save(1, {"w": torch.zeros(100)})
    manager.save(2, {"w": torch.ones(100)})
    path = run_dir / "step-2" / "w.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    assert manager.latest_step() == 2  # sizes only: fast, and blind to this
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert manager.restore({"w": None}, verify=True) == 1
    assert any("blake3" in str(w.message) for w in caught)


def test_unsupported_type_is_refused_and_nothing_is_left(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir)
    with pytest.raises(SerializationError, match=r"state\['cfg'\]\['paths'\]\[1\]"):
        manager.save(1, {"model": torch.nn.Linear(2, 2), "cfg": {"paths": ["a", Path("b")]}})
    assert sorted(os.listdir(run_dir)) == []


class NoPickle:
    def state_dict(self) -> dict[str, Any]:
        return {"callback": print}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("never saved")


def test_stateful_object_with_unsupported_state_names_the_path(run_dir: Path) -> None:
    with pytest.raises(SerializationError, match=r"state\['hook'\]\['callback'\]"):
        CheckpointManager(run_dir).save(1, {"hook": NoPickle()})


@pytest.mark.parametrize("name", ["rng", "dcp", "ckptctl-manifest", "rng.rank-0", "a/b", ".hidden", "", 3])
def test_entry_names_that_cannot_be_files_are_refused(run_dir: Path, name: Any) -> None:
    with pytest.raises(SerializationError):
        CheckpointManager(run_dir).save(1, {name: 1})


@pytest.mark.parametrize("step", [-1, 1.5, "3", True])
def test_invalid_steps_are_refused(run_dir: Path, step: Any) -> None:
    with pytest.raises(ValueError):
        CheckpointManager(run_dir).save(step, {"x": 1})


def test_metrics_must_be_plain(run_dir: Path) -> None:
    with pytest.raises(SerializationError, match=r"metrics\['bad'\]"):
        CheckpointManager(run_dir).save(1, {"x": 1}, metrics={"bad": object()})


def test_remote_roots_take_the_object_store_path() -> None:
    # memory:// goes through fsspec like s3:// (which tests/s3 covers against a local S3 server).
    root = f"memory://ckptctl-core-tests/{os.getpid()}-{id(object())}/run"
    manager = CheckpointManager(root)
    manager.save(1, {"x": 1, "w": torch.arange(3.0)})
    assert manager.all_steps() == [1] and manager.pointer() == "step-1"
    state: dict[str, Any] = {"x": 0, "w": None}
    assert manager.restore(state) == 1
    assert state["x"] == 1 and torch.equal(state["w"], torch.arange(3.0))


def test_module_version_metadata_survives(run_dir: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    CheckpointManager(run_dir).save(1, {"model": model})
    doc = json.loads((run_dir / "step-1" / "model.json").read_text())
    assert doc["state_dict_metadata"]["1"] == {"version": 2}


def test_step_naming_builds_and_recognises_names() -> None:
    naming = StepNaming()
    assert naming.step_of(naming.folder(30)) == 30
    assert naming.staging_step(naming.staging(30, "ab12")) == 30
    assert naming.step_of("step-030") is None and naming.step_of(".step-3.staging-x") is None
    assert naming.staging_step("step-3") is None
