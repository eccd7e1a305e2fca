"""`list`, `inspect` and `verify` on object storage (s3:// against a local S3 server, and memory://) say
exactly what they say about the same checkpoints on a local disk, reading headers and metadata only."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptctl.formats.manifest import DIGESTS_NAME
from tests.conftest import CliResult, copy_tree
from tests.s3.server import S3Server, copy_to_store

Cli = Callable[..., CliResult]
SCHEMES = ("s3", "memory")
#: Layouts whose `created` comes from file modification times, which an upload does not keep.
_MTIME_CREATED = ("dcp", "hf")


@pytest.fixture(scope="module")
def remote_demo(demo_dir: Path, stores: dict[str, str]) -> dict[str, str]:
    """The demo runs copied to each store."""
    return {scheme: copy_to_store(demo_dir, f"{root}/demo") for scheme, root in stores.items()}


def comparable(document: Any, root: str) -> Any:
    """A JSON document with its run root replaced by ROOT, and upload-time `created` values dropped, as
    are `bytes_read` (it depends on what this process has cached already; checked on its own)."""
    if isinstance(document, dict):
        out = {k: comparable(v, root) for k, v in document.items() if k != "bytes_read"}
        if document.get("layout") in _MTIME_CREATED:
            out.pop("created", None)
        return out
    if isinstance(document, list):
        return [comparable(v, root) for v in document]
    if isinstance(document, str):
        return document.replace(root, "ROOT")
    return document


def run_json(run_cli: Cli, *args: str, code: int = 0) -> Any:
    result = run_cli(*args, "--json")
    assert result.exit_code == code, result.stderr
    assert "Traceback" not in result.stderr
    return result.json


@pytest.mark.parametrize("scheme", SCHEMES)
def test_list_matches_the_local_run(run_cli: Cli, demo_dir: Path, remote_demo: dict[str, str], scheme: str) -> None:
    local = run_json(run_cli, "list", str(demo_dir))
    remote = run_json(run_cli, "list", remote_demo[scheme])
    assert len(remote["checkpoints"]) == 10
    assert comparable(remote, remote_demo[scheme]) == comparable(local, str(demo_dir))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("checkpoint", ["native/step-30", "distributed/step-20", "dcp/step-30", "hf"])
def test_inspect_matches_the_local_checkpoint(
    run_cli: Cli, demo_dir: Path, remote_demo: dict[str, str], scheme: str, checkpoint: str
) -> None:
    local = run_json(run_cli, "inspect", str(demo_dir / checkpoint))
    remote = run_json(run_cli, "inspect", f"{remote_demo[scheme]}/{checkpoint}")
    assert remote["tensors"] and 0 < remote["bytes_read"] < remote["size_bytes"]
    assert comparable(remote, remote_demo[scheme]) == comparable(local, str(demo_dir))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_verify_of_a_run_matches_the_local_run(
    run_cli: Cli, demo_dir: Path, remote_demo: dict[str, str], scheme: str
) -> None:
    local = run_json(run_cli, "verify", str(demo_dir))
    remote = run_json(run_cli, "verify", remote_demo[scheme])
    assert remote["ok"] is True and len(remote["results"]) == 10
    hashed = [r for r in remote["results"] if r["digests_checked"]]
    assert hashed, "the native checkpoints' manifests were checked"
    assert comparable(remote, remote_demo[scheme]) == comparable(local, str(demo_dir))


@pytest.mark.parametrize("checkpoint", ["native/step-30", "distributed/step-30", "dcp/step-20", "hf"])
def test_deep_verify_reads_every_tensor_remotely(
    run_cli: Cli, demo_dir: Path, remote_demo: dict[str, str], checkpoint: str
) -> None:
    local = run_json(run_cli, "verify", str(demo_dir / checkpoint), "--deep", "--check-finite")
    remote = run_json(run_cli, "verify", f"{remote_demo['s3']}/{checkpoint}", "--deep", "--check-finite")
    assert remote["ok"] is True and remote["tensors_read"] > 0
    assert comparable(remote, remote_demo["s3"]) == comparable(local, str(demo_dir))


def test_verify_latest_picks_what_a_resume_would(run_cli: Cli, remote_demo: dict[str, str]) -> None:
    report = run_json(run_cli, "verify", f"{remote_demo['s3']}/native", "--latest")
    assert [r["step"] for r in report["results"]] == [30]


def _flip_remote_byte(s3_server: S3Server, url: str, offset: int) -> None:
    fs = s3_server.filesystem()
    path = url.removeprefix("s3://")
    data = bytearray(fs.cat_file(path))
    data[offset] ^= 0xFF
    fs.pipe_file(path, bytes(data))


def test_write_manifest_then_a_flipped_byte_fails_verify(
    run_cli: Cli, s3_server: S3Server, hf_model_dirs: dict[str, Path], bucket: str, tmp_path: Path
) -> None:
    local = copy_tree(hf_model_dirs["sharded"], tmp_path / "sharded")
    url = s3_server.upload(hf_model_dirs["sharded"], f"{bucket}/sharded")
    shards = sorted(p.name for p in local.glob("*.safetensors"))
    assert len(shards) >= 4

    wrote_local = run_json(run_cli, "verify", str(local), "--write-manifest")
    wrote_remote = run_json(run_cli, "verify", url, "--write-manifest")
    assert wrote_remote["wrote_digests"] is True
    # Hashing remote files is counted: every byte of every file crossed the network once.
    total = sum(p.stat().st_size for p in local.iterdir() if p.name != DIGESTS_NAME)
    assert wrote_remote["bytes_read"] >= total
    assert comparable(wrote_remote, url) == comparable(wrote_local, str(local))
    recorded = json.loads(s3_server.filesystem().cat_file(f"{url.removeprefix('s3://')}/{DIGESTS_NAME}"))
    assert recorded["files"] == json.loads((local / DIGESTS_NAME).read_text())["files"]

    checked = run_json(run_cli, "verify", url)
    assert checked["ok"] is True and checked["digests_checked"] == len(recorded["files"])

    # A byte flipped in a tensor's data (past the header) keeps every size and offset: only digests see it.
    _flip_remote_byte(s3_server, f"{url}/{shards[1]}", s3_server.filesystem().size(f"{url}/{shards[1]}") - 3)
    failed = run_json(run_cli, "verify", url, code=1)
    assert failed["ok"] is False
    assert [(p["kind"], p["path"]) for p in failed["problems"]] == [("digest_mismatch", shards[1])]
    human = run_cli("verify", url)
    assert human.exit_code == 1 and "FAILED" in human.stdout


def test_structural_verify_of_a_foreign_checkpoint_with_a_missing_shard(
    run_cli: Cli, s3_server: S3Server, hf_model_dirs: dict[str, Path], bucket: str
) -> None:
    url = s3_server.upload(hf_model_dirs["sharded"], f"{bucket}/sharded")
    shard = sorted(p.name for p in hf_model_dirs["sharded"].glob("*.safetensors"))[0]
    s3_server.filesystem().rm_file(f"{url.removeprefix('s3://')}/{shard}")
    failed = run_json(run_cli, "verify", url, code=1)
    assert any(p["path"] == shard for p in failed["problems"]), failed["problems"]


def test_a_url_that_is_not_a_checkpoint_is_a_clear_usage_error(run_cli: Cli, bucket: str) -> None:
    result = run_cli("inspect", f"{bucket}/nothing-here")
    assert result.exit_code == 2
    assert "no such checkpoint folder" in result.stderr and "Traceback" not in result.stderr
    empty = run_cli("list", f"{bucket}/nothing-here")
    assert empty.exit_code == 2 and "no such run folder" in empty.stderr


def test_paths_with_a_trailing_slash_work(run_cli: Cli, remote_demo: dict[str, str]) -> None:
    report = run_json(run_cli, "inspect", f"{remote_demo['s3']}/native/step-30/")
    assert report["step"] == 30
