"""`reshard` into object stores (s3:// against the local S3 server, and memory://), as `convert` uploads: the
output equals a local reshard byte for byte and verifies, the files that complete it go up last in the writer's
order, a prefix in use is refused unless `--force`, and a failed or interrupted upload leaves nothing."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptctl import io
from ckptctl.checkpoint import CheckpointState
from ckptctl.errors import StorageError
from ckptctl.formats.manifest import DIGESTS_NAME
from ckptctl.layouts import scan_run
from ckptctl.ops.commit import published_last
from ckptctl.ops.reshard import ReshardOptions, reshard
from tests.conftest import CliResult
from tests.s3.test_convert import assert_same_output, objects
from tests.writers.deepspeed_writer import WrittenDeepSpeed

Cli = Callable[..., CliResult]
TO = ("--to", "deepspeed-universal")
#: What the universal writer lists last, in its order: the tag's completion markers, then the pointer.
LAST = ["global_step4/zero/optimizer_state.pt", "global_step4/mp_rank_00_model_states.pt", "latest_universal"]


@pytest.fixture(scope="module")
def local_universal(deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ZeRO-2 save folder resharded into a local folder: the reference."""
    out = tmp_path_factory.mktemp("universal") / "out"
    reshard(str(deepspeed_runs[2].save_dir), str(out), ReshardOptions(to="deepspeed-universal"))
    return out


def _local_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _reshard_json(run_cli: Cli, *args: str | Path, code: int = 0) -> Any:
    result = run_cli("reshard", *args, *TO, "--json")
    assert result.exit_code == code, result.stderr
    assert "Traceback" not in result.stderr
    return result.json


@pytest.mark.parametrize("scheme", ["s3", "memory"])
def test_a_store_gets_what_a_local_reshard_writes_and_it_verifies(
    run_cli: Cli,
    deepspeed_runs: dict[int, WrittenDeepSpeed],
    local_universal: Path,
    stores: dict[str, str],
    scheme: str,
) -> None:
    """Byte for byte on memory://; on s3:// (slower to read back) the same sizes and digests, which `verify`
    then checks every uploaded byte against."""
    dst = f"{stores[scheme]}/universal/"
    doc = _reshard_json(run_cli, deepspeed_runs[2].save_dir, dst)
    dst = dst.rstrip("/")
    local = _local_files(local_universal)
    sizes = {rel: entry.size for rel, entry in io.list_tree(dst).items()}
    assert sizes == {rel: len(data) for rel, data in local.items()}
    if scheme == "memory":
        assert_same_output(objects(dst), local)
    else:
        digests = json.loads(io.read_bytes(f"{dst}/{DIGESTS_NAME}"))["files"]
        assert digests == json.loads(local[DIGESTS_NAME])["files"]
    assert doc["dst"] == dst and doc["files"][-1] == "latest_universal"
    assert sorted(doc["files"]) == sorted(name for name in sizes if name != DIGESTS_NAME)
    assert doc["bytes_uploaded"] == sum(sizes.values())

    verified = run_cli("verify", dst, "--json")
    assert verified.exit_code == 0, verified.stderr
    assert verified.json["ok"] is True
    listed = run_cli("list", dst, "--json").json["checkpoints"]
    assert [(c["url"], c["layout"], c["state"]) for c in listed] == [
        (f"{dst}/global_step4", "deepspeed_universal", "complete")
    ]
    if (
        scheme == "memory"
    ):  # what resume-plan reads of a store is the same on both (tests/s3/test_diff_and_resume_plan.py)
        plan = run_cli("resume-plan", dst, "--world-size", "1", "--json").json
        assert plan["checkpoint"]["url"] == f"{dst}/global_step4" and plan["world_size_ok"] is True


