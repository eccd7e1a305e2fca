"""`prune` on s3:// against the local S3 server (`convert` has `tests/s3/test_convert.py`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ckptctl import io
from ckptctl.ops.lock import LOCK_NAME
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
