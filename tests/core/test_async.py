"""Async saves: the caller waits for the CPU copy only; writing and committing happen in the background."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl.core import CheckpointManager, snapshot
from ckptctl.core import distributed as dist_
from ckptctl.errors import SerializationError, StorageError
from ckptctl.formats import state_tree
from tests.core import _workers
from tests.core.util import assert_same


@dataclass
class Gate:
    """Background writes announce themselves on `entered` and block until the test sets `opened`."""

    entered: threading.Event = field(default_factory=threading.Event)
    opened: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    real = state_tree.write_files

    def write_files(*args: Any, **kwargs: Any) -> Any:
        g.entered.set()
        assert g.opened.wait(timeout=60), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(state_tree, "write_files", write_files)
    yield g
    g.opened.set()  # a failed test must not leave a writer thread blocked


def test_save_returns_before_the_write_and_wait_commits(run_dir: Path, gate: Gate) -> None:
    manager = CheckpointManager(run_dir, async_save=True)
    weights = torch.arange(1000.0)
    manager.save(1, {"w": weights, "meta": {"lr": [0.1]}})
    assert gate.entered.wait(timeout=60)
    # save() returned while the writer is still blocked: nothing is committed yet
    assert manager.all_steps() == [] and not (run_dir / "latest").exists()
    assert [p.name for p in run_dir.iterdir() if ".staging-" in p.name]
    weights.fill_(-1)  # the loop goes on and changes the state in place
    gate.opened.set()
    manager.wait()
    assert manager.all_steps() == [1] and (run_dir / "latest").read_text() == "step-1\n"
    state: dict[str, Any] = {"w": None, "meta": None}
    manager.restore(state)
    assert_same({"w": torch.arange(1000.0), "meta": {"lr": [0.1]}}, state)  # the state as it was at save()


def test_next_save_joins_the_previous_one(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir, async_save=True)
    for step in range(4):
        manager.save(step, {"w": torch.full((10,), float(step))})
    manager.wait()
    assert manager.all_steps() == [0, 1, 2, 3]
    state: dict[str, Any] = {"w": None}
    assert manager.restore(state) == 3 and torch.equal(state["w"], torch.full((10,), 3.0))


def failing_writer(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("next_call", ["wait", "save", "restore"])
def test_background_failure_surfaces_on_the_next_call(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, next_call: str
) -> None:
    manager = CheckpointManager(run_dir, async_save=True)
    manager.save(1, {"w": torch.zeros(3)})
    manager.wait()
    monkeypatch.setattr(state_tree, "write_files", failing_writer)
    manager.save(2, {"w": torch.ones(3)})  # returns: the failure happens in the background
    calls = {
        "wait": manager.wait,
        "save": lambda: manager.save(3, {"w": torch.ones(3)}),
        "restore": lambda: manager.restore({"w": None}),
    }
    with pytest.raises(StorageError, match="space") as info:
        calls[next_call]()
    assert info.value.hint == "free some space"
    monkeypatch.undo()
    # the failed save left nothing behind, the previous checkpoint is intact, and the manager goes on
    assert sorted(os.listdir(run_dir)) == ["latest", "step-1"]
    manager.wait()  # the error was reported once
    manager.save(4, {"w": torch.ones(3)})
    manager.wait()
    assert manager.all_steps() == [1, 4]


def test_async_and_sync_saves_write_the_same_files(tmp_path: Path, trained_state: dict[str, Any]) -> None:
    sync_root, async_root = tmp_path / "sync", tmp_path / "async"
    torch.manual_seed(0)
    CheckpointManager(sync_root).save(5, trained_state)
    torch.manual_seed(0)  # same generator states, so rng files match too
    manager = CheckpointManager(async_root, async_save=True)
    manager.save(5, trained_state)
    manager.wait()
    sync_files = {p.name: p.read_bytes() for p in (sync_root / "step-5").iterdir()}
    async_files = {p.name: p.read_bytes() for p in (async_root / "step-5").iterdir()}
    sync_files.pop("ckptctl-manifest.json"), async_files.pop("ckptctl-manifest.json")  # creation times differ
    assert sync_files.keys() == async_files.keys()
    for name, content in sync_files.items():
        assert content == async_files[name], name
    state = _workers.build_training_state(seed=4)
    manager.restore(state)
    assert_same(_workers.snapshot(trained_state) | {"trainer": None}, _workers.snapshot(state))


def test_staging_buffers_are_reused_between_saves(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir, async_save=True)
    w = torch.zeros(256)
    captured: list[int] = []
    real = state_tree.encode

    def encode(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        if "w" in out.tensors:
            captured.append(out.tensors["w"].data_ptr())
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(state_tree, "encode", encode)
        for step in range(3):
            manager.save(step, {"value": {"w": w}})
    manager.wait()
    assert len(captured) == 3 and len(set(captured)) == 1 and captured[0] != w.data_ptr()


def test_conjugate_and_negative_views_are_staged_as_their_values() -> None:
    """Contiguous host tensors are staged by memcpy; a lazily conjugated or negated view's bytes are not its
    values, so it takes the resolving copy (this reached the memcpy and raised a torch error)."""
    z = torch.randn(4, dtype=torch.complex64)
    views = {"conj": z.conj(), "neg": torch._neg_view(z), "plain": torch.arange(6.0)}
    stager = snapshot.Stager()
    staged = {slot: stager.stage(slot, view) for slot, view in views.items()}
    stager.finish()
    for slot, view in views.items():
        assert torch.equal(staged[slot], view.resolve_conj().resolve_neg()), slot


def test_a_failed_async_save_leaves_no_copy_behind(run_dir: Path) -> None:
    """An entry that cannot be stored fails the save after earlier tensors were queued for staging. The next
    save of that tensor must hold its own values, not the queued copy of the failed one (which ran last, over
    them, when the new tensor took the direct copy: a non-contiguous one)."""
    manager = CheckpointManager(run_dir, async_save=True)
    with pytest.raises(SerializationError):
        manager.save(1, {"a": {"w": torch.ones(8, 8)}, "b": {"bad": object()}})
    new = torch.arange(64.0).reshape(8, 8).t()
    manager.save(2, {"a": {"w": new}})
    manager.wait()
    state: dict[str, Any] = {"a": None}
    manager.restore(state)
    assert torch.equal(state["a"]["w"], new)


def test_a_rank_whose_state_fails_with_any_error_tells_the_others(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 of 2 (the collectives stood in for): an entry whose `state_dict` raises a plain RuntimeError still
    reaches the all-gather where the other rank waits, instead of leaving it there."""
    gathered: list[Any] = []

    def all_gather(obj: Any, group: Any = None) -> list[Any]:
        gathered.append(obj)
        return [obj, (None, None, None)]  # rank 1 took its state: no staging (not rank 0), no error

    monkeypatch.setattr(dist_, "current_world", lambda: dist_.World(0, 2))
    monkeypatch.setattr(dist_, "broadcast", lambda obj, src=0, group=None: obj)
    monkeypatch.setattr(dist_, "all_gather", all_gather)

    class Broken:
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError("CUDA error: out of memory")

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    with pytest.raises(RuntimeError, match="out of memory"):
        CheckpointManager(run_dir).save(1, {"sampler": Broken()})
    # one all-gather (rank 0's staging folder, its creation error, this rank's failure), naming the failure
    assert [failure for _, _, failure in gathered] == ["RuntimeError: CUDA error: out of memory"]