def test_what_completes_the_output_goes_up_last(
    deepspeed_runs: dict[int, WrittenDeepSpeed], memory_store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One upload at a time: the parameters' states, then the tag's markers and the pointer in the writer's
    order, then the digests; the tag lists as complete only once its last marker is up."""
    dst = f"{memory_store}/in-order"
    monkeypatch.setenv("CKPTCTL_IO_WORKERS", "1")
    real_upload = io.upload_file
    order: list[str] = []
    states: dict[str, list[CheckpointState]] = {}

    def upload(path: str, url: str) -> None:
        real_upload(path, url)
        order.append(io.relative_to(url, dst))
        if order[-1] in LAST:
            states[order[-1]] = [ref.state for ref in scan_run(dst) if ref.url.endswith("global_step4")]

    monkeypatch.setattr(io, "upload_file", upload)
    reshard(str(deepspeed_runs[2].save_dir), dst, ReshardOptions(to="deepspeed-universal"))
    assert order[-4:] == [*LAST, DIGESTS_NAME]
    assert all(name.startswith("global_step4/zero/") for name in order[:-4])
    assert CheckpointState.COMPLETE not in states[LAST[0]]
    assert states[LAST[1]] == states[LAST[2]] == [CheckpointState.COMPLETE]


def test_a_prefix_in_use_is_refused_and_force_replaces_it(
    run_cli: Cli, deepspeed_runs: dict[int, WrittenDeepSpeed], memory_store: str
) -> None:
    src, dst = deepspeed_runs[2].save_dir, f"{memory_store}/in-use"
    _reshard_json(run_cli, src, dst)
    before = objects(dst)
    refused = run_cli("reshard", src, dst, *TO)
    assert refused.exit_code == 2 and f"error: {dst} is not empty ({len(before)} object(s) below it)" in refused.stderr
    assert objects(dst) == before
    _reshard_json(run_cli, src, dst, "--force")
    after = objects(dst)
    assert sorted(after) == sorted(before)
    assert json.loads(after[DIGESTS_NAME])["files"] == json.loads(before[DIGESTS_NAME])["files"]


@pytest.mark.parametrize("failure", [StorageError("cannot access it: connection reset"), KeyboardInterrupt()])
def test_a_failed_or_interrupted_upload_leaves_nothing(
    deepspeed_runs: dict[int, WrittenDeepSpeed],
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    failure: BaseException,
) -> None:
    dst = f"{bucket}/cut-short"
    staging = tmp_path / "tmpdir"
    staging.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging))
    real_upload = io.upload_file
    calls: list[str] = []

    def fail_on_the_fourth(path: str, url: str) -> None:
        calls.append(url)
        if len(calls) == 4:
            raise failure
        real_upload(path, url)

    monkeypatch.setattr(io, "upload_file", fail_on_the_fourth)
    with pytest.raises(type(failure)):
        reshard(str(deepspeed_runs[2].save_dir), dst, ReshardOptions(to="deepspeed-universal"))
    assert len(calls) >= 4 and io.list_tree(dst) == {}
    assert list(staging.iterdir()) == []  # the local staging folder too


def test_an_interrupt_through_the_command_says_what_was_removed(
    run_cli: Cli, deepspeed_runs: dict[int, WrittenDeepSpeed], bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = f"{bucket}/interrupted"

    def interrupted(path: str, url: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(io, "upload_file", interrupted)
    result = run_cli("reshard", deepspeed_runs[2].save_dir, dst, *TO)
    assert result.exit_code == 130
    assert f"the staging folder and the objects uploaded so far to {dst} were removed" in result.stderr
    assert io.list_tree(dst) == {}


@pytest.mark.parametrize(
    ("files", "last"),
    [
        # --to dcp: the data files, `.metadata` last (`frameworks/dcp/reshard.py`).
        (["__0_0.distcp", "__1_0.distcp", ".metadata"], [".metadata"]),
        # verl: each role's rank files, its fsdp_config.json and copied files, then data.pt and the tracker
        # (`frameworks/verl/reshard.py`): the roles' configs, data.pt and the tracker go up last, in this order.
        (
            [
                "global_step_2/actor/model_world_size_1_rank_0.pt",
                "global_step_2/actor/optim_world_size_1_rank_0.pt",
                "global_step_2/actor/fsdp_config.json",
                "global_step_2/actor/huggingface/config.json",
                "global_step_2/critic/model_world_size_1_rank_0.pt",
                "global_step_2/critic/fsdp_config.json",
                "global_step_2/data.pt",
                "latest_checkpointed_iteration.txt",
            ],
            [
                "global_step_2/actor/fsdp_config.json",
                "global_step_2/critic/fsdp_config.json",
                "global_step_2/data.pt",
                "latest_checkpointed_iteration.txt",
            ],
        ),
    ],
)
def test_what_each_writer_lists_last_goes_up_last(files: list[str], last: list[str]) -> None:
    assert list(published_last(files)) == last
