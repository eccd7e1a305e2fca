"""Retention: the pure plan (rules, protections, budget), and how the manager applies it after each commit."""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from ckptctl import io
from ckptctl.core import Candidate, CheckpointManager, CheckpointWarning, Decision, KeepBest, RetentionPolicy
from ckptctl.errors import StorageError
from ckptctl.formats.manifest import MANIFEST_NAME
from ckptctl.io import trash
from ckptctl.units import format_age, format_size, parse_age, parse_size

NOW = datetime(2026, 1, 31, tzinfo=UTC)


def kept(policy: RetentionPolicy, steps: list[int]) -> list[int | None]:
    return [d.step for d in policy.plan(steps) if d.keep]


def by_url(decisions: list[Decision]) -> dict[str, Decision]:
    return {d.url: d for d in decisions}


def test_keep_last() -> None:
    assert kept(RetentionPolicy(keep_last=2), [10, 30, 20, 40]) == [30, 40]


def test_keep_every_and_keep_last_compose_with_any() -> None:
    plan = RetentionPolicy(keep_last=1, keep_every=100).plan([50, 100, 150, 200, 250])
    assert plan == [
        Decision(50, False, ("no rule keeps it",), "50"),
        Decision(100, True, ("keep_every=100",), "100"),
        Decision(150, False, ("no rule keeps it",), "150"),
        Decision(200, True, ("keep_every=100",), "200"),
        Decision(250, True, ("newest complete", "keep_last=1"), "250"),
    ]


def test_the_newest_is_kept_even_when_no_rule_matches() -> None:
    assert kept(RetentionPolicy(keep_every=1000), [1, 2, 3]) == [3]


