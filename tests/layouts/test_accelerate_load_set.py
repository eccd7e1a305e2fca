"""accelerate's load set (`frameworks.accelerate.load_set`) on the real `save_state` folders: a folder missing a file
`load_state` reads (numbered as save_state numbered it) fails verify naming it, and is broken in `list`; where the
folder alone cannot tell, the run's other saves are the evidence, and the message says so."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult, copy_tree
from tests.writers.accelerate_writer import WrittenAccelerate

Cli = Callable[..., CliResult]


def _errors(result: CliResult) -> list[str]:
    return [p["path"] for p in result.json["problems"] if p["severity"] == "error"]


@pytest.mark.parametrize("victim", ["scheduler.bin", "optimizer.bin", "model.safetensors"])
def test_a_save_missing_what_the_run_s_other_saves_hold_fails(
    accelerate_runs: WrittenAccelerate, tmp_path: Path, run_cli: Cli, victim: str
) -> None:
    run = copy_tree(accelerate_runs.plain, tmp_path / "plain")
    ckpt = run / "checkpoints" / "checkpoint_2"
    (ckpt / victim).unlink()
    verify = run_cli("verify", ckpt, "--json")
    assert verify.exit_code == 1 and victim in _errors(verify)
    message = next(p["message"] for p in verify.json["problems"] if p["path"] == victim)
    assert "all 2 other saves of the run (checkpoint_0, checkpoint_1) hold it" in message
    states = {Path(c["url"]).name: c["state"] for c in run_cli("list", run, "--json").json["checkpoints"]}
    assert states == {"checkpoint_0": "complete", "checkpoint_1": "complete", "checkpoint_2": "broken"}


def test_a_deepspeed_save_without_its_scheduler_fails(
    accelerate_runs: WrittenAccelerate, tmp_path: Path, run_cli: Cli
) -> None:
    run = copy_tree(accelerate_runs.deepspeed, tmp_path / "ds")
    (run / "checkpoints" / "checkpoint_2" / "scheduler.bin").unlink()
    verify = run_cli("verify", run / "checkpoints" / "checkpoint_2", "--json")
    assert verify.exit_code == 1 and _errors(verify) == ["scheduler.bin"]


def test_a_gap_in_a_kind_s_numbering_names_the_missing_file(
    accelerate_runs: WrittenAccelerate, tmp_path: Path, run_cli: Cli
) -> None:
    ckpt = copy_tree(accelerate_runs.named, tmp_path / "named" / "step_6")
    # A second scheduler's file without the first one's: load_state reads scheduler.bin for the first.
    shutil.move(ckpt / "scheduler.bin", ckpt / "scheduler_1.bin")
    verify = run_cli("verify", ckpt, "--json")
    assert verify.exit_code == 1 and _errors(verify) == ["scheduler.bin"]


def test_a_lone_save_without_its_scheduler_or_optimizer_fails_from_the_other_s_state(
    accelerate_runs: WrittenAccelerate, tmp_path: Path, run_cli: Cli
) -> None:
    ckpt = copy_tree(accelerate_runs.named, tmp_path / "named" / "step_6")
    (ckpt / "scheduler.bin").unlink()
    verify = run_cli("verify", ckpt, "--json")
    # No other save of the run says a scheduler was saved; the optimizer's `initial_lr` says one existed, and
    # load_state raises without its file (tests/faults: accelerate's own load on the run's prepared objects).
    assert verify.exit_code == 1 and _errors(verify) == ["scheduler.bin"]
    ckpt = copy_tree(accelerate_runs.named, tmp_path / "named2" / "step_6")
    (ckpt / "optimizer.bin").unlink()
    verify = run_cli("verify", ckpt, "--json")
    assert verify.exit_code == 1 and _errors(verify) == ["optimizer.bin"]
