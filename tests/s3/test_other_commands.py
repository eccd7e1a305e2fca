"""`prune` on s3:// against the local S3 server (`convert` has `tests/s3/test_convert.py`)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptctl import io
from ckptctl.core.lock import LOCK_NAME
from tests.conftest import CliResult
from tests.s3.server import copy_to_store

Cli = Callable[..., CliResult]


def test_prune_on_s3_matches_the_local_plan_and_deletes(
    run_cli: Cli, demo_dir: Path, bucket: str, tmp_path: Path
) -> None:
    import shutil

    local = shutil.copytree(demo_dir / "native", tmp_path / "native")
    remote = copy_to_store(demo_dir / "native", f"{bucket}/native")
    rules = ("--keep-last", "1", "--grace", "0s", "--json")
    local_plan = run_cli("prune", local, "--dry-run", *rules)
    remote_plan = run_cli("prune", remote, "--dry-run", *rules)
    assert remote_plan.exit_code == 0, remote_plan.stderr
    steps = lambda doc, key: sorted(item["step"] for item in doc[key])  # noqa: E731
    assert steps(remote_plan.json, "delete") == steps(local_plan.json, "delete") == [10, 20]
    assert steps(remote_plan.json, "keep") == [30]

    done = run_cli("prune", remote, "--yes", *rules)
    assert done.exit_code == 0, done.stderr
    assert [c["step"] for c in run_cli("list", remote, "--json").json["checkpoints"]] == [30]
    assert {rel.split("/")[0] for rel in io.list_tree(remote)} <= {"step-30", "latest", LOCK_NAME}


def test_a_store_that_dies_during_prune_is_reported_unreachable(
    run_cli: Cli, demo_dir: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store stops answering after the plan (issue 21.5): an unreachable store, exit 2, never "bucket
    # '...' does not exist" (see tests/s3/test_errors.py for the bucket look-up that said so).
    from ckptctl.ops import prune as prune_op
    from tests.s3.server import reset_s3fs

    remote = copy_to_store(demo_dir / "native", f"{bucket}/native")
    monkeypatch.setattr(
        io.failures, "RETRY", io.RetryPolicy(attempts=2, base_delay=0.001, max_delay=0.001, timeout=5.0)
    )
    with socket.create_server(("127.0.0.1", 0)) as dead:  # a port that accepts nothing once closed
        dead_endpoint = f"http://127.0.0.1:{dead.getsockname()[1]}"
    real_delete = prune_op.delete_planned

    def delete_after_the_store_died(ref: Any) -> None:
        monkeypatch.setenv("AWS_ENDPOINT_URL", dead_endpoint)
        reset_s3fs()
        real_delete(ref)

    monkeypatch.setattr(prune_op, "delete_planned", delete_after_the_store_died)
    try:
        done = run_cli("prune", remote, "--yes", "--keep-last", "1", "--grace", "0s", "--json")
    finally:  # the cached client points at the dead store: the next test on this worker must not get it
        monkeypatch.undo()
        reset_s3fs()
    assert done.exit_code == 2, done.stderr
    error = done.json["error"]
    assert error["type"] == "StorageError" and "did not answer" in error["message"], error
    assert "does not exist" not in done.stderr
