"""`ckptctl slim` as scripts and cron jobs use it: the JSON contract, exit codes, the prompt, the dry run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ckptctl.core.lock import RunLock
from ckptctl.io.trash import TRASH_NAME
from tests.conftest import CliResult, copy_tree
from tests.ops.test_prune import tree
from tests.ops.test_slim import adamw_run  # noqa: F401 (the module fixture)

Cli = Callable[..., CliResult]


@pytest.fixture
def run(adamw_run: Path, tmp_path: Path) -> Path:  # noqa: F811
    return copy_tree(adamw_run, tmp_path / "run")


def test_json_contract_and_exit_0(run_cli: Cli, run: Path) -> None:
    result = run_cli("slim", run, "--grace", "0", "-y", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert {"schema_version", "run", "dry_run", "slim", "keep", "freed_bytes"} <= set(doc)
    assert doc["schema_version"] == 1 and doc["run"] == str(run) and doc["dry_run"] is False
    assert [(s["url"], s["step"]) for s in doc["slim"]] == [(str(run / f"step-{s}"), s) for s in (10, 20)]
    assert all({"url", "step", "freed_bytes", "dropped"} <= set(s) for s in doc["slim"])
    assert doc["slim"][0]["dropped"] == ["optimizer", "rng", "scheduler"]
    assert doc["freed_bytes"] == sum(s["freed_bytes"] for s in doc["slim"]) > 0
    assert [(k["step"], k["reasons"][0]) for k in doc["keep"]] == [(30, "a resume would load it")]
    listed = run_cli("list", run, "--json")
    assert [c["state"] for c in listed.json["checkpoints"]] == ["slim", "slim", "complete"]
    assert run_cli("verify", run).exit_code == 0
    plan = run_cli("resume-plan", run, "--json")
    assert plan.json["checkpoint"]["step"] == 30


def test_dry_run_shows_the_bytes_and_changes_nothing(run_cli: Cli, run: Path) -> None:
    before = tree(run)
    result = run_cli("slim", run, "--grace", "0", "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert "dry run: would slim 2 checkpoint(s), freeing" in result.stdout
    assert "drops optimizer, rng, scheduler" in result.stdout
    doc = run_cli("slim", run, "--grace", "0", "--dry-run", "--json").json
    assert doc["dry_run"] is True and len(doc["slim"]) == 2 and doc["freed_bytes"] > 0
    assert tree(run) == before


def test_no_yes_without_a_terminal_exits_2_and_changes_nothing(run_cli: Cli, run: Path) -> None:
    before = tree(run)
    for args in ((), ("--json",)):
        result = run_cli("slim", run, "--grace", "0", *args)
        assert result.exit_code == 2
        assert "refusing to slim 2 checkpoint(s) without confirmation" in result.stderr
    assert tree(run) == before


def test_a_link_where_the_slim_version_goes_exits_2(run_cli: Cli, run: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (run / TRASH_NAME).symlink_to(tmp_path / "elsewhere")
    before = tree(run)
    result = run_cli("slim", run, "--grace", "0", "-y")
    assert result.exit_code == 2 and "symbolic link" in result.stderr
    assert tree(run) == before


def test_another_prune_or_slim_holding_the_run_exits_1(run_cli: Cli, run: Path) -> None:
    before = tree(run)
    with RunLock(str(run), wait=0):
        result = run_cli("slim", run, "--grace", "0", "-y", "--wait", "0")
    assert result.exit_code == 1
    assert {k: v for k, v in tree(run).items() if "lock" not in k} == {
        k: v for k, v in before.items() if "lock" not in k
    }


def test_bad_usage_exits_2(run_cli: Cli, run: Path, tmp_path: Path) -> None:
    assert run_cli("slim", run, "--older-than", "7").exit_code == 2
    assert run_cli("slim", run, "--keep-full", "0").exit_code == 2
    missing = run_cli("slim", tmp_path / "nope", "-y")
    assert missing.exit_code == 2 and "no such" in missing.stderr


def test_the_slim_table_of_the_policy_file_gives_the_rules(run_cli: Cli, run: Path) -> None:
    (run / "ckptctl.toml").write_text("[slim]\nkeep_full = 2\n")
    result = run_cli("slim", run, "--grace", "0", "-y", "--json")
    assert result.exit_code == 0, result.stderr
    assert "keep_full=2" in result.stderr and [s["step"] for s in result.json["slim"]] == [10]
    (run / "ckptctl.toml").write_text("[slim]\nkeep_fll = 2\n")
    assert run_cli("slim", run, "--grace", "0", "-y").exit_code == 2


def test_prune_slims_instead_of_deleting(run_cli: Cli, run: Path) -> None:
    result = run_cli("prune", run, "--keep-last", "1", "--grace", "0", "--slim", "-y", "--json")
    assert result.exit_code == 0, result.stderr
    assert not result.json["delete"] and [s["step"] for s in result.json["slim"]] == [10, 20]
    assert result.json["freed_bytes"] == sum(s["freed_bytes"] for s in result.json["slim"]) > 0
    listed = run_cli("list", run, "--json").json["checkpoints"]
    assert [c["state"] for c in listed] == ["slim", "slim", "complete"]
    again = run_cli("prune", run, "--keep-last", "1", "--grace", "0", "-y", "--json")
    assert [d["step"] for d in again.json["delete"]] == [10, 20]  # slim ones go by the rules like any other


def test_prune_keeps_older_checkpoints_slim_with_keep_full_last(run_cli: Cli, run: Path) -> None:
    (run / "ckptctl.toml").write_text('[retention]\nkeep_last = 3\nkeep_full_last = 1\ngrace = "0"\n')
    dry = run_cli("prune", run, "--dry-run")
    assert dry.exit_code == 0 and "would delete 0 checkpoint(s) and slim 2" in dry.stdout
    result = run_cli("prune", run, "-y", "--json")
    assert result.exit_code == 0, result.stderr
    assert [s["step"] for s in result.json["slim"]] == [10, 20] and not result.json["delete"]