def test_no_rule_keeps_everything() -> None:
    assert kept(RetentionPolicy(), [1, 2, 3]) == [1, 2, 3]
    assert RetentionPolicy().plan([]) == []
    assert RetentionPolicy(pin=frozenset({1})).keeps_everything


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_invalid_rules_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        RetentionPolicy(keep_last=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RetentionPolicy(keep_every=bad)  # type: ignore[arg-type]


def test_other_invalid_values_are_refused() -> None:
    with pytest.raises(ValueError):
        RetentionPolicy(max_total_size=-1)
    with pytest.raises(ValueError):
        RetentionPolicy(older_than=timedelta(seconds=-1))
    with pytest.raises(ValueError):
        RetentionPolicy(pin=frozenset({-3}))
    with pytest.raises(ValueError, match="needs `now`"):
        RetentionPolicy(older_than=timedelta(days=1)).plan([1])


def test_keep_last_counts_complete_checkpoints_and_broken_ones_go() -> None:
    plan = RetentionPolicy(keep_last=2).plan(
        [Candidate(1, "a"), Candidate(2, "b"), Candidate(3, "c", complete=False), Candidate(4, "d", complete=False)]
    )
    assert [(d.url, d.keep) for d in plan] == [("a", True), ("b", True), ("c", False), ("d", False)]
    assert by_url(plan)["b"].reasons == ("newest complete", "keep_last=2")
    assert by_url(plan)["d"].reasons == ("not complete (rules keep only complete checkpoints)",)


def test_keep_best_min_and_max_ties_go_to_the_newest() -> None:
    candidates = [
        Candidate(1, "a", metrics={"eval_loss": 0.5, "acc": 0.9}),
        Candidate(2, "b", metrics={"eval_loss": 0.2, "acc": 0.9}),
        Candidate(3, "c", metrics={"eval_loss": float("nan"), "acc": 0.1}),
        Candidate(4, "d", metrics={"eval_loss": 0.2, "acc": "high"}),
        Candidate(5, "e"),
    ]
    plan = by_url(RetentionPolicy(keep_best=(KeepBest.parse("eval_loss"), KeepBest.parse("acc:max"))).plan(candidates))
    assert by_url(RetentionPolicy(keep_best="eval_loss:min").plan(candidates))["d"].keep  # a tie: the newest wins
    assert plan["d"].reasons == ("best eval_loss (min) = 0.2",)
    assert plan["b"].reasons == ("best acc (max) = 0.9",)
    assert not plan["a"].keep and not plan["c"].keep
    assert plan["e"].reasons == ("newest complete",)


def test_keep_best_default_modes() -> None:
    assert KeepBest.parse("eval_loss") == KeepBest("eval_loss", "min")
    assert KeepBest.parse("eval/perplexity").mode == "min"
    assert KeepBest.parse("accuracy") == KeepBest("accuracy", "max")
    assert KeepBest.parse("reward:min") == KeepBest("reward", "min")
    for bad in ("", ":min", "loss:lowest"):
        with pytest.raises(ValueError):
            KeepBest.parse(bad)


def test_protections_keep_and_flag_what_the_rules_would_delete() -> None:
    plan = by_url(
        RetentionPolicy(keep_last=1, pin=frozenset({2})).plan(
            [
                Candidate(1, "pointed", protected=("named by latest",)),
                Candidate(2, "pinned"),
                Candidate(3, "writing", complete=False, busy="in progress"),
                Candidate(None, "export"),
                Candidate(4, "newest"),
            ]
        )
    )
    assert plan["pointed"] == Decision(1, True, ("named by latest",), "pointed", blocked=True)
    assert plan["pinned"] == Decision(2, True, ("pinned",), "pinned")
    assert plan["writing"] == Decision(3, True, ("in progress",), "writing")
    assert plan["export"] == Decision(None, True, ("no step (cannot be ordered)",), "export")
    assert plan["newest"].reasons == ("newest complete", "keep_last=1")


def test_series_are_planned_apart() -> None:
    candidates = [Candidate(s, f"{series}/{s}", series=series) for series in ("_actor", "_critic") for s in (1, 2, 3)]
    assert [d.url for d in RetentionPolicy(keep_last=1).plan(candidates) if d.keep] == ["_actor/3", "_critic/3"]


def test_older_than_limits_deletion_to_older_checkpoints() -> None:
    candidates = [
        Candidate(1, "old", created=NOW - timedelta(days=10)),
        Candidate(2, "recent", created=NOW - timedelta(days=2)),
        Candidate(3, "unknown"),
        Candidate(4, "new", created=NOW - timedelta(hours=1)),
    ]
    alone = by_url(RetentionPolicy(older_than=timedelta(days=7)).plan(candidates, now=NOW))
    assert [u for u, d in alone.items() if not d.keep] == ["old"]
    assert alone["recent"].reasons == ("not older than 7d",)
    assert alone["unknown"].reasons == ("age unknown (older_than)",)
    with_rule = by_url(RetentionPolicy(keep_last=1, older_than=timedelta(hours=12)).plan(candidates, now=NOW))
    assert [u for u, d in with_rule.items() if not d.keep] == ["old", "recent"]


def test_max_total_size_deletes_the_oldest_unprotected_and_best_last() -> None:
    candidates = [
        Candidate(
            s, f"s{s}", created=NOW + timedelta(minutes=s), size_bytes=100, metrics={"loss": 1 / s if s != 2 else 0}
        )
        for s in range(1, 7)
    ]
    policy = RetentionPolicy(keep_last=4, keep_best=(KeepBest.parse("loss"),), max_total_size=250)
    plan = by_url(policy.plan(candidates))
    # Rules keep s2 (best) and s3..s6 (500 bytes): s3, s4, s5 go, oldest first; the best one goes last.
    assert [u for u, d in plan.items() if d.keep] == ["s2", "s6"]
    assert plan["s3"].reasons == ("over max_total_size=250B",)
    tighter = by_url(
        RetentionPolicy(keep_last=4, keep_best=(KeepBest.parse("loss"),), max_total_size=150).plan(candidates)
    )
    assert [u for u, d in tighter.items() if d.keep] == ["s6"]
    budget_only = by_url(RetentionPolicy(max_total_size=450).plan(candidates))
    assert [u for u, d in budget_only.items() if not d.keep] == ["s1", "s2"]
    assert budget_only["s3"].reasons == ("no keep rule (max_total_size decides)",)


def test_budget_that_cannot_be_met_keeps_protected_ones() -> None:
    candidates = [Candidate(1, "a", size_bytes=10, protected=("named by latest",)), Candidate(2, "b", size_bytes=10)]
    plan = by_url(RetentionPolicy(max_total_size=5).plan(candidates))
    assert plan["a"].keep and plan["b"].keep


def test_from_mapping() -> None:
    policy = RetentionPolicy.from_mapping(
        {
            "keep_last": 3,
            "keep_every": 1000,
            "keep_best": ["eval_loss:min", "acc"],
            "max_total_size": "2TB",
            "older_than": "7d",
            "pin": [5, 10],
        }
    )
    assert policy == RetentionPolicy(
        3,
        1000,
        (KeepBest("eval_loss", "min"), KeepBest("acc", "max")),
        2 * 10**12,
        timedelta(days=7),
        frozenset({5, 10}),
    )
    assert policy.describe() == (
        "keep_last=3, keep_every=1000, keep_best=eval_loss:min, keep_best=acc:max, max_total_size=2TB, "
        "older_than=7d, pin=5,10"
    )
    assert RetentionPolicy.from_mapping({"max_total_size": 1000, "keep_best": "loss"}).max_total_size == 1000
    for bad in ({"keep_lsat": 3}, {"keep_last": "3"}, {"pin": 5}, {"older_than": 7}, {"keep_best": [1]}):
        with pytest.raises(ValueError):
            RetentionPolicy.from_mapping(bad)


def test_units() -> None:
    assert parse_size("500GB") == 500 * 10**9
    assert parse_size("1.5 GiB") == 3 * 2**29
    assert parse_size("123") == 123
    assert format_size(2 * 10**12) == "2TB" and format_size(2**30) == "1GiB" and format_size(1001) == "1001B"
    assert parse_age("7d") == timedelta(days=7)
    assert parse_age("1d12h") == timedelta(hours=36)
    assert parse_age("30m") == timedelta(minutes=30)
    assert parse_age("0") == timedelta(0)
    assert format_age(timedelta(hours=36)) == "1d12h"
    for bad in ("", "7", "7y", "d", "-1d"):
        with pytest.raises(ValueError):
            parse_age(bad)
    for bad in ("", "5XB", "-1GB", "GB"):
        with pytest.raises(ValueError):
            parse_size(bad)


# ---------------------------------------------------------------------------------------- properties

policies = hs.builds(
    RetentionPolicy,
    keep_last=hs.none() | hs.integers(1, 10),
    keep_every=hs.none() | hs.integers(1, 50),
    keep_best=hs.lists(hs.sampled_from([KeepBest("loss", "min"), KeepBest("acc", "max")]), max_size=2).map(tuple),
    max_total_size=hs.none() | hs.integers(0, 3000),
    older_than=hs.none() | hs.integers(0, 100).map(lambda h: timedelta(hours=h)),
    pin=hs.frozensets(hs.integers(0, 500), max_size=3),
)


@hs.composite
def runs(draw: hs.DrawFn) -> list[Candidate]:
    count = draw(hs.integers(0, 30))
    out = []
    for i in range(count):
        out.append(
            Candidate(
                step=draw(hs.none() | hs.integers(0, 500)) if draw(hs.booleans()) else draw(hs.integers(0, 500)),
                url=f"c{i}",
                series=draw(hs.sampled_from(["", "_actor", "_critic"])),
                created=draw(hs.none() | hs.integers(0, 200).map(lambda h: NOW - timedelta(hours=h))),
                size_bytes=draw(hs.integers(0, 400)),
                complete=draw(hs.booleans() | hs.just(True)),
                metrics=draw(hs.fixed_dictionaries({}, optional={"loss": hs.floats(0, 5), "acc": hs.floats(0, 1)})),
                protected=draw(hs.sampled_from([(), (), (), ("named by latest",)])),
                busy=draw(hs.sampled_from(["", "", "", "in progress"])),
            )
        )
    return out


@settings(max_examples=150, deadline=None)
@given(policies, runs())
def test_plan_properties(policy: RetentionPolicy, run: list[Candidate]) -> None:
    plan = policy.plan(run, now=NOW)
    assert sorted(d.url for d in plan) == sorted(c.url for c in run)
    assert policy.plan(list(reversed(run)), now=NOW) == plan  # pure and order-insensitive
    decided = by_url(plan)
    assert all(d.reasons for d in plan)
    for series in {c.series for c in run}:
        complete = [c for c in run if c.series == series and c.complete and c.step is not None]
        if complete:
            newest = max(complete, key=lambda c: (c.step, c.created or datetime.min.replace(tzinfo=UTC), c.url))
            assert decided[newest.url].keep, "the newest complete checkpoint is never deleted"
    for c in run:
        if c.protected or c.busy or c.step is None or c.step in policy.pin:
            assert decided[c.url].keep, f"{c} is protected"
    if policy.keeps_everything:
        assert all(d.keep for d in plan)

    # Idempotent: planning again over what is left deletes nothing more.
    survivors = [c for c in run if decided[c.url].keep]
    assert all(d.keep for d in policy.plan(survivors, now=NOW))

    # The budget is met unless only protected checkpoints remain.
    if policy.max_total_size is not None:
        left = sum(c.size_bytes for c in survivors)
        soft = ("keep_last=", "keep_every=", "best ", "no keep rule")
        only_rules = [c for c in survivors if all(r.startswith(soft) for r in decided[c.url].reasons)]
        assert left <= policy.max_total_size or not only_rules


@given(hs.lists(hs.integers(0, 500), max_size=40), hs.none() | hs.integers(1, 10), hs.none() | hs.integers(1, 50))
def test_bare_steps_keep_the_old_semantics(steps: list[int], keep_last: int | None, keep_every: int | None) -> None:
    policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every)
    plan = policy.plan(steps)
    assert [d.step for d in plan] == sorted(set(steps))
    for d in plan:
        assert d.step is not None
        by_last = keep_last is not None and d.step in sorted(set(steps))[-keep_last:]
        by_every = keep_every is not None and d.step % keep_every == 0
        assert d.keep == (by_last or by_every or policy.keeps_everything or d.step == max(steps))


