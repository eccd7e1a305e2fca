"""`ckptctl repair` as a resume gate and in incidents: exit codes, the JSON document, what changes on disk."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.cli.test_cli import _run_without_torch
from tests.conftest import CliResult, copy_tree
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.trainer_writer import WrittenTrainerRun

Cli = Callable[..., CliResult]

JSON_KEYS = {"schema_version", "run", "dry_run", "needed", "target", "actions"}


def test_help_needs_no_torch() -> None:
    proc = _run_without_torch("repair", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Examples" in proc.stdout and "--undo" in proc.stdout


def test_a_good_run_needs_nothing_and_exits_0(run_cli: Cli, demo_dir: Path) -> None:
    result = run_cli("repair", demo_dir / "native", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert set(doc) >= JSON_KEYS and doc["needed"] is False and doc["actions"] == []
    assert doc["target"]["url"] == str(demo_dir / "native" / "step-30") and doc["target"]["step"] == 30


def test_plan_exits_1_then_yes_repairs(
    run_cli: Cli, deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path: Path
) -> None:
    save_dir = copy_tree(deepspeed_runs[2].save_dir, tmp_path / "ds")
    next((save_dir / "global_step4").glob("*zero_pp_rank_1_*optim_states.pt")).unlink()
    for args in ((), ("--dry-run",)):
        result = run_cli("repair", save_dir, *args, "--json")
        assert result.exit_code == 1, result.stderr
        doc = result.json
        assert doc["dry_run"] is True and doc["needed"] is True
        assert doc["target"] == {"url": str(save_dir / "global_step2"), "step": 2, "layout": "deepspeed"}
        assert doc["actions"] == [
            {
                "kind": "pointer",
                "path": str(save_dir / "latest"),
                "before": "global_step4",
                "after": "global_step2",
                "link": False,
            }
        ]
        assert (save_dir / "latest").read_text() == "global_step4"
    human = run_cli("repair", save_dir)
    assert human.exit_code == 1 and "global_step2" in human.stdout and "-y" in human.stdout
    done = run_cli("repair", save_dir, "-y", "--json")
    assert done.exit_code == 0, done.stderr
    assert done.json["dry_run"] is False and (save_dir / "latest").read_text() == "global_step2"
    assert run_cli("repair", save_dir).exit_code == 0

    undo = {"kind": "pointer", "path": str(save_dir / "latest"), "before": "global_step2", "after": "global_step4"}
    plan = run_cli("repair", save_dir, "--undo", "--json")
    assert plan.exit_code == 1 and plan.json["actions"] == [{**undo, "link": False}] and plan.json["left"] == []
    undone = run_cli("repair", save_dir, "--undo", "-y", "--json")
    assert undone.exit_code == 0, undone.stderr
    assert undone.json["dry_run"] is False and undone.json["actions"] == plan.json["actions"]
    assert (save_dir / "latest").read_text() == "global_step4" and not (save_dir / ".ckptctl-trash").exists()
    assert run_cli("repair", save_dir, "--undo").exit_code == 0  # nothing left to undo


def test_quarantine_and_undo(run_cli: Cli, trainer_run: WrittenTrainerRun, tmp_path: Path) -> None:
    out = copy_tree(trainer_run.output_dir, tmp_path / "out")
    (out / "checkpoint-4" / "model.safetensors").write_bytes(b"torn")
    original = (out / "checkpoint-4" / "optimizer.pt").read_bytes()
    result = run_cli("repair", out, "-y", "--json")
    assert result.exit_code == 0, result.stderr
    (action,) = result.json["actions"]
    assert action["kind"] == "quarantine" and action["path"] == str(out / "checkpoint-4")
    assert not (out / "checkpoint-4").exists() and Path(action["after"]).is_dir()
    assert run_cli("list", out, "--json").json["checkpoints"][-1]["url"] == str(out / "checkpoint-2")

    plan = run_cli("repair", out, "--undo", "--json")
    assert plan.exit_code == 1 and plan.json["actions"][0]["after"] == str(out / "checkpoint-4")
    undone = run_cli("repair", out, "--undo", "-y")
    assert undone.exit_code == 0, undone.stderr
    assert (out / "checkpoint-4" / "optimizer.pt").read_bytes() == original
    assert not (out / ".ckptctl-trash").exists()  # nothing of ckptctl's is left behind
    assert run_cli("repair", out, "--undo").exit_code == 0  # nothing left to undo


def test_undo_exits_1_when_a_pointer_was_written_anew(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    run = copy_tree(demo_dir / "native", tmp_path / "native")
    (run / "step-30" / "model.safetensors").unlink()
    assert run_cli("repair", run, "-y").exit_code == 0
    (run / "latest").write_text("step-10\n")
    result = run_cli("repair", run, "--undo", "-y", "--json")
    assert result.exit_code == 1 and result.json["actions"] == [] and len(result.json["left"]) == 1
    assert "written anew" in result.stderr and (run / "latest").read_text() == "step-10\n"


def test_bad_input_exits_2(run_cli: Cli, tmp_path: Path) -> None:
    assert run_cli("repair", tmp_path / "missing").exit_code == 2
