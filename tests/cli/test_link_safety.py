"""A link planted where ckptctl moves or deletes (its trash, a lock, a staging folder) never makes it touch
anything outside the run: the command refuses with exit 2 naming the link, and nothing is changed.

The runs are written by the core's `CheckpointManager` (the native layout's real writer); the attacker's
part is one `ln -s`, as anyone who can write into a shared run folder could do.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptctl import CheckpointManager, RetentionPolicy
from ckptctl.errors import UnsafePath
from ckptctl.io import trash
from ckptctl.ops.commit import Staging
from tests.conftest import CliResult
from tests.ops.test_prune import tree, write_run

Cli = Callable[..., CliResult]
RULES = ("--keep-last", "2", "--grace", "0s")


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside the run holding what an attacker wants deleted."""
    folder = tmp_path / "outside"
    (folder / "nested").mkdir(parents=True)
    (folder / "precious.bin").write_bytes(os.urandom(4096))
    (folder / "nested" / "data.txt").write_text("keep me")
    return folder


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in run.glob("step-*"))


@pytest.mark.parametrize("dry_run", [False, True], ids=["apply", "dry-run"])
def test_prune_refuses_a_linked_trash_and_changes_nothing(
    run_cli: Cli, tmp_path: Path, outside: Path, dry_run: bool
) -> None:
    run = write_run(tmp_path / "run")
    (run / ".ckptctl-trash").symlink_to(os.path.relpath(outside, run))
    before_outside, before_run = tree(outside), tree(run)

    result = run_cli("prune", run, *RULES, "--dry-run" if dry_run else "-y", "--json")

    assert result.exit_code == 2, result.stdout + result.stderr
    error = result.json["error"]
    assert str(run / ".ckptctl-trash") in error["message"] and "symbolic link" in error["message"]
    assert tree(outside) == before_outside and tree(run) == before_run


def test_prune_refuses_a_nested_runs_linked_trash(run_cli: Cli, tmp_path: Path, outside: Path) -> None:
    run = write_run(tmp_path / "run")
    critic = write_run(run / "_critic")
    (critic / ".ckptctl-trash").symlink_to(os.path.relpath(outside, critic))
    before_outside, before_run = tree(outside), tree(run)

    result = run_cli("prune", run, *RULES, "-y")

    assert result.exit_code == 2
    assert str(critic / ".ckptctl-trash") in result.stderr and "symbolic link" in result.stderr
    assert tree(outside) == before_outside and tree(run) == before_run


def test_prune_refuses_a_linked_lock(run_cli: Cli, tmp_path: Path, outside: Path) -> None:
    run = write_run(tmp_path / "run")
    (run / ".ckptctl-prune.lock").symlink_to(outside / "precious.bin")
    before_outside, before_run = tree(outside), tree(run)

    result = run_cli("prune", run, *RULES, "-y")

    assert result.exit_code == 2
    assert ".ckptctl-prune.lock" in result.stderr and "symbolic link" in result.stderr
    assert tree(outside) == before_outside and tree(run) == before_run


