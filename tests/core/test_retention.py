"""Retention: the pure plan, and how the manager applies it after each commit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as hs

from ckptctl.core import CheckpointManager, Decision, RetentionPolicy


def kept(policy: RetentionPolicy, steps: list[int]) -> list[int]:
    return [d.step for d in policy.plan(steps) if d.keep]


def test_keep_last() -> None:
    assert kept(RetentionPolicy(keep_last=2), [10, 30, 20, 40]) == [30, 40]


def test_keep_every_and_keep_last_compose_with_any() -> None:
    plan = RetentionPolicy(keep_last=1, keep_every=100).plan([50, 100, 150, 200, 250])
    assert plan == [
        Decision(50, False, ("no rule keeps it",)),
        Decision(100, True, ("keep_every=100",)),
        Decision(150, False, ("no rule keeps it",)),
        Decision(200, True, ("keep_every=100",)),
        Decision(250, True, ("newest", "keep_last=1")),
    ]


def test_the_newest_is_kept_even_when_no_rule_matches() -> None:
    assert kept(RetentionPolicy(keep_every=1000), [1, 2, 3]) == [3]


def test_no_rule_keeps_everything() -> None:
    assert kept(RetentionPolicy(), [1, 2, 3]) == [1, 2, 3]
    assert RetentionPolicy().plan([]) == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_invalid_rules_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        RetentionPolicy(keep_last=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RetentionPolicy(keep_every=bad)  # type: ignore[arg-type]


policies = hs.builds(
    RetentionPolicy,
    keep_last=hs.none() | hs.integers(1, 10),
    keep_every=hs.none() | hs.integers(1, 50),
)


@given(policies, hs.lists(hs.integers(0, 500), max_size=40))
def test_plan_properties(policy: RetentionPolicy, steps: list[int]) -> None:
    plan = policy.plan(steps)
    assert [d.step for d in plan] == sorted(set(steps))
    assert policy.plan(list(reversed(steps))) == plan  # pure and order-insensitive
    if steps:
        assert plan[-1].keep and "newest" in plan[-1].reasons
    for d in plan:
        by_last = policy.keep_last is not None and d.step in sorted(set(steps))[-policy.keep_last :]
        by_every = policy.keep_every is not None and d.step % policy.keep_every == 0
        everything = policy.keep_last is None and policy.keep_every is None
        assert d.keep == (by_last or by_every or everything or d.step == max(steps))
        assert d.reasons


def save_steps(manager: CheckpointManager, steps: list[int]) -> None:
    state = {"w": torch.zeros(4)}
    for step in steps:
        manager.save(step, state)


def folders(run: Path) -> set[str]:
    return {p.name for p in run.iterdir()}


def test_manager_applies_keep_last_and_keep_every(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir, policy=RetentionPolicy(keep_last=2, keep_every=4))
    save_steps(manager, [1, 2, 3, 4, 5, 6, 7])
    assert manager.all_steps() == [4, 6, 7]
    assert folders(run_dir) == {"step-4", "step-6", "step-7", "latest", ".ckptctl-trash"}
    assert not os.listdir(run_dir / ".ckptctl-trash")


def test_manager_never_deletes_what_latest_names(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir, policy=RetentionPolicy(keep_last=2))
    save_steps(manager, [10, 20, 30, 5])  # a rewind: the last commit is an older step
    assert (run_dir / "latest").read_text() == "step-5\n"
    assert manager.all_steps() == [5, 20, 30]


def test_manager_leaves_staging_folders_and_empties_old_trash(run_dir: Path) -> None:
    staging = run_dir / ".step-9.staging-abcd"
    (staging).mkdir(parents=True)
    leftover = run_dir / ".ckptctl-trash" / "step-3.dead"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"x")
    manager = CheckpointManager(run_dir, policy=RetentionPolicy(keep_last=1))
    save_steps(manager, [1, 2])
    assert staging.is_dir()
    assert not leftover.exists()
    assert manager.all_steps() == [2]
