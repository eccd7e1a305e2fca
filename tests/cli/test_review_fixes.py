"""Regressions from the code review: each test failed before its fix."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.manifest import MANIFEST_NAME, parse_manifest
from tests.conftest import CliResult, copy_tree

Cli = Callable[..., CliResult]


@pytest.mark.parametrize("damage", ["grow", "delete"])
def test_recorded_digests_catch_a_resized_or_missing_file(
    run_cli: Cli, demo_dir: Path, tmp_path: Path, damage: str
) -> None:
    folder = copy_tree(demo_dir / "dcp" / "step-30", tmp_path / "step-30")
    assert run_cli("verify", folder, "--write-manifest", "--json").exit_code == 0
    victim = sorted(folder.glob("*.distcp"))[0]
    if damage == "grow":
        with victim.open("ab") as f:
            f.write(b"\0\0\0\0")
    else:
        victim.unlink()
    result = run_cli("verify", folder, "--json")
    assert result.exit_code == 1
    kinds = {(p["kind"], p["path"]) for p in result.json["problems"]}
    expected = "size_mismatch" if damage == "grow" else "missing_file"
    assert (expected, victim.name) in kinds


@pytest.mark.parametrize("name", ["/etc/passwd", "../../escape", "a/../../b", "a//b", "a\\b", ""])
def test_manifest_names_leaving_the_folder_are_refused(name: str) -> None:
    doc = {"format": "ckptctl-digests", "created": "", "files": {name: {"size": 1, "blake3": "00"}}}
    with pytest.raises(CorruptCheckpoint, match="leaves the checkpoint folder"):
        parse_manifest(json.dumps(doc), "ckptctl-digests.json")


def test_json_output_is_strict_when_a_metric_is_nan(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    folder = copy_tree(demo_dir / "native" / "step-30", tmp_path / "step-30")
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["metrics"] = {"loss": float("nan")}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    result = run_cli("inspect", folder, "--json")
    assert result.exit_code == 0
    assert "NaN" not in result.stdout
    assert json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))["metadata"][
        "metrics"
    ] == {"loss": None}


def test_verify_latest_checks_what_resume_plan_picks(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    run = copy_tree(demo_dir / "native", tmp_path / "native")
    (run / "step-30" / "model.safetensors").unlink()  # the newest is broken: a resume takes step 20
    plan = run_cli("resume-plan", run, "--json")
    assert plan.exit_code == 0 and plan.json["checkpoint"]["step"] == 20
    result = run_cli("verify", run, "--latest", "--json")
    assert result.exit_code == 0
    assert [r["step"] for r in result.json["results"]] == [20]


def test_verify_latest_with_nothing_resumable_exits_1(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    run = copy_tree(demo_dir / "native", tmp_path / "native")
    for step in (10, 20, 30):
        (run / f"step-{step}" / "model.safetensors").unlink()
    result = run_cli("verify", run, "--latest")
    assert result.exit_code == 1
    assert "no checkpoint a resume could load" in result.stderr


def test_verify_on_a_file_says_to_pass_its_folder(run_cli: Cli, hf_model_dirs: dict[str, Path]) -> None:
    # A weights file is a checkpoint of its own since issue 11 (tests/cli/test_single_files.py); any
    # other file still gets the hint.
    result = run_cli("verify", hf_model_dirs["single"] / "config.json")
    assert result.exit_code == 2
    assert "is a file" in result.stderr


def test_convert_force_never_replaces_a_run_folder_or_the_working_folder(
    run_cli: Cli, demo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = demo_dir / "dcp" / "step-30"
    raw = ("--mapping", "none")  # the demo's toy model has no config: its stored names, as asked
    run = copy_tree(demo_dir / "native", tmp_path / "native")  # holds sub-folders, no ckptctl-digests.json
    before = sorted(p.name for p in run.iterdir())
    refused = run_cli("convert", source, run, "--force", *raw)
    assert refused.exit_code == 2
    assert "not an earlier export" in refused.stderr
    assert sorted(p.name for p in run.iterdir()) == before

    monkeypatch.chdir(run / "step-30")
    assert run_cli("convert", source, run, "--force", *raw).exit_code == 2  # a parent of the working folder

    export = tmp_path / "export"
    assert run_cli("convert", source, export, *raw).exit_code == 0
    again = run_cli("convert", source, export, "--force", "--json", *raw)
    assert again.exit_code == 0, again.stderr