def test_a_linked_checkpoint_is_kept_and_what_it_names_untouched(run_cli: Cli, tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    elsewhere = write_run(tmp_path / "elsewhere", steps=[5])
    (run / "step-5").symlink_to(elsewhere / "step-5")
    before = tree(elsewhere)

    result = run_cli("prune", run, "--keep-last", "1", "--grace", "0s", "-y", "--json")

    assert result.exit_code == 0, result.stderr
    kept = {k["url"]: k["reasons"] for k in result.json["keep"]}
    assert any("link" in why for why in kept[str(run / "step-5")])
    assert tree(elsewhere) == before and (run / "step-5").is_symlink()


def test_deleting_a_link_removes_the_link_only(tmp_path: Path) -> None:
    elsewhere = write_run(tmp_path / "elsewhere", steps=[5])
    run = tmp_path / "run"
    run.mkdir()
    (run / "step-5").symlink_to(elsewhere / "step-5")
    before = tree(elsewhere)

    trash.delete(str(run / "step-5"))

    assert not os.path.lexists(run / "step-5") and not (run / ".ckptctl-trash").exists()
    assert tree(elsewhere) == before


def test_manager_retention_refuses_a_linked_trash(tmp_path: Path, outside: Path) -> None:
    run = write_run(tmp_path / "run", steps=[1, 2])
    (run / ".ckptctl-trash").symlink_to(os.path.relpath(outside, run))
    before = tree(outside)

    manager = CheckpointManager(run, policy=RetentionPolicy(keep_last=1))
    with pytest.warns(Warning, match="symbolic link"):
        manager.save(3, {"model": torch.nn.Linear(2, 2)})
        manager.wait()

    assert tree(outside) == before
    assert _steps(run) == ["step-1", "step-2", "step-3"]  # retention refused: nothing retired


def test_manager_resave_refuses_a_linked_trash(tmp_path: Path, outside: Path) -> None:
    run = write_run(tmp_path / "run", steps=[1])
    (run / ".ckptctl-trash").symlink_to(os.path.relpath(outside, run))
    before_outside, before_step = tree(outside), tree(run / "step-1")

    manager = CheckpointManager(run)
    with pytest.raises(UnsafePath, match="symbolic link"):
        manager.save(1, {"model": torch.nn.Linear(2, 2)})

    assert tree(outside) == before_outside
    assert tree(run / "step-1") == before_step  # the committed step is the one that was there


def test_purge_after_the_trash_was_swapped_for_a_link(tmp_path: Path, outside: Path) -> None:
    """The race: the trash is replaced by a link between the move and the deletion."""
    run = write_run(tmp_path / "run", steps=[1, 2])
    retired = trash.retire(str(run / "step-1"))
    name = os.path.basename(retired.url)
    (outside / name).mkdir()
    (outside / name / "victim").write_text("x")
    os.rename(run / ".ckptctl-trash", tmp_path / "moved-away")
    (run / ".ckptctl-trash").symlink_to(os.path.relpath(outside, run))
    before = tree(outside)

    with pytest.raises(UnsafePath):
        trash.purge(retired)
    with pytest.raises(UnsafePath):
        trash.empty(str(run / ".ckptctl-trash"))

    assert tree(outside) == before


def test_empty_deletes_links_inside_the_trash_not_their_targets(tmp_path: Path, outside: Path) -> None:
    run = write_run(tmp_path / "run", steps=[1])
    bin_ = run / ".ckptctl-trash"
    bin_.mkdir()
    (bin_ / "to-outside").symlink_to(outside)
    (bin_ / "leftover").mkdir()
    (bin_ / "leftover" / "inner-link").symlink_to(outside / "precious.bin")
    (bin_ / "leftover" / "data").write_bytes(b"12345")
    before = tree(outside)

    assert trash.empty(str(bin_)) == 5

    assert not bin_.exists() and tree(outside) == before


def test_convert_staging_swapped_for_a_link_is_not_emptied(tmp_path: Path, outside: Path) -> None:
    dst = tmp_path / "export"
    before = tree(outside)
    with warnings.catch_warnings(), Staging(str(dst)) as staging:
        os.rename(staging.root, tmp_path / "real-staging")
        os.symlink(outside, staging.root)
    assert tree(outside) == before and not os.path.lexists(staging.root)


def test_a_run_reached_through_a_link_is_pruned_as_usual(run_cli: Cli, tmp_path: Path) -> None:
    """The run folder itself may be a link the user chose (`/scratch/run -> /lustre/...`): followed."""
    real = write_run(tmp_path / "real-run")
    (tmp_path / "run").symlink_to(real)

    result = run_cli("prune", tmp_path / "run", "--keep-last", "1", "--grace", "0s", "-y", "--json")

    assert result.exit_code == 0, result.stderr
    assert len(result.json["delete"]) == 5 and len(_steps(real)) == 1
    assert not (real / ".ckptctl-trash").exists()
