"""Run folders that are a checkpoint and hold checkpoints (issue 10): every command sees the model at the
top as its own checkpoint and each checkpoint below it as one, and none acts on one for the other.

The runs are real (`tests.writers.run_folders`): the HF Trainer's `output_dir` after `Trainer.train()` and
`trainer.save_model()`, a DCP run and a DeepSpeed save folder each with an exported model beside its steps.
The checks take the run's URL, so that `tests/s3/test_nested_runs.py` runs the same ones on object stores.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from ckptctl import io
from tests.conftest import CliResult, copy_tree
from tests.writers.run_folders import NestedRun

Cli = Callable[..., CliResult]
KINDS = ("hf_trainer", "dcp", "deepspeed")


def run_json(run_cli: Cli, *args: str, code: int = 0) -> Any:
    result = run_cli(*args, "--json")
    assert result.exit_code == code, result.stderr
    assert "Traceback" not in result.stderr
    return result.json


def child(url: str, name: str) -> str:
    return io.join(url, name)


def model_digests(url: str, run: NestedRun) -> dict[str, str]:
    """sha256 of each file of the model at the top of the run."""
    return {name: hashlib.sha256(io.read_bytes(io.join(url, name))).hexdigest() for name in run.model_files}


# ------------------------------------------------------------------ checks shared with the S3 tests


def check_list(run_cli: Cli, url: str, run: NestedRun) -> None:
    """`list` shows the model at the top as its own entry, and each checkpoint below it once."""
    listed = {c["url"]: c for c in run_json(run_cli, "list", url)["checkpoints"]}
    assert sorted(listed) == sorted([url, *(child(url, name) for name in run.checkpoints)])
    assert (listed[url]["layout"], listed[url]["step"], listed[url]["state"]) == ("hf", None, "complete")
    own = sum(e.size for e in io.list_dir(url) if not e.is_dir)
    assert listed[url]["size_bytes"] == own, "the model's size counts its own files only"
    for name in run.checkpoints:
        entry = listed[child(url, name)]
        step = int(re.search(r"\d+$", name).group())  # type: ignore[union-attr]
        assert (entry["layout"], entry["step"], entry["state"]) == (run.layout, step, "complete")
    # DeepSpeed's `latest` names its newest tag; the Trainer and DCP keep no pointer.
    assert listed[child(url, run.newest)]["latest"] is (run.layout == "deepspeed")


def check_verify(run_cli: Cli, url: str, run: NestedRun) -> None:
    """`verify RUN` checks the model and each checkpoint on its own, and all pass."""
    report = run_json(run_cli, "verify", url)
    assert report["ok"] is True
    results = {r["url"]: r for r in report["results"]}
    assert sorted(results) == sorted([url, *(child(url, name) for name in run.checkpoints)])
    assert results[url]["layout"] == "hf"
    assert all(r["ok"] and not r["problems"] for r in results.values()), report


def check_convert(run_cli: Cli, url: str, run: NestedRun, out: Path) -> None:
    """`convert RUN OUT` converts the model at the top: the output holds exactly its tensors."""
    done = run_json(run_cli, "convert", url, str(out))
    assert done["checkpoint"] == url and done["layout"] == "hf"
    local_model = out.parent / "source-model.safetensors"
    local_model.write_bytes(io.read_bytes(io.join(url, "model.safetensors")))
    expected = load_file(str(local_model))
    written: dict[str, Any] = {}
    for name in done["files"]:
        if name.endswith(".safetensors"):
            written.update(load_file(str(out / name)))
    assert sorted(written) == sorted(expected)
    assert all(written[k].equal(expected[k]) for k in expected)


def check_resume_target(run_cli: Cli, url: str, run: NestedRun) -> None:
    """`resume-plan` and `verify --latest` pick the newest checkpoint, not the model at the top."""
    plan = run_json(run_cli, "resume-plan", url)
    assert plan["checkpoint"]["url"] == child(url, run.newest)
    latest = run_json(run_cli, "verify", url, "--latest")
    assert [(r["url"], r["ok"]) for r in latest["results"]] == [(child(url, run.newest), True)]


def check_prune(run_cli: Cli, url: str, run: NestedRun) -> None:
    """`prune --keep-last 1` deletes every checkpoint but the newest and leaves the model's files as they
    were (`url` is a copy the check may change)."""
    before = model_digests(url, run)
    report = run_json(run_cli, "prune", url, "--keep-last", "1", "--grace", "0s", "--yes")
    assert sorted(d["url"] for d in report["delete"]) == sorted(child(url, n) for n in run.checkpoints[:-1])
    assert {k["url"] for k in report["keep"]} == {url, child(url, run.newest)}
    assert model_digests(url, run) == before
    files = sorted(e.name for e in io.list_dir(url) if not e.is_dir)
    assert files == sorted(run.model_files), "prune adds nothing to the model's folder and leaves no lock"
    listed = [c["url"] for c in run_json(run_cli, "list", url)["checkpoints"]]
    assert sorted(listed) == sorted([url, child(url, run.newest)])


# ------------------------------------------------------------------------------------ local runs


@pytest.mark.parametrize("kind", KINDS)
def test_list_shows_the_model_and_each_checkpoint(run_cli: Cli, nested_runs: dict[str, NestedRun], kind: str) -> None:
    run = nested_runs[kind]
    check_list(run_cli, str(run.path), run)


@pytest.mark.parametrize("kind", KINDS)
def test_verify_checks_each_on_its_own(run_cli: Cli, nested_runs: dict[str, NestedRun], kind: str) -> None:
    run = nested_runs[kind]
    check_verify(run_cli, str(run.path), run)


@pytest.mark.parametrize("kind", KINDS)
def test_convert_converts_the_model_at_the_top(
    run_cli: Cli, nested_runs: dict[str, NestedRun], kind: str, tmp_path: Path
) -> None:
    run = nested_runs[kind]
    check_convert(run_cli, str(run.path), run, tmp_path / "out")


@pytest.mark.parametrize("kind", KINDS)
def test_resume_plan_and_verify_latest_pick_the_newest_checkpoint(
    run_cli: Cli, nested_runs: dict[str, NestedRun], kind: str
) -> None:
    run = nested_runs[kind]
    check_resume_target(run_cli, str(run.path), run)


@pytest.mark.parametrize("kind", KINDS)
def test_prune_deletes_old_checkpoints_and_never_the_model(
    run_cli: Cli, nested_runs: dict[str, NestedRun], kind: str, tmp_path: Path
) -> None:
    run = nested_runs[kind]
    copy = copy_tree(run.path, tmp_path / "run")
    check_prune(run_cli, str(copy), run)
    for name in run.checkpoints[:-1]:
        assert not (copy / name).exists()
    assert not any((copy / ".ckptctl-trash").glob("*")), "the deleted checkpoints are gone from the trash too"


def dcp_run_with_an_export_in_a_step(run: NestedRun, path: Path) -> Path:
    """A copy of the DCP run whose `step-2/` also holds an HF export of the model (`step-2/hf/`)."""
    copy = copy_tree(run.path, path)
    export = copy / "step-2" / "hf"
    export.mkdir()
    for name in run.model_files:
        (export / name).write_bytes((run.path / name).read_bytes())
    return copy


def check_prune_of_a_checkpoint_holding_one(run_cli: Cli, url: str, run: NestedRun) -> None:
    """Deleting `step-2`, which holds `step-2/hf/`, deletes the step's own files and leaves the export."""
    step, export = child(url, "step-2"), child(child(url, "step-2"), "hf")
    listed = {c["url"]: c["layout"] for c in run_json(run_cli, "list", url)["checkpoints"]}
    assert listed == {url: "hf", step: "dcp", export: "hf", child(url, "step-4"): "dcp"}
    before = model_digests(export, run)

    report = run_json(run_cli, "prune", url, "--keep-last", "1", "--grace", "0s", "--yes")
    [deleted] = report["delete"]
    assert deleted["url"] == step
    assert deleted["size_bytes"] == sum(p.stat().st_size for p in (run.path / "step-2").iterdir())
    assert [e.name for e in io.list_dir(step)] == ["hf"]
    assert model_digests(export, run) == before
    listed = {c["url"]: c["layout"] for c in run_json(run_cli, "list", url)["checkpoints"]}
    assert listed == {url: "hf", export: "hf", child(url, "step-4"): "dcp"}


def test_deleting_a_checkpoint_that_holds_one_deletes_only_its_own_files(
    run_cli: Cli, nested_runs: dict[str, NestedRun], tmp_path: Path
) -> None:
    run = nested_runs["dcp"]
    check_prune_of_a_checkpoint_holding_one(run_cli, str(dcp_run_with_an_export_in_a_step(run, tmp_path / "run")), run)
