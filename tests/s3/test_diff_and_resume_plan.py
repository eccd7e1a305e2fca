"""`diff` and `resume-plan` on object stores (s3:// against the local S3 server, and memory://) say what
they say about the same checkpoints on a local disk."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptctl.ops.convert import ConvertOptions, convert
from tests.conftest import CliResult
from tests.s3.server import copy_to_store

Cli = Callable[..., CliResult]
SCHEMES = ("s3", "memory")


def run_json(run_cli: Cli, *args: str | Path, code: int = 0) -> Any:
    result = run_cli(*args, "--json")
    assert result.exit_code == code, result.stderr
    assert "Traceback" not in result.stderr
    return result.json


def comparable(document: Any, roots: dict[str, str]) -> Any:
    """A JSON document with each root replaced by its name, and `bytes_read` dropped (checked on its own)."""
    if isinstance(document, dict):
        return {k: comparable(v, roots) for k, v in document.items() if k != "bytes_read"}
    if isinstance(document, list):
        return [comparable(v, roots) for v in document]
    if isinstance(document, str):
        for root, name in roots.items():
            document = document.replace(root, name)
        return document
    return document


@pytest.fixture(scope="module")
def hf_export(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's 2-rank DCP step-30 converted to a sharded HF folder on the local disk."""
    out = tmp_path_factory.mktemp("export") / "hf"
    convert(str(demo_dir / "dcp" / "step-30"), str(out), ConvertOptions(max_shard_size=100_000, mapping="none"))
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_diff_of_a_dcp_step_against_its_hf_conversion_on_a_store(
    run_cli: Cli, demo_dir: Path, hf_export: Path, stores: dict[str, str], scheme: str
) -> None:
    dcp = demo_dir / "dcp" / "step-30"
    root = f"{stores[scheme]}/diff"
    remote_dcp = copy_to_store(dcp, f"{root}/dcp/step-30")
    remote_hf = copy_to_store(hf_export, f"{root}/hf")
    local = run_json(run_cli, "diff", dcp, hf_export)
    assert local["equal"] is True and local["compared"] == 16
    roots = {str(dcp): "DCP", str(hf_export): "HF", remote_dcp: "DCP", remote_hf: "HF"}
    for a, b in ((dcp, remote_hf), (remote_dcp, remote_hf)):
        remote = run_json(run_cli, "diff", a, b)
        assert remote["bytes_read"] >= local["bytes_read"] * 0.9  # the tensors crossed the network
        assert comparable(remote, roots) == comparable(local, roots)
    human = run_cli("diff", remote_dcp, remote_hf)
    assert human.exit_code == 0 and "equal" in human.stdout


def test_diff_of_two_steps_on_s3_finds_the_same_changes(run_cli: Cli, demo_dir: Path, bucket: str) -> None:
    remote = copy_to_store(demo_dir / "native", f"{bucket}/native")
    local = run_json(run_cli, "diff", demo_dir / "native" / "step-10", demo_dir / "native" / "step-30", code=1)
    found = run_json(run_cli, "diff", f"{remote}/step-10", f"{remote}/step-30", code=1)
    assert local["changed"] and comparable(found, {remote: "RUN"}) == comparable(
        local, {str(demo_dir / "native"): "RUN"}
    )


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("run", ["native", "distributed"])
def test_resume_plan_of_an_uploaded_run_matches_the_local_plan(
    run_cli: Cli, demo_dir: Path, stores: dict[str, str], scheme: str, run: str
) -> None:
    remote = copy_to_store(demo_dir / run, f"{stores[scheme]}/resume/{run}")
    for world in ((), ("--world-size", "4")):
        local = run_json(run_cli, "resume-plan", demo_dir / run, *world)
        found = run_json(run_cli, "resume-plan", remote, *world)
        assert found["checkpoint"]["url"] == f"{remote}/step-30"
        assert comparable(found, {remote: "RUN"}) == comparable(local, {str(demo_dir / run): "RUN"})
    human = run_cli("resume-plan", remote)
    assert human.exit_code == 0 and "step-30" in human.stdout, human.stderr
