"""`ckptctl prune` as scripts and cron jobs use it: exit codes, JSON, the prompt, the policy file."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptctl.formats.manifest import MANIFEST_NAME
from tests.conftest import CliResult
from tests.ops.test_prune import tree, write_run

Cli = Callable[..., CliResult]
REPO = Path(__file__).resolve().parents[2]
RULES = ("--keep-last", "2", "--grace", "0")


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run")


def test_json_contract_and_exit_0(run_cli: Cli, run: Path) -> None:
    result = run_cli("prune", run, *RULES, "--keep-best", "loss", "-y", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert {"schema_version", "run", "dry_run", "keep", "delete", "freed_bytes"} <= set(doc)
    assert doc["schema_version"] == 1 and doc["run"] == str(run) and doc["dry_run"] is False
    assert [(k["step"], k["reasons"]) for k in doc["keep"]] == [
        (20, ["best loss (min) = 0.3"]),
        (50, ["keep_last=2"]),
        (60, ["newest complete", "named by the run's latest pointer", "keep_last=2"]),
    ]
    assert all({"url", "step", "reasons"} <= set(k) for k in doc["keep"])
    assert [(d["url"], d["step"]) for d in doc["delete"]] == [(str(run / f"step-{s}"), s) for s in (10, 30, 40)]
    assert all(d["size_bytes"] > 0 for d in doc["delete"])
    assert doc["freed_bytes"] == sum(d["size_bytes"] for d in doc["delete"])
    assert sorted(p.name for p in run.glob("step-*")) == ["step-20", "step-50", "step-60"]


def test_dry_run_changes_nothing(run_cli: Cli, run: Path) -> None:
    (run / ".ckptctl-trash").mkdir()
    (run / ".ckptctl-trash" / "leftover").write_text("x")
    before = tree(run)
    result = run_cli("prune", run, *RULES, "--dry-run", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["dry_run"] is True and len(result.json["delete"]) == 4
    assert result.json["freed_bytes"] > 0
    human = run_cli("prune", run, *RULES, "--dry-run")
    assert human.exit_code == 0
    assert "delete" in human.stdout and "dry run: would delete 4 checkpoint(s)" in human.stdout
    assert tree(run) == before


def test_no_terminal_and_no_yes_exits_2_and_deletes_nothing(run_cli: Cli, run: Path) -> None:
    before = tree(run)
    result = run_cli("prune", run, *RULES)
    assert result.exit_code == 2
    assert "refusing to delete 4 checkpoint(s) without confirmation" in result.stderr
    assert "--yes" in result.stderr
    assert tree(run) == before


def test_a_protected_checkpoint_is_a_note_and_a_broken_one_or_the_budget_exit_1(run_cli: Cli, run: Path) -> None:
    (run / "latest").write_text("step-10\n")
    first = run_cli("prune", run, *RULES, "-y", "--json")
    # A pointer keeps a complete checkpoint no rule keeps: the run is as its writer wants it (issue 33), so 0
    # with a note, not a failure mail from cron every night.
    assert first.exit_code == 0 and len(first.json["delete"]) == 3, first.stderr
    protected = "step-10 is protected (named by the run's latest pointer) although no rule keeps it"
    assert first.json["unmet"] == [] and first.json["notes"] == [protected]
    again = run_cli("prune", run, *RULES, "-y")
    assert again.exit_code == 0 and f"note: {protected}" in again.stderr and "warning" not in again.stderr
    # The same pointer naming a checkpoint that is no longer whole is a problem: a resume would load it.
    (run / "step-10" / MANIFEST_NAME).write_text("{")
    torn = run_cli("prune", run, *RULES, "-y", "--json")
    assert torn.exit_code == 1 and torn.json["unmet"] == [protected] and (run / "step-10").is_dir()
    budget = run_cli("prune", run, "--max-total-size", "1", "--grace", "0", "-y", "--json")
    assert budget.exit_code == 1 and len(budget.json["delete"]) == 1  # step-50 (only rules kept it); still over
    over = run_cli("prune", run, "--max-total-size", "1", "--grace", "0", "-y", "--json")
    assert over.exit_code == 1
    assert "over max_total_size=1B: only protected checkpoints are left" in over.json["unmet"][-1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--max-total-size", "lots"), "is not a size"),
        (("--older-than", "7"), "is not an age"),
        (("--keep-best", "loss:lowest"), "the mode after ':' must be min or max"),
        (("--keep-last", "0"), "--keep-last"),
        ((), "no retention rule given"),
    ],
)
def test_bad_usage_exits_2(run_cli: Cli, run: Path, args: tuple[str, ...], message: str) -> None:
    result = run_cli("prune", run, *args, "-y")
    assert result.exit_code == 2
    assert message in " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.stderr).split())  # unwrapped from typer's box
    assert len(list(run.glob("step-*"))) == 6


def test_a_missing_run_exits_2(run_cli: Cli, tmp_path: Path) -> None:
    result = run_cli("prune", tmp_path / "nope", *RULES, "-y")
    assert result.exit_code == 2 and result.stderr.startswith("error: no such run folder")


def test_the_policy_file_is_used_without_rule_options(run_cli: Cli, run: Path) -> None:
    (run / "ckptctl.toml").write_text('[retention]\nkeep_last = 3\ngrace = "0"\n')
    result = run_cli("prune", run, "-y", "--pin", "10", "--json")
    assert result.exit_code == 0, result.stderr
    assert "rules from ckptctl.toml: keep_last=3, pin=10" in result.stderr
    assert [d["step"] for d in result.json["delete"]] == [20, 30]
    flags_win = run_cli("prune", run, "--keep-last", "1", "--grace", "0", "-y", "--json")
    assert [d["step"] for d in flags_win.json["delete"]] == [10, 40, 50]
    (run / "ckptctl.toml").write_text("[retention]\nkeep_lsat = 3\n")
    bad = run_cli("prune", run, "-y")
    assert bad.exit_code == 2 and "unknown retention rule(s) keep_lsat" in bad.stderr


def _without_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from ckptctl.cli.app import main
        main({list(argv)!r})
        """
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_prune_needs_no_torch(run: Path) -> None:
    helped = _without_torch("prune", "--help")
    assert helped.returncode == 0 and "Examples" in helped.stdout, helped.stderr
    pruned = _without_torch(
        "prune", str(run), "--keep-last", "2", "--keep-best", "loss", "--grace", "0", "-y", "--json"
    )
    assert pruned.returncode == 0, pruned.stderr
    assert [d["step"] for d in json.loads(pruned.stdout)["delete"]] == [10, 30, 40]
    assert sorted(os.listdir(run)) == ["latest", "step-20", "step-50", "step-60"]


class _Terminal(io.StringIO):
    """stdin as a terminal where the user types `answer`."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("answer", "code", "left"), [("n\n", 1, 6), ("y\n", 0, 2)])
def test_the_prompt_on_a_terminal(
    run_cli: Cli, run: Path, monkeypatch: pytest.MonkeyPatch, answer: str, code: int, left: int
) -> None:
    monkeypatch.setattr(sys, "stdin", _Terminal(answer))
    result = run_cli("prune", run, *RULES)
    assert result.exit_code == code
    assert "Delete 4 checkpoint(s), freeing" in result.stderr
    assert ("cancelled: nothing deleted" in result.stdout) == (code == 1)
    assert len(list(run.glob("step-*"))) == left


def test_older_than_leaves_young_checkpoints_alone(run_cli: Cli, run: Path) -> None:
    result = run_cli("prune", run, "--older-than", "1h", "--grace", "0", "-y", "--json")
    assert result.exit_code == 0 and result.json["delete"] == []
    assert all("not older than 1h" in k["reasons"] for k in result.json["keep"])
