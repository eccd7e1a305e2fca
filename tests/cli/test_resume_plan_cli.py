"""`ckptctl resume-plan` as scripts use it: exit codes, the JSON document, warnings on stderr."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from tests.cli.test_cli import _run_without_torch
from tests.conftest import CliResult, copy_tree

Cli = Callable[..., CliResult]

JSON_KEYS = {"schema_version", "run", "checkpoint", "skipped", "restores", "missing", "world_size_ok", "resume_hint"}


def test_help_needs_no_torch() -> None:
    proc = _run_without_torch("resume-plan", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Examples" in proc.stdout and "--world-size" in proc.stdout


def test_plan_exits_0(run_cli: Cli, demo_dir: Path) -> None:
    run = demo_dir / "native"
    result = run_cli("resume-plan", run, "--world-size", "4", "--cuda", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert set(doc) >= JSON_KEYS and {"warnings", "continues_from", "bytes_per_rank"} <= set(doc)
    assert doc["checkpoint"] == {
        "url": str(run / "step-30"),
        "step": 30,
        "layout": "native",
        "epoch": None,
        "created": doc["checkpoint"]["created"],
        "framework": "ckptctl",
    }
    assert doc["skipped"] == [] and doc["world_size_ok"] is True and doc["bytes_per_rank"] > 0
    assert doc["restores"][:2] == ["model", "optimizer"] and doc["missing"] == ["dataloader"]
    assert doc["resume_hint"] == f"CheckpointManager({str(run)!r}).restore(state)"
    assert "warning: " in result.stderr  # warnings go to stderr too

    human = run_cli("resume-plan", run)
    assert human.exit_code == 0
    assert "resume from" in human.stdout and "step-30" in human.stdout and "CheckpointManager" in human.stdout
    quiet = run_cli("resume-plan", run, "-q")
    assert quiet.exit_code == 0 and quiet.stdout == "" and quiet.stderr == ""


def test_skipped_checkpoints_are_listed(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    run = copy_tree(demo_dir / "dcp", tmp_path / "dcp")
    (run / "step-30" / ".metadata").unlink()  # an interrupted save of step 30
    result = run_cli("resume-plan", run, "--json")
    assert result.exit_code == 0
    doc = result.json
    assert doc["checkpoint"]["step"] == 20
    assert doc["skipped"] == [
        {
            "url": str(run / "step-30"),
            "step": 30,
            "reason": "in progress: no .metadata yet",
            "layout": "dcp",
            "state": "in_progress",
        }
    ]
    human = run_cli("resume-plan", run)
    assert "skipped" in human.stdout and "in progress" in human.stdout


def test_nothing_resumable_exits_1(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(demo_dir / "dcp" / "step-10", run / "step-10")
    (run / "step-10" / ".metadata").unlink()
    result = run_cli("resume-plan", run, "--json")
    assert result.exit_code == 1
    assert result.json["checkpoint"] is None and result.json["resume_hint"] is None
    assert len(result.json["skipped"]) == 1
    human = run_cli("resume-plan", run)
    assert human.exit_code == 1 and "nothing resumable" in human.stdout


def test_errors_exit_2(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    missing = run_cli("resume-plan", tmp_path / "nope", "--json")
    assert missing.exit_code == 2 and missing.json["error"]["exit_code"] == 2 and missing.stderr.startswith("error: ")
    several = run_cli("resume-plan", demo_dir)
    assert several.exit_code == 2 and "several runs" in several.stderr and "hint: pass one of them" in several.stderr
    bad = run_cli("resume-plan", demo_dir / "native", "--world-size", "0")
    assert bad.exit_code == 2
    unknown = run_cli("resume-plan", demo_dir / "native", "--layout", "nope")
    assert unknown.exit_code == 2 and "known layouts" in unknown.stderr
