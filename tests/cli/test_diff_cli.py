"""`ckptctl diff` as scripts use it: exit codes, the JSON document, messages on stderr."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.cli.test_cli import _run_without_torch
from tests.conftest import CliResult

Cli = Callable[..., CliResult]

JSON_KEYS = {"schema_version", "a", "b", "equal", "only_in_a", "only_in_b", "changed", "equal_count", "compared"}


def test_help_needs_no_torch() -> None:
    proc = _run_without_torch("diff", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Examples" in proc.stdout and "--atol" in proc.stdout


def test_equal_checkpoints_exit_0(run_cli: Cli, demo_dir: Path) -> None:
    result = run_cli("diff", demo_dir / "dcp" / "step-30", demo_dir / "distributed" / "step-30", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert set(doc) >= JSON_KEYS and doc["schema_version"] == 1
    assert doc["equal"] is True and doc["changed"] == [] and doc["equal_count"] == doc["compared"] == 16
    assert doc["a"] == str(demo_dir / "dcp" / "step-30")
    assert result.stderr == ""

    human = run_cli("diff", demo_dir / "native" / "step-30", demo_dir / "hf")
    assert human.exit_code == 0
    assert "16 equal (16 bit-identical)" in human.stdout and human.stdout.rstrip().endswith("equal")


def test_different_checkpoints_exit_1_with_the_most_changed_first(run_cli: Cli, demo_dir: Path) -> None:
    a, b = demo_dir / "native" / "step-10", demo_dir / "native" / "step-30"
    result = run_cli("diff", a, b, "--json", "--top", "2")
    assert result.exit_code == 1
    doc = result.json
    assert doc["equal"] is False and doc["changed_count"] == 16 and len(doc["changed"]) == 2
    first, second = doc["changed"]
    assert set(first) >= {"name", "kind", "max_abs_diff", "rel_l2"} and first["kind"] == "values"
    assert first["rel_l2"] >= second["rel_l2"] > 0

    human = run_cli("diff", a, b, "--top", "3")
    assert human.exit_code == 1
    assert "changed (3 of 16, most changed first)" in human.stdout and "different" in human.stdout
    assert first["name"] in human.stdout

    # Within a loose tolerance the same pair is equal.
    loose = run_cli("diff", a, b, "--atol", "1", "--json", "--all")
    assert loose.exit_code == 0 and loose.json["equal"] is True
    assert len(loose.json["equal_tensors"]) == 16


def test_errors_exit_2(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    missing = run_cli("diff", tmp_path / "nope", demo_dir / "hf", "--json")
    assert missing.exit_code == 2 and missing.json["error"]["exit_code"] == 2 and missing.stderr.startswith("error: ")
    bad_rename = run_cli("diff", demo_dir / "hf", demo_dir / "hf", "--rename", "(=x")
    assert bad_rename.exit_code == 2 and "regular expression" in bad_rename.stderr
    bad_component = run_cli("diff", demo_dir / "hf", demo_dir / "hf", "--component", "weights")
    assert bad_component.exit_code == 2
    absent = run_cli("diff", demo_dir / "native" / "step-30", demo_dir / "hf", "--component", "optimizer")
    assert absent.exit_code == 2 and "holds no optimizer tensors" in absent.stderr and "hint: " in absent.stderr
    assert "Traceback" not in absent.stderr


def test_json_is_strict_and_complete(run_cli: Cli, hf_model_dirs: dict[str, Path]) -> None:
    result = run_cli("diff", hf_model_dirs["single"], hf_model_dirs["sharded"], "--json")
    assert result.exit_code == 0
    doc = result.json
    json.dumps(doc, allow_nan=False)
    assert doc["metadata"] == [{"field": "weight_files", "a": 1, "b": doc["metadata"][0]["b"]}]
    assert doc["layouts"] == {"a": "hf", "b": "hf"} and doc["component"] == "model"
