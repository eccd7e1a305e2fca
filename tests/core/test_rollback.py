"""A run that goes back to an older step and saves again continues on that branch: save 10, 20, 30;
`restore(step=10)`; save 20 again. Every resume (a fresh process's `restore()`, `resume-plan`, `verify
--latest`) picks the new step 20, never the abandoned step 30; `list` and `prune` say why. A save killed
between marking the newer steps superseded and its commit leaves a run that resumes from the rollback's
base.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from ckptctl.core import CheckpointManager, CheckpointWarning
from tests.core import _workers
from tests.core.conftest import InterruptedSaves, roll_back


def by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {os.path.basename(item["url"]): item for item in items}


@pytest.fixture
def rolled_back(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    roll_back(run)
    return run


def test_every_resume_follows_the_branch_the_run_is_on(interrupted_saves: InterruptedSaves, run_cli: Any) -> None:
    run, crashed = interrupted_saves.rolled_back, interrupted_saves.crashed_rollback
    # restore() in a process that never saw the run: the new step 20 (its numbers are 21), not step 30
    assert interrupted_saves.fresh[1] == {"restored": 20, "values": [21.0]}
    # killed after the marks, before its commit: the run resumes from the step it had rolled back to
    assert interrupted_saves.fresh[2] == {"restored": 10, "values": [10.0]}

    for folder, resumed in ((run, "step-20"), (crashed, "step-10")):
        plan = run_cli("resume-plan", folder, "--json")
        assert plan.exit_code == 0, plan.stderr
        assert os.path.basename(plan.json["checkpoint"]["url"]) == resumed
        assert plan.json["resume_hint"] == f"CheckpointManager({str(folder)!r}).restore(state)"  # no step needed
        verified = run_cli("verify", folder, "--latest", "--json")
        assert verified.exit_code == 0 and [os.path.basename(r["url"]) for r in verified.json["results"]] == [resumed]

    skipped = run_cli("resume-plan", run, "--json").json["skipped"]
    assert [(os.path.basename(s["url"]), s["state"]) for s in skipped] == [("step-30", "superseded")]
    assert skipped[0]["reason"].startswith("superseded by step-20: the run went back to an older step")

    listed = by_name(run_cli("list", run, "--json").json["checkpoints"])
    assert {name: (c["state"], c["latest"]) for name, c in listed.items()} == {
        "step-10": ("complete", False),
        "step-20": ("complete", True),
        "step-30": ("superseded", False),
    }
    crashed_list = by_name(run_cli("list", crashed, "--json").json["checkpoints"])
    assert {name: c["state"] for name, c in crashed_list.items() if not name.startswith(".")} == {
        "step-10": "complete",
        "step-20": "superseded",  # the old step 20: the rollback was on its way past it
        "step-30": "superseded",
    }

    pruned = run_cli("prune", run, "--keep-last", "1", "--grace", "0s", "--dry-run", "--json")
    keep, delete = by_name(pruned.json["keep"]), by_name(pruned.json["delete"])
    assert list(keep) == ["step-20"]
    assert keep["step-20"]["reasons"][:2] == ["newest complete", "named by the run's latest pointer"]
    assert sorted(delete) == ["step-10", "step-30"]
    assert delete["step-30"]["state"] == "superseded"
    assert delete["step-30"]["reasons"][0].startswith("superseded by step-20")


def test_the_new_branch_replaces_superseded_steps_as_it_reaches_them(rolled_back: Path) -> None:
    manager = CheckpointManager(rolled_back)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing newer is left on the old branch: no rollback to report
        manager.save(30, _workers.small_state(31.0))
        manager.save(40, _workers.small_state(41.0))
    manager.close()
    assert sorted(os.listdir(rolled_back)) == ["latest", "step-10", "step-20", "step-30", "step-40"]
    assert not list(rolled_back.glob("step-*/ckptctl-superseded.json"))
    state = _workers.small_state(-1.0)
    assert CheckpointManager(rolled_back).restore(state, step=30) == 30 and state["counter"] == {"step": 31.0}


def test_a_superseded_step_restores_when_named_with_a_warning(rolled_back: Path) -> None:
    state = _workers.small_state(-1.0)
    with pytest.warns(CheckpointWarning, match=r"restoring step-30, which is off the run's branch"):
        assert CheckpointManager(rolled_back).restore(state, step=30) == 30
    assert state["counter"] == {"step": 30.0}