# ---------------------------------------------------------------------------------------- the manager


def save_steps(manager: CheckpointManager, steps: list[int], metrics: dict[int, float] | None = None) -> None:
    state = {"w": torch.zeros(4)}
    for step in steps:
        manager.save(step, state, metrics={"loss": metrics[step]} if metrics else None)


def folders(run: Path) -> set[str]:
    return {p.name for p in run.iterdir()}


def test_manager_applies_keep_last_and_keep_every(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir, policy=RetentionPolicy(keep_last=2, keep_every=4))
    save_steps(manager, [1, 2, 3, 4, 5, 6, 7])
    assert manager.all_steps() == [4, 6, 7]
    manager.wait()  # the dropped steps' files are deleted in the background
    assert folders(run_dir) == {"step-4", "step-6", "step-7", "latest"}  # no (empty) trash left


def test_manager_never_deletes_what_latest_names(run_dir: Path) -> None:
    manager = CheckpointManager(run_dir, policy=RetentionPolicy(keep_last=2))
    save_steps(manager, [10, 20, 30, 5])  # a rewind: the last commit is an older step
    assert (run_dir / "latest").read_text() == "step-5\n"
    assert manager.all_steps() == [5, 20, 30]


def test_manager_keeps_the_best_and_fits_the_budget(run_dir: Path) -> None:
    losses = {1: 0.9, 2: 0.1, 3: 0.5, 4: 0.7, 5: 0.8}
    manager = CheckpointManager(run_dir, policy=RetentionPolicy(keep_last=1, keep_best=(KeepBest.parse("loss"),)))
    save_steps(manager, list(losses), losses)
    assert manager.all_steps() == [2, 5]
    size = sum(f.stat().st_size for f in (run_dir / "step-5").iterdir())
    budget = CheckpointManager(run_dir / "budget", policy=RetentionPolicy(max_total_size=int(size * 2.5)))
    save_steps(budget, [1, 2, 3, 4])
    assert budget.all_steps() == [3, 4]


