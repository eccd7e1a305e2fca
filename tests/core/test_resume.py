"""`CheckpointManager.resume`: the one call that starts a run or continues it (issue 11)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl.core import CheckpointManager
from ckptctl.errors import CheckpointNotFound
from tests.core import _workers
from tests.core.util import assert_same


def test_a_fresh_run_starts_at_first_step_and_leaves_the_state_as_built(run_dir: Path) -> None:
    state = _workers.build_training_state(seed=5)
    before = _workers.snapshot(state)
    manager = CheckpointManager(run_dir)
    assert manager.resume(state) == 0
    assert manager.resume(state, first_step=1) == 1
    assert_same(_workers.snapshot(state), before)


def test_resume_restores_the_newest_and_returns_the_step_after_it(run_dir: Path, trained_state: dict[str, Any]) -> None:
    manager = CheckpointManager(run_dir)
    manager.save(10, _workers.build_training_state(seed=1))
    manager.save(20, trained_state)
    resumed = _workers.build_training_state(seed=99)
    assert manager.resume(resumed) == 21
    assert_same(_workers.snapshot(resumed), _workers.snapshot(trained_state))


def test_the_loop_idiom_continues_where_a_crashed_run_stopped(run_dir: Path) -> None:
    seen: list[int] = []

    def job(crash_after: int | None) -> None:
        state = {"weights": torch.zeros(3)}
        manager = CheckpointManager(run_dir)
        for step in range(manager.resume(state, first_step=1), 11):
            state["weights"] = state["weights"] + 1
            seen.append(step)
            if step % 2 == 0:
                manager.save(step, state)
            if step == crash_after:
                return

    job(crash_after=5)  # saved at 2 and 4, lost step 5
    job(crash_after=None)
    assert seen == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10]
    final = {"weights": torch.zeros(3)}
    assert CheckpointManager(run_dir).resume(final) == 11
    assert torch.equal(final["weights"], torch.full((3,), 10.0))


def test_an_interrupted_first_save_is_a_fresh_start(run_dir: Path) -> None:
    staging = run_dir / ".step-10.staging-abc123"
    staging.mkdir(parents=True)
    (staging / "model.safetensors").write_bytes(b"\0" * 32)
    assert CheckpointManager(run_dir).resume({"w": torch.zeros(1)}) == 0


def test_a_run_whose_checkpoints_are_all_broken_is_not_silently_restarted(
    run_dir: Path, trained_state: dict[str, Any]
) -> None:
    manager = CheckpointManager(run_dir)
    manager.save(10, trained_state)
    (run_dir / "step-10" / "model.safetensors").unlink()
    with pytest.raises(CheckpointNotFound, match="no valid committed checkpoint"):
        manager.resume(_workers.build_training_state(seed=1))
