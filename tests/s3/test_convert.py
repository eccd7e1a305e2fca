"""`convert` with object stores on either side (s3:// against the local S3 server, and memory://): the output
equals a local conversion byte for byte and verifies, a prefix in use is refused unless `--force`, and no
moment of an upload, however it ends, leaves something that `list` calls complete."""

from __future__ import annotations

import json
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest

from ckptctl import io
from ckptctl.checkpoint import CheckpointState
from ckptctl.errors import StorageError
from ckptctl.formats.manifest import DIGESTS_NAME
from ckptctl.layouts import scan_run
from ckptctl.ops.convert import INDEX_NAME, ConvertOptions, Target, convert
from tests.conftest import CliResult
from tests.ops.test_distributed_work import TwoRankJob, _torchrun, run_two_rank_job
from tests.s3._upload_kill import killed_after_uploads
from tests.s3.server import S3Server, copy_to_store

Cli = Callable[..., CliResult]
DiskUsage = type(shutil.disk_usage("/"))
#: Small enough to cut the demo's model (388 KiB) into six shards.
SHARD = "100KB"
#: The demo's toy model has no transformers config: its HF conversions write the stored names, as asked.
RAW = ("--mapping", "none")


@pytest.fixture(scope="module")
def local_export(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's 2-rank DCP step-30 converted to a sharded HF folder on the local disk: the reference."""
    out = tmp_path_factory.mktemp("export") / "hf"
    convert(str(demo_dir / "dcp" / "step-30"), str(out), ConvertOptions(max_shard_size=100_000, mapping="none"))
    return out


def objects(url: str) -> dict[str, bytes]:
    """Every object below `url`, by its path relative to it."""
    fs, path = fsspec.core.url_to_fs(url, use_listings_cache=False)
    return {name[len(path) + 1 :]: fs.cat_file(name) for name in fs.find(path)}


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def assert_same_output(remote: dict[str, bytes], local: dict[str, bytes]) -> None:
    """Byte for byte, but for the time the digests file records its creation."""
    assert sorted(remote) == sorted(local)
    for name, data in local.items():
        if name == DIGESTS_NAME:
            assert json.loads(remote[name])["files"] == json.loads(data)["files"]
        else:
            assert remote[name] == data, name


def convert_json(run_cli: Cli, *args: str | Path, code: int = 0) -> Any:
    """`convert ARGS --json` of a demo checkpoint (`RAW`: harmless for --to dcp, which keeps the names anyway)."""
    result = run_cli("convert", *args, *RAW, "--json")
    assert result.exit_code == code, result.stderr
    assert "Traceback" not in result.stderr
    return result.json if code == 0 else result


@pytest.mark.parametrize("scheme", ["s3", "memory"])
def test_local_to_a_store_equals_the_local_conversion_and_verifies(
    run_cli: Cli, demo_dir: Path, local_export: Path, stores: dict[str, str], scheme: str
) -> None:
    dst = f"{stores[scheme]}/local-to-store"
    doc = convert_json(run_cli, demo_dir / "dcp" / "step-30", dst, "--max-shard-size", SHARD)
    uploaded = objects(dst)
    assert_same_output(uploaded, files(local_export))
    assert len([n for n in uploaded if n.endswith(".safetensors")]) == 6
    assert doc["dst"] == dst and doc["files"] == sorted(uploaded)
    assert doc["bytes_uploaded"] == sum(len(data) for data in uploaded.values())

    verified = run_cli("verify", dst, "--json")
    assert verified.exit_code == 0, verified.stderr
    assert verified.json["ok"] is True and verified.json["digests_checked"] == len(uploaded) - 1
    listed = run_cli("list", dst, "--json").json["checkpoints"]
    assert [(c["layout"], c["state"]) for c in listed] == [("hf", "complete")]


def test_s3_to_s3_equals_the_local_conversion(run_cli: Cli, demo_dir: Path, local_export: Path, bucket: str) -> None:
    src = copy_to_store(demo_dir / "dcp" / "step-30", f"{bucket}/dcp/step-30")
    doc = convert_json(run_cli, src, f"{bucket}/export/", "--max-shard-size", SHARD)
    assert doc["dst"] == f"{bucket}/export" and doc["src"] == src
    assert_same_output(objects(f"{bucket}/export"), files(local_export))
    assert run_cli("verify", f"{bucket}/export", "--json").json["ok"] is True
    human = run_cli("convert", src, f"{bucket}/export-2", *RAW)
    assert human.exit_code == 0 and f"uploaded 389.5 KiB to {bucket}/export-2" in " ".join(human.stdout.split())


def test_convert_from_s3_to_a_local_folder(run_cli: Cli, demo_dir: Path, bucket: str, tmp_path: Path) -> None:
    remote = copy_to_store(demo_dir / "native", f"{bucket}/native")
    local_out, remote_out = tmp_path / "from-local", tmp_path / "from-s3"
    a = convert_json(run_cli, demo_dir / "native" / "step-30", local_out, "--to", "hf")
    b = convert_json(run_cli, f"{remote}/step-30", remote_out, "--to", "hf")
    assert (b["tensors"], b["bytes"], b["bytes_uploaded"]) == (a["tensors"], a["bytes"], 0)
    assert (remote_out / "model.safetensors").read_bytes() == (local_out / "model.safetensors").read_bytes()
    assert run_cli("verify", remote_out, "--json").json["ok"] is True


def test_hf_to_dcp_on_s3(run_cli: Cli, demo_dir: Path, bucket: str, tmp_path: Path) -> None:
    local, dst = tmp_path / "dcp", f"{bucket}/init-dcp"
    convert_json(run_cli, demo_dir / "hf", local, "--to", "dcp")
    convert_json(run_cli, demo_dir / "hf", dst, "--to", "dcp")
    uploaded = objects(dst)
    assert sorted(uploaded) == sorted(files(local))
    assert uploaded["__0_0.distcp"] == (local / "__0_0.distcp").read_bytes()  # `.metadata` holds a save id
    assert run_cli("verify", dst, "--json").json["ok"] is True
    assert run_cli("diff", demo_dir / "hf", dst, "--json").json["equal"] is True
    assert [c["state"] for c in run_cli("list", dst, "--json").json["checkpoints"]] == ["complete"]


def test_a_prefix_in_use_is_refused_and_force_replaces_it(
    run_cli: Cli, demo_dir: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = demo_dir / "dcp" / "step-30", f"{bucket}/export"
    convert_json(run_cli, src, dst, "--max-shard-size", SHARD)
    fs, path = fsspec.core.url_to_fs(dst, use_listings_cache=False)
    fs.pipe_file(f"{path}/notes/old.txt", b"left from before")
    before = objects(dst)

    refused = convert_json(run_cli, src, dst, code=2)
    assert f"error: {dst} is not empty (9 object(s) below it)" in refused.stderr and "--force" in refused.stderr
    assert objects(dst) == before

    real_delete = io.delete_files
    deleted: list[list[str]] = []

    def delete_files(urls: list[str]) -> None:
        deleted.append(sorted(io.relative_to(url, dst) for url in urls))
        real_delete(urls)

    monkeypatch.setattr(io, "delete_files", delete_files)
    convert_json(run_cli, src, dst, "--force")  # default shard size: one model.safetensors
    assert sorted(objects(dst)) == [DIGESTS_NAME, "model.safetensors"]
    # The digests, then what completes the old output (its index and first shard), then the rest.
    assert deleted[0] == [DIGESTS_NAME]
    assert deleted[1] == ["model-00001-of-00006.safetensors", INDEX_NAME]
    assert len(deleted[2]) == 6 and "notes/old.txt" in deleted[2]
    assert run_cli("verify", dst, "--json").json["ok"] is True

    inside = convert_json(run_cli, dst, bucket, "--force", code=2)
    assert f"{bucket} contains the source {dst}" in inside.stderr


def test_a_missing_bucket_is_refused_before_converting(run_cli: Cli, demo_dir: Path) -> None:
    result = convert_json(run_cli, demo_dir / "hf", "s3://ckptctl-no-such-bucket/out", code=2)
    assert "error: bucket 'ckptctl-no-such-bucket' does not exist" in result.stderr


@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_no_moment_of_an_upload_lists_as_complete(
    demo_dir: Path, bucket: str, monkeypatch: pytest.MonkeyPatch, to: str
) -> None:
    dst = f"{bucket}/every-moment-{to}"
    monkeypatch.setenv("CKPTCTL_IO_WORKERS", "1")  # one upload at a time: every intermediate state is seen
    real_upload = io.upload_file
    moments: list[tuple[str, list[CheckpointState]]] = []

    def upload_and_list(path: str, url: str) -> None:
        real_upload(path, url)
        moments.append((io.name_of(url), [ref.state for ref in scan_run(dst)]))

    monkeypatch.setattr(io, "upload_file", upload_and_list)
    src = demo_dir / ("dcp/step-30" if to == "hf" else "hf")
    convert(str(src), dst, ConvertOptions(to=Target(to), max_shard_size=100_000, mapping="none"))

    order = [name for name, _ in moments]
    assert order[-1] == DIGESTS_NAME
    if to == "hf":
        # The shards but the smallest, the index, the smallest shard (with it missing, the shard naming shows
        # the folder broken), the digests.
        sizes = {rel: entry.size for rel, entry in io.list_tree(dst).items()}
        shards = sorted((n for n in sizes if n.endswith(".safetensors")), key=lambda n: (sizes[n], n))
        assert len(shards) == 6 and order[-2] == shards[0]
        assert set(order[:5]) == set(shards[1:]) and order[5] == INDEX_NAME
    else:
        assert order == ["__0_0.distcp", "config.json", ".metadata", DIGESTS_NAME]
    for name, states in moments[:-2]:
        assert CheckpointState.COMPLETE not in states, (name, states)
    assert [states for _, states in moments[-2:]] == [[CheckpointState.COMPLETE]] * 2


def test_an_upload_killed_midway_is_not_complete_and_force_replaces_it(
    run_cli: Cli, demo_dir: Path, bucket: str
) -> None:
    dst = f"{bucket}/killed"
    killed_after_uploads("tests.s3._convert_kill_worker", str(demo_dir / "dcp" / "step-30"), dst, 3)

    assert len(io.list_tree(dst)) == 3
    listed = run_cli("list", dst, "--json").json["checkpoints"]
    assert [(c["layout"], c["state"]) for c in listed] == [("hf", "broken")]
    assert run_cli("verify", dst, "--json").exit_code == 1
    refused = convert_json(run_cli, demo_dir / "dcp" / "step-30", dst, code=2)
    assert "an upload that was killed also leaves objects behind" in refused.stderr
    convert_json(run_cli, demo_dir / "dcp" / "step-30", dst, "--force", "--max-shard-size", SHARD)
    assert run_cli("verify", dst, "--json").json["ok"] is True


def test_a_failed_upload_removes_what_it_uploaded(
    run_cli: Cli, demo_dir: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = f"{bucket}/failed"
    real_upload = io.upload_file
    calls: list[str] = []

    def fail_on_the_fourth(path: str, url: str) -> None:
        calls.append(url)
        if len(calls) == 4:
            raise StorageError(f"cannot access {url}: connection reset")
        real_upload(path, url)

    monkeypatch.setattr(io, "upload_file", fail_on_the_fourth)
    result = convert_json(run_cli, demo_dir / "dcp" / "step-30", dst, "--max-shard-size", SHARD, code=2)
    assert "connection reset" in result.stderr
    assert len(calls) >= 4 and io.list_tree(dst) == {}


def test_staging_goes_to_tmpdir_and_its_free_space_is_checked(
    run_cli: Cli, demo_dir: Path, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staging = tmp_path / "tmpdir"
    staging.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging))
    real_upload = io.upload_file
    sources: list[str] = []

    def upload(path: str, url: str) -> None:
        sources.append(path)
        real_upload(path, url)

    monkeypatch.setattr(io, "upload_file", upload)
    convert_json(run_cli, demo_dir / "hf", f"{bucket}/staged")
    assert sources and all(path.startswith(f"{staging}/") for path in sources)
    assert list(staging.iterdir()) == []  # removed once uploaded

    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(10 << 20, 10 << 20, 1000))
    full = convert_json(run_cli, demo_dir / "hf", f"{bucket}/no-room", code=2)
    assert "which has 1000 free" in full.stderr and "TMPDIR" in full.stderr
    assert io.list_tree(f"{bucket}/no-room") == {}


@pytest.fixture(scope="module")
def two_rank_uploads(s3_server: S3Server, demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TwoRankJob:
    """`convert` of the demo's 2-rank DCP save to HF (`to_hf`) and of its HF export to DCP (`to_dcp`), each
    to a prefix of its own in a new bucket, by the two ranks of one torchrun job."""
    bucket = s3_server.make_bucket(f"ckpt-{secrets.token_hex(4)}")

    def spec(folder: Path) -> dict[str, list[Any]]:
        return {
            "to_hf": ["convert", demo_dir / "dcp" / "step-30", f"{bucket}/{folder.name}-hf", *TO_HF, "--json"],
            "to_dcp": ["convert", demo_dir / "hf", f"{bucket}/{folder.name}-dcp", *TO_DCP, "--json"],
        }

    return TwoRankJob(run_two_rank_job(tmp_path_factory.mktemp("two-rank-uploads"), spec))


TO_HF = ["--max-shard-size", SHARD, *RAW]
TO_DCP = ["--to", "dcp", "--dcp-file-size", SHARD]


@pytest.mark.xdist_group("s3_two_rank_uploads")  # the tests sharing `two_rank_uploads` run it once
@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_a_conversion_over_two_ranks_uploads_what_one_process_uploads(
    run_cli: Cli, demo_dir: Path, local_export: Path, two_rank_uploads: TwoRankJob, tmp_path: Path, to: str
) -> None:
    """Two ranks: each rank stages and uploads its own data files, rank 0 the index (or `.metadata`),
    config and digests."""
    name = f"to_{to}"
    dst = two_rank_uploads.args(name)[2]
    if to == "hf":
        reference = local_export
    else:
        reference = tmp_path / "dcp"
        convert_json(run_cli, demo_dir / "hf", reference, *TO_DCP)
    assert two_rank_uploads.code(name) == 0, two_rank_uploads.stderr(name)
    doc = two_rank_uploads.document(name)
    uploaded = objects(dst)
    assert len([n for n in uploaded if n.endswith((".safetensors", ".distcp"))]) > 2
    assert_same_output(uploaded, files(reference))  # a DCP output's `.metadata` too
    assert doc["files"] == sorted(uploaded)
    assert doc["bytes_uploaded"] == sum(len(data) for data in uploaded.values())
    assert [ref.state for ref in scan_run(dst)] == [CheckpointState.COMPLETE]


@pytest.mark.long
def test_a_rank_killed_mid_upload_leaves_nothing_complete(
    demo_dir: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 dies once its first shard is up: rank 0 never uploads the index, the smallest shard nor the
    digests (they wait for every rank's other files), and takes back what it uploaded."""
    dst = f"{bucket}/killed-rank"
    monkeypatch.setenv("KILL_AFTER", "upload")  # tests/ops/_killed_rank.py
    monkeypatch.setenv("CKPTCTL_IO_WORKERS", "1")
    done = _torchrun(
        "convert",
        demo_dir / "dcp" / "step-30",
        dst,
        "--max-shard-size",
        SHARD,
        *RAW,
        "--json",
        module="tests.ops._killed_rank",
    )
    assert done.returncode != 0
    left = io.list_tree(dst)
    assert left and all(name.endswith(".safetensors") for name in left)  # the killed rank's upload stays
    sizes = {rel: entry.size for rel, entry in left.items()}
    assert INDEX_NAME not in left and DIGESTS_NAME not in left
    assert CheckpointState.COMPLETE not in [ref.state for ref in scan_run(dst)], sizes
