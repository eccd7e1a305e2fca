"""`convert` and `prune` (modules of their own, owned elsewhere) on s3:// against the local S3 server.

What does not work yet is marked `xfail` with the reason, so that the suite stays green and the gap shows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

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


def test_convert_from_s3_to_a_local_folder(run_cli: Cli, demo_dir: Path, bucket: str, tmp_path: Path) -> None:
    remote = copy_to_store(demo_dir / "native", f"{bucket}/native")
    local_out, remote_out = tmp_path / "from-local", tmp_path / "from-s3"
    a = run_cli("convert", demo_dir / "native" / "step-30", local_out, "--to", "hf", "--json")
    b = run_cli("convert", f"{remote}/step-30", remote_out, "--to", "hf", "--json")
    assert a.exit_code == 0, a.stderr
    assert b.exit_code == 0, b.stderr
    assert (b.json["tensors"], b.json["bytes"]) == (a.json["tensors"], a.json["bytes"])
    for name in ("model.safetensors",):
        assert (remote_out / name).read_bytes() == (local_out / name).read_bytes()
    assert run_cli("verify", remote_out, "--json").json["ok"] is True


def test_convert_to_s3_is_refused_clearly(run_cli: Cli, demo_dir: Path, bucket: str) -> None:
    result = run_cli("convert", demo_dir / "native" / "step-30", f"{bucket}/export", "--to", "hf")
    if result.exit_code == 0:
        assert run_cli("verify", f"{bucket}/export", "--json").json["ok"] is True
        return
    assert result.exit_code == 2 and "Traceback" not in result.stderr and "internal error" not in result.stderr
    pytest.xfail(f"convert writes local folders only: {result.stderr.strip().splitlines()[0]}")