def test_manager_leaves_staging_folders_and_empties_old_trash(run_dir: Path) -> None:
    staging = run_dir / ".step-9.staging-abcd"
    (staging).mkdir(parents=True)
    leftover = run_dir / ".ckptctl-trash" / "step-3.dead"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"x")
    manager = CheckpointManager(run_dir, policy=RetentionPolicy(keep_last=1))
    save_steps(manager, [1, 2])
    manager.wait()
    assert staging.is_dir()
    assert not leftover.exists()
    assert manager.all_steps() == [2]


@pytest.fixture(params=["local", "object store"])
def any_root(request: pytest.FixtureRequest, run_dir: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(run_dir)
        return
    import fsspec

    root = f"/retention-test-{os.getpid()}-{id(request)}"
    yield f"memory://{root}/run"
    with contextlib.suppress(FileNotFoundError):
        fsspec.filesystem("memory").rm(root, recursive=True)


def test_retention_deletes_off_the_training_thread_and_wait_flushes(
    any_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`save` returns while the dropped step's files are still being deleted (here: held by the test), with
    the step already gone from `all_steps`; `wait` returns once they are deleted."""
    entered, opened = threading.Event(), threading.Event()

    def held(real: Callable[..., None]) -> Callable[..., None]:
        def slow_delete(*args: Any) -> None:  # io.delete_tree(url), or locally trash.remove_entry(fd, name)
            if "step-1" in args[-1]:
                entered.set()
                assert opened.wait(timeout=60), "the test never let the deletion go on"
            real(*args)

        return slow_delete

    manager = CheckpointManager(any_root, policy=RetentionPolicy(keep_last=1))
    save_steps(manager, [1])
    monkeypatch.setattr(io, "delete_tree", held(io.delete_tree))
    monkeypatch.setattr(trash, "remove_entry", held(trash.remove_entry))
    try:
        save_steps(manager, [2])  # returns although deleting step 1 cannot finish yet
        assert entered.wait(timeout=60) and manager.all_steps() == [2]
        tops = {rel.split("/")[0] for rel in io.list_tree(any_root)}  # step 1 is out of sight, not gone yet
        if io.is_local(any_root):  # renamed into the trash
            assert tops == {"latest", "step-2", trash.TRASH_NAME}
            assert [name.split(".")[0] for name in os.listdir(os.path.join(any_root, trash.TRASH_NAME))] == ["step-1"]
        else:  # its manifest deleted
            assert tops == {"latest", "step-1", "step-2"} and not io.exists(f"{any_root}/step-1/{MANIFEST_NAME}")
    finally:
        opened.set()
    manager.wait()
    assert {rel.split("/")[0] for rel in io.list_tree(any_root)} == {"latest", "step-2"}
    if io.is_local(any_root):
        assert sorted(os.listdir(any_root)) == ["latest", "step-2"]


def test_a_failed_background_deletion_warns_on_the_next_call(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(dir_fd: int, name: str) -> None:
        raise StorageError(f"permission denied: {name}")

    manager = CheckpointManager(run_dir, policy=RetentionPolicy(keep_last=1))
    save_steps(manager, [1])
    monkeypatch.setattr(trash, "remove_entry", failing)
    save_steps(manager, [2])
    with pytest.warns(CheckpointWarning, match="retention in .* failed: permission denied"):
        manager.wait()
    monkeypatch.undo()
    assert manager.all_steps() == [2] and len(os.listdir(run_dir / ".ckptctl-trash")) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once
        manager.wait()
    save_steps(manager, [3])  # the next retention empties what the failed one left
    manager.close()
    assert sorted(os.listdir(run_dir)) == ["latest", "step-3"]


def test_an_abandoned_save_is_kept_by_no_rule_and_a_superseded_step_goes_with_its_reason() -> None:
    leftover = Candidate(20, ".step-20.staging-x", complete=False, abandoned=True, note="an interrupted save: gone")
    superseded = Candidate(30, "step-30", complete=False, note="superseded by step-20: a rollback")
    candidates = [Candidate(10, "step-10"), leftover, superseded]
    for policy in (RetentionPolicy(), RetentionPolicy(max_total_size=10**9), RetentionPolicy(keep_last=3)):
        decisions = {d.url: d for d in policy.plan(candidates)}
        assert decisions["step-10"].keep
        assert not decisions[leftover.url].keep and decisions[leftover.url].reasons == ("an interrupted save: gone",)
        # a whole checkpoint off the branch stays where no rule deletes anything; rules keep only resumable ones
        assert decisions["step-30"].keep == (policy.keep_last is None)
    (gone,) = [d for d in RetentionPolicy(keep_last=3).plan(candidates) if d.url == "step-30"]
    assert gone.reasons == ("superseded by step-20: a rollback",)
    pinned = RetentionPolicy(pin=frozenset({20})).plan(candidates)
    assert next(d for d in pinned if d.url == leftover.url).keep  # protections still hold


def test_checkpoints_without_steps_are_ordered_by_epoch() -> None:
    """`epoch_0/`, `epoch_2/`, `epoch_10/` model folders (torchtune): ordered by epoch, not kept as unorderable."""
    policy = RetentionPolicy(keep_last=1)
    epochs = [Candidate(None, url=f"epoch_{e}", epoch=float(e)) for e in (10, 0, 2)]
    decisions = {d.url: (d.keep, d.reasons) for d in policy.plan([*epochs, Candidate(None, url="notes")])}
    assert decisions == {
        "notes": (True, ("no step (cannot be ordered)",)),
        "epoch_0": (False, ("no rule keeps it",)),
        "epoch_2": (False, ("no rule keeps it",)),
        "epoch_10": (True, ("newest complete", "keep_last=1")),
    }
