"""The Trainer's load set (`frameworks.hf_trainer.load_set`) on the real Trainer's checkpoints: a `checkpoint-N`
missing a file its resume reads is a torn Trainer checkpoint in every command (never a whole PEFT adapter or HF
model), what the resume only warns about is a warning, and `save_only_model` decides whether the training state
must be there."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import CliResult, copy_tree
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.trainer_writer import WrittenTrainerRun

Cli = Callable[..., CliResult]


def _errors(result: CliResult) -> list[str]:
    problems = result.json["problems"]
    return [p["path"] for p in problems if p["severity"] == "error"]


@pytest.mark.parametrize("victim", ["optimizer.pt", "scheduler.pt", "adapter_config.json", "adapter_model.safetensors"])
def test_a_torn_peft_trainer_checkpoint_given_directly_is_a_broken_trainer_checkpoint_in_every_command(
    trainer_run: WrittenTrainerRun, tmp_path: Path, run_cli: Cli, victim: str
) -> None:
    ckpt = copy_tree(trainer_run.peft_run / "checkpoint-2", tmp_path / "out" / "checkpoint-2")
    (ckpt / victim).unlink()
    verify = run_cli("verify", ckpt, "--json")
    assert verify.exit_code == 1
    assert victim in _errors(verify)
    assert verify.json["layout"] == "hf_trainer"
    assert run_cli("inspect", ckpt, "--json").json["layout"] == "hf_trainer"
    listed = run_cli("list", ckpt.parent, "--json").json["checkpoints"]
    assert [(c["layout"], c["state"]) for c in listed] == [("hf_trainer", "broken")]
    plan = run_cli("resume-plan", ckpt, "--json")
    assert plan.exit_code == 1 and plan.json["checkpoint"] is None
    assert (
        plan.json["skipped"][0]["reason"].startswith("broken: torn: ") and victim in plan.json["skipped"][0]["reason"]
    )


def test_prune_and_convert_see_the_torn_trainer_checkpoint_too(
    trainer_run: WrittenTrainerRun, tmp_path: Path, run_cli: Cli
) -> None:
    out = copy_tree(trainer_run.peft_run, tmp_path / "out")
    (out / "checkpoint-2" / "optimizer.pt").unlink()
    prune = run_cli("prune", out, "--keep-last", "1", "--dry-run", "--json").json
    keep = {io_name(k["url"]): k for k in prune["keep"]}
    # The newest complete checkpoint is checkpoint-1: the torn checkpoint-2 is not one (kept here only as fresh).
    assert "newest complete" in keep["checkpoint-1"]["reasons"]
    assert keep["checkpoint-2"]["state"] == "broken" and "newest complete" not in keep["checkpoint-2"]["reasons"]
    convert = run_cli("convert", out / "checkpoint-2", tmp_path / "hf", "--to", "hf")
    assert convert.exit_code != 0 and "optimizer.pt" in convert.stderr


def io_name(url: str) -> str:
    return Path(url).name


def test_a_missing_rng_state_is_a_warning_as_the_trainer_only_logs_it(
    trainer_run: WrittenTrainerRun, tmp_path: Path, run_cli: Cli
) -> None:
    ckpt = copy_tree(trainer_run.peft_run / "checkpoint-2", tmp_path / "out" / "checkpoint-2")
    (ckpt / "rng_state.pth").unlink()
    verify = run_cli("verify", ckpt, "--json")
    assert verify.exit_code == 0
    assert [(p["path"], p["severity"]) for p in verify.json["problems"]] == [("rng_state.pth", "warning")]
    assert run_cli("list", ckpt.parent, "--json").json["checkpoints"][0]["state"] == "complete"


def test_a_truncated_scheduler_fails_naming_it(trainer_run: WrittenTrainerRun, tmp_path: Path, run_cli: Cli) -> None:
    ckpt = copy_tree(trainer_run.checkpoints[-1], tmp_path / "out" / "checkpoint-4")
    victim = ckpt / "scheduler.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    verify = run_cli("verify", ckpt, "--json")
    assert verify.exit_code == 1 and _errors(verify) == ["scheduler.pt"]


def test_a_renamed_copy_of_a_torn_checkpoint_stays_a_trainer_checkpoint(
    trainer_run: WrittenTrainerRun, tmp_path: Path, run_cli: Cli
) -> None:
    ckpt = copy_tree(trainer_run.peft_run / "checkpoint-2", tmp_path / "best")
    (ckpt / "optimizer.pt").unlink()
    verify = run_cli("verify", ckpt, "--json")
    assert verify.exit_code == 1 and verify.json["layout"] == "hf_trainer" and "optimizer.pt" in _errors(verify)


def test_a_save_that_wrote_only_the_model_beside_trainer_checkpoints_is_a_torn_trainer_checkpoint(
    trainer_run: WrittenTrainerRun, tmp_path: Path, run_cli: Cli
) -> None:
    out = copy_tree(trainer_run.output_dir, tmp_path / "out")
    (out / "checkpoint-6").mkdir()
    for name in ("model.safetensors", "config.json"):  # what _save_checkpoint writes first
        shutil.copy2(out / "checkpoint-4" / name, out / "checkpoint-6" / name)
    listed = {io_name(c["url"]): (c["layout"], c["state"]) for c in run_cli("list", out, "--json").json["checkpoints"]}
    assert listed["checkpoint-6"][0] == "hf_trainer" and listed["checkpoint-6"][1] in ("broken", "in_progress")


def _set_args(ckpt: Path, **fields: object) -> None:
    """Rewrite training_args.bin as the Trainer would have saved it with these arguments (test code may unpickle the
    real writer's file; the library never does)."""
    args = torch.load(ckpt / "training_args.bin", weights_only=False)
    for key, value in fields.items():
        setattr(args, key, value)
    torch.save(args, ckpt / "training_args.bin")


def test_save_only_model_decides_whether_the_training_state_must_be_there(
    trainer_run: WrittenTrainerRun, tmp_path: Path, run_cli: Cli
) -> None:
    ckpt = copy_tree(trainer_run.checkpoints[-1], tmp_path / "out" / "checkpoint-4")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (ckpt / name).unlink()
    # As the fixture's Trainer saved it (save_only_model=False): the state it wrote is gone.
    verify = run_cli("verify", ckpt, "--json")
    assert verify.exit_code == 1 and sorted(_errors(verify)) == ["optimizer.pt", "scheduler.pt"]
    _set_args(ckpt, save_only_model=True)
    verify = run_cli("verify", ckpt, "--json")
    assert verify.exit_code == 0 and verify.json["problems"] == []


def test_a_peft_trainer_checkpoint_without_its_training_args_warns_and_stays_a_trainer_checkpoint(
    trainer_run: WrittenTrainerRun, tmp_path: Path, run_cli: Cli
) -> None:
    """The resume never reads training_args.bin (the arguments are the caller's): a warning, and the folder is
    still read as the Trainer checkpoint it is, never as a bare PEFT adapter."""
    ckpt = copy_tree(trainer_run.peft_run / "checkpoint-2", tmp_path / "out" / "checkpoint-2")
    (ckpt / "training_args.bin").unlink()
    verify = run_cli("verify", ckpt, "--json")
    assert verify.exit_code == 0 and verify.json["layout"] == "hf_trainer"
    assert [(p["path"], p["severity"]) for p in verify.json["problems"]] == [("training_args.bin", "warning")]


def test_without_training_args_the_run_s_other_checkpoints_say_what_was_saved(
    trainer_run: WrittenTrainerRun, tmp_path: Path, run_cli: Cli
) -> None:
    out = copy_tree(trainer_run.output_dir, tmp_path / "out")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"):
        (out / "checkpoint-4" / name).unlink()
    verify = run_cli("verify", out / "checkpoint-4", "--json")
    assert verify.exit_code == 1
    assert sorted(_errors(verify)) == ["optimizer.pt", "scheduler.pt"]
    warned = {p["path"] for p in verify.json["problems"] if p["severity"] == "warning"}
    assert {"training_args.bin", "rng_state.pth"} <= warned  # the resume reads neither (a warning each)
    optimizer = next(p for p in verify.json["problems"] if p["path"] == "optimizer.pt")
    assert "checkpoint-2 of the same output_dir holds it" in optimizer["message"]


@pytest.fixture
def trainer_with_tag(
    trainer_run: WrittenTrainerRun, deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path: Path
) -> Path:
    """A Trainer checkpoint-4 holding a real DeepSpeed tag (ZeRO-3, no scheduler of its own) and `latest`, as the
    Trainer writes one under DeepSpeed (model_wrapped.save_checkpoint(output_dir) beside its own files)."""
    ckpt = copy_tree(trainer_run.checkpoints[-1], tmp_path / "out" / "checkpoint-4")
    shutil.copytree(deepspeed_runs[3].latest, ckpt / "global_step4")
    (ckpt / "latest").write_text("global_step4")
    (ckpt / "optimizer.pt").unlink()  # DeepSpeed saves the optimizer itself
    return ckpt


def test_a_trainer_checkpoint_with_a_deepspeed_tag(trainer_with_tag: Path, run_cli: Cli) -> None:
    assert run_cli("verify", trainer_with_tag, "--json").exit_code == 0
    # The tag holds its LR scheduler (DeepSpeed owns it): the Trainer then neither writes nor reads scheduler.pt.
    (trainer_with_tag / "scheduler.pt").unlink()
    assert run_cli("verify", trainer_with_tag, "--json").exit_code == 0
    # deepspeed_load_checkpoint has the engine read `latest`; without it the engine loads nothing and the Trainer raises.
    (trainer_with_tag / "latest").unlink()
    verify = run_cli("verify", trainer_with_tag, "--json")
    assert verify.exit_code == 1 and _errors(verify) == ["latest"]
