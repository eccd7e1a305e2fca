"""AutoSaver: when a plain loop saves, and the save at exit."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl.core import AutoSaver, CheckpointManager
from tests.core.util import REPO, run_fresh_worker, worker_command, worker_env


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_every_steps_and_exit_save(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir)
    with AutoSaver(manager, {"x": 1}, every_steps=3) as saver:
        saved = [step for step in range(8) if saver.step(step)]
    assert saved == [0, 3, 6]
    assert manager.all_steps() == [0, 3, 6, 7]  # 7 saved at exit
    assert saver.last_saved_step == 7


def test_exit_does_not_save_the_same_step_twice(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = CheckpointManager(run_dir)
    calls: list[int] = []
    real = manager.save

    def save(step: int, *args: Any, **kwargs: Any) -> None:
        calls.append(step)
        real(step, *args, **kwargs)

    monkeypatch.setattr(manager, "save", save)
    with AutoSaver(manager, {"x": 1}, every_steps=2) as saver:
        for step in range(5):
            saver.step(step)
    saver.close()  # closing twice does nothing
    assert calls == [0, 2, 4]


def test_every_seconds(run_dir: Path) -> None:
    clock = FakeClock()
    manager = CheckpointManager(run_dir)
    saver = AutoSaver(manager, {"x": 1}, every_seconds=10, save_on_exit=False, clock=clock)
    saved = []
    for step in range(1, 8):
        clock.now = step * 4.0  # 4 s per step: due at 12 s, then 10 s after that save
        if saver.step(step):
            saved.append(step)
    saver.close()
    assert saved == [3, 6]
    assert manager.all_steps() == [3, 6]


def test_an_exception_in_the_loop_does_not_save(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir)
    with pytest.raises(RuntimeError), AutoSaver(manager, {"x": 1}, every_steps=10) as saver:
        saver.step(0)
        saver.step(1)
        raise RuntimeError("diverged")
    assert manager.all_steps() == [0]


def test_metrics_of_the_last_step_are_saved_at_exit(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir, async_save=True)
    with AutoSaver(manager, {"w": torch.zeros(2)}, every_steps=100) as saver:
        saver.step(1, metrics={"loss": 2.0})
        saver.step(2, metrics={"loss": 1.0})
    assert manager.all_steps() == [2]
    meta: dict[str, Any] = json.loads((run_dir / "step-2" / "ckptctl-manifest.json").read_text())
    assert meta["metrics"] == {"loss": 1.0}


@pytest.mark.parametrize("bad", [{"every_steps": 0}, {"every_seconds": 0}])
def test_invalid_intervals_are_refused(run_dir: Path, bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        AutoSaver(CheckpointManager(run_dir), {}, **bad)


def test_atexit_saves_the_last_step_in_a_real_process(run_dir: Path) -> None:
    done = run_fresh_worker("autosave", str(run_dir), "clean")
    assert json.loads(done.stdout.splitlines()[0]) == []  # importing the core pulled in no CLI library
    manager = CheckpointManager(run_dir)
    assert manager.all_steps() == [0, 4, 6]
    state: dict[str, Any] = {"counter": None}
    assert manager.restore(state) == 6
    assert torch.equal(state["counter"], torch.tensor([7.0]))


def test_atexit_does_not_save_after_an_uncaught_exception(run_dir: Path) -> None:
    done = subprocess.run(
        worker_command("autosave", str(run_dir), "raise"), cwd=REPO, env=worker_env(), capture_output=True, text=True
    )
    assert done.returncode == 1 and "the loop crashed" in done.stderr
    assert CheckpointManager(run_dir).all_steps() == [0, 4]
