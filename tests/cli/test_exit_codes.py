"""The exit codes scripts rely on (issue 11), and the small lies and noise around them."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult
from tests.ops.test_prune import write_run
from tests.writers.deepspeed_writer import WrittenDeepSpeed

Cli = Callable[..., CliResult]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run")


# --- verify --latest: the resume gate ---------------------------------------------------------------


def _gate(run_folder: Path) -> subprocess.CompletedProcess[str]:
    """The README's resume gate, as a launch script runs it."""
    script = '"$0" -m ckptctl verify "$1" --latest -q && echo launched'
    return subprocess.run(
        ["bash", "-c", script, sys.executable, str(run_folder)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )


def test_the_resume_gate_lets_the_first_launch_through(tmp_path: Path) -> None:
    gate = _gate(tmp_path / "runs" / "new-run")  # the output folder does not exist yet
    assert gate.returncode == 0 and gate.stdout == "launched\n", gate.stderr


@pytest.mark.parametrize("what", ["missing", "empty", "first save in progress"])
def test_verify_latest_on_a_run_with_nothing_saved_is_a_fresh_start(run_cli: Cli, tmp_path: Path, what: str) -> None:
    folder = tmp_path / "run"
    if what != "missing":
        folder.mkdir()
    if what == "first save in progress":  # CheckpointManager's staging folder, before its manifest exists
        (folder / ".step-10.staging-a1b2c3").mkdir()
        (folder / ".step-10.staging-a1b2c3" / "model.safetensors").write_bytes(b"\0" * 64)
    human = run_cli("verify", folder, "--latest")
    assert human.exit_code == 0 and human.stdout == ""
    assert "no checkpoint in" in human.stderr and "starts from scratch" in human.stderr
    doc = run_cli("verify", folder, "--latest", "--json")
    assert doc.exit_code == 0
    assert doc.json == {"schema_version": 1, "run": str(folder), "ok": True, "fresh_start": True, "results": []}


def test_verify_latest_on_a_run_whose_checkpoints_are_all_broken_fails(run_cli: Cli, run: Path) -> None:
    for step in (10, 20, 30, 40, 50, 60):
        (run / f"step-{step}" / "model.safetensors").unlink()
    assert _gate(run).returncode == 1 and _gate(run).stdout == ""
    result = run_cli("verify", run, "--latest", "--json")
    assert result.exit_code == 1 and result.json["error"]["exit_code"] == 1


def test_verify_latest_on_a_healthy_run_checks_the_newest(run_cli: Cli, run: Path) -> None:
    result = run_cli("verify", run, "--latest", "--json")
    assert result.exit_code == 0 and result.json["fresh_start"] is False
    assert [r["step"] for r in result.json["results"]] == [60]


# --- resume-plan --world-size ----------------------------------------------------------------------


def test_resume_plan_exits_1_when_it_cannot_load_on_the_ranks_asked(
    run_cli: Cli, deepspeed_runs: dict[int, WrittenDeepSpeed]
) -> None:
    zero2 = deepspeed_runs[2]
    same = run_cli("resume-plan", zero2.save_dir, "--world-size", "2", "--json")
    assert same.exit_code == 0 and same.json["world_size_ok"] is True
    other = run_cli("resume-plan", zero2.save_dir, "--world-size", "16", "--json")
    assert other.exit_code == 1 and other.json["world_size_ok"] is False
    hint = other.json["resume_hint"]
    assert "tag='global_step4_universal'" in hint and "below" not in hint and "ds_to_universal" in hint
    human = run_cli("resume-plan", zero2.save_dir, "--world-size", "16")
    assert human.exit_code == 1 and "ranks" in human.stdout and "ds_to_universal" in human.stdout


def test_resume_plan_on_a_cpu_save_says_nothing_about_cuda_unless_the_resume_uses_it(
    run_cli: Cli, demo_dir: Path
) -> None:
    cpu = run_cli("resume-plan", demo_dir / "native")  # this machine has no CUDA device
    assert cpu.exit_code == 0 and "CUDA" not in cpu.stderr, cpu.stderr
    assert run_cli("resume-plan", demo_dir / "native", "--no-cuda", "--json").json["warnings"] == []
    gpu = run_cli("resume-plan", demo_dir / "native", "--cuda")
    assert gpu.exit_code == 0 and "no CUDA generators" in gpu.stderr


# --- prune -------------------------------------------------------------------------------------------


def test_prune_exits_1_while_the_run_stays_over_budget_also_in_a_dry_run(run_cli: Cli, run: Path) -> None:
    budget = str(sum(f.stat().st_size for f in (run / "step-60").rglob("*") if f.is_file()) // 2)
    rules = ("--max-total-size", budget, "--grace", "0")
    dry = run_cli("prune", run, *rules, "--dry-run", "--json")
    assert dry.exit_code == 1 and "stays" in dry.json["unmet"][-1]
    deleting = run_cli("prune", run, *rules, "-y", "--json")
    assert deleting.exit_code == 1 and len(deleting.json["delete"]) == 5  # it deleted what it could
    assert sorted(p.name for p in run.glob("step-*")) == ["step-60"]
    again = run_cli("prune", run, *rules, "-y")
    assert again.exit_code == 1 and "over max_total_size" in again.stderr


def test_prune_exits_0_when_the_rules_are_met(run_cli: Cli, run: Path) -> None:
    dry = run_cli("prune", run, "--keep-last", "2", "--grace", "0", "--dry-run")
    assert dry.exit_code == 0 and "would delete 4" in dry.stdout
    done = run_cli("prune", run, "--keep-last", "2", "--grace", "0", "-y")
    assert done.exit_code == 0 and "warning" not in done.stderr
    assert run_cli("prune", run, "--keep-last", "2", "--grace", "0", "-y").exit_code == 0


def test_keep_best_with_a_metric_no_checkpoint_records_is_bad_usage(run_cli: Cli, run: Path) -> None:
    result = run_cli("prune", run, "--keep-best", "eval_los", "--grace", "0", "-y")
    assert result.exit_code == 2
    assert "records the metric 'eval_los'" in result.stderr and "hint: metrics recorded: loss" in result.stderr
    assert len(list(run.glob("step-*"))) == 6
    assert run_cli("prune", run, "--keep-best", "loss", "--grace", "0", "--dry-run").exit_code == 0


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_declining_the_prompt_warns_once(run_cli: Cli, run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", _Terminal("n\n"))
    result = run_cli("prune", run, "--keep-last", "2", "--grace", "0")
    assert result.exit_code == 1 and "cancelled: nothing deleted" in result.stdout
    assert "warning" not in result.stderr and "not deleted" not in result.stderr
    assert len(list(run.glob("step-*"))) == 6


# --- small lies ----------------------------------------------------------------------------------------


def test_inspect_says_when_the_filter_matches_nothing(run_cli: Cli, run: Path) -> None:
    result = run_cli("inspect", run / "step-60", "--filter", "nomatch")
    assert result.exit_code == 0 and "no tensor matches the filter (of 4 tensors)" in result.stderr
    assert "tensors (" not in result.stdout


def test_inspect_resume_plan_and_convert_agree_on_components(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    inspected = run_cli("inspect", demo_dir / "native" / "step-30", "--json").json
    planned = run_cli("resume-plan", demo_dir / "native", "--json").json
    assert set(planned["restores"]) <= set(inspected["components"])
    assert set(planned["missing"]) <= set(inspected["missing_components"])
    assert "trainer_state" in inspected["components"] and "trainer_state" in planned["restores"]
    converted = run_cli("convert", demo_dir / "hf", tmp_path / "dcp", "--to", "dcp", "--json")
    assert converted.exit_code == 0 and "config.json" in converted.json["files"]
    result = run_cli("inspect", tmp_path / "dcp", "--json").json
    assert "config" in result["components"] and "config" not in result["missing_components"]


def test_demo_refuses_before_announcing_anything_and_shows_progress(run_cli: Cli, tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    refused = run_cli("demo", taken, "--force", "--no-distributed")
    assert refused.exit_code == 2 and refused.stderr.startswith("error: refusing to replace")
    assert "training" not in refused.stderr
    done = run_cli("demo", tmp_path / "demo", "--no-distributed", "--steps", "10")
    assert done.exit_code == 0, done.stderr
    assert done.stderr.splitlines()[0] == (
        f"training a tiny model for 10 steps into {tmp_path / 'demo'}/native (a checkpoint every 10)"
    )
    assert "saved native/step-10 (loss " in done.stderr and "exported the model to hf/" in done.stderr


def test_json_errors_are_one_document_on_stdout(run_cli: Cli, run: Path, tmp_path: Path) -> None:
    for argv in (
        ("verify", tmp_path / "nope", "--json"),
        ("resume-plan", tmp_path / "nope", "--json"),
        ("prune", run, "--json"),  # no rule: bad usage
        ("diff", run / "step-10", tmp_path / "nope", "--json"),
    ):
        result = run_cli(*argv)
        assert result.exit_code == 2, argv
        doc = result.json
        assert set(doc) == {"schema_version", "error"} and doc["schema_version"] == 1
        assert set(doc["error"]) == {"type", "message", "hint", "exit_code"}
        assert result.stderr.startswith(f"error: {doc['error']['message']}")


# --- the error document -------------------------------------------------------------------------------


def test_the_error_document_is_one_line_where_the_command_prints_json_lines(run_cli: Cli, tmp_path: Path) -> None:
    """`sync --watch --json` prints one document per line: the error that ends it is a line too; elsewhere the
    error document is indented as every other document is (and the next command's is again)."""
    args = ("sync", tmp_path / "missing", "memory://error-document/run", "--json")
    watched = run_cli(*args, "--watch", "--passes", "1")
    once = run_cli(*args)
    assert watched.exit_code == once.exit_code == 2
    assert watched.stdout.count("\n") == 1 and once.stdout.count("\n") > 1
    assert watched.json == once.json and once.json["error"]["type"] == "CheckpointNotFound"
