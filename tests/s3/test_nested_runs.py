"""Run folders that are a checkpoint and hold checkpoints, on s3:// (the local S3 server): the same checks
as on a local disk (`tests/cli/test_nested_runs.py`), on the same real runs uploaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.test_nested_runs import (
    KINDS,
    Cli,
    check_convert,
    check_list,
    check_prune,
    check_prune_of_a_checkpoint_holding_one,
    check_resume_target,
    check_verify,
    dcp_run_with_an_export_in_a_step,
)
from tests.s3.server import copy_to_store
from tests.writers.run_folders import NestedRun


@pytest.fixture(scope="module")
def uploaded(nested_runs: dict[str, NestedRun], stores: dict[str, str]) -> dict[str, str]:
    """Each run copied to the S3 server once, for the checks that change nothing."""
    return {kind: copy_to_store(run.path, f"{stores['s3']}/nested/{kind}") for kind, run in nested_runs.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_list_verify_and_resume_target(
    run_cli: Cli, nested_runs: dict[str, NestedRun], uploaded: dict[str, str], kind: str
) -> None:
    check_list(run_cli, uploaded[kind], nested_runs[kind])
    check_verify(run_cli, uploaded[kind], nested_runs[kind])
    check_resume_target(run_cli, uploaded[kind], nested_runs[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_convert_converts_the_model_at_the_top(
    run_cli: Cli, nested_runs: dict[str, NestedRun], uploaded: dict[str, str], kind: str, tmp_path: Path
) -> None:
    check_convert(run_cli, uploaded[kind], nested_runs[kind], tmp_path / "out")


@pytest.mark.parametrize("kind", KINDS)
def test_prune_deletes_old_checkpoints_and_never_the_model(
    run_cli: Cli, nested_runs: dict[str, NestedRun], bucket: str, kind: str
) -> None:
    run = nested_runs[kind]
    check_prune(run_cli, copy_to_store(run.path, f"{bucket}/run"), run)


def test_deleting_a_checkpoint_that_holds_one_deletes_only_its_own_files(
    run_cli: Cli, nested_runs: dict[str, NestedRun], bucket: str, tmp_path: Path
) -> None:
    run = nested_runs["dcp"]
    local = dcp_run_with_an_export_in_a_step(run, tmp_path / "run")
    check_prune_of_a_checkpoint_holding_one(run_cli, copy_to_store(local, f"{bucket}/run"), run)
