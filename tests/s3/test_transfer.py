"""Bytes and requests: `inspect`, `list` and structural `verify` of a checkpoint of realistic size move
headers and metadata only (< 1% of it), measured on the wire by a relay in front of the S3 server; `list`
sends one listing request for a whole run."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors.torch import save_file

from ckptctl import io
from tests.conftest import CliResult
from tests.s3.server import CountingProxy, S3Server

Cli = Callable[..., CliResult]


@pytest.fixture(scope="module")
def large_hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF model folder of 64 MiB (float32) in two safetensors shards with an index (48 tensors)."""
    folder = tmp_path_factory.mktemp("large") / "model"
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for shard in range(2):
        name = f"model-0000{shard + 1}-of-00002.safetensors"
        tensors = {
            f"model.layers.{shard * 24 + i}.mlp.weight": torch.randn(512, 680, generator=generator) for i in range(24)
        }
        save_file(tensors, str(folder / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return folder


def test_inspect_list_and_structural_verify_transfer_under_one_percent(
    run_cli: Cli, s3_server: S3Server, bucket: str, large_hf_folder: Path, counting_proxy: CountingProxy
) -> None:
    size = sum(p.stat().st_size for p in large_hf_folder.iterdir())
    assert size > 60 << 20
    url = s3_server.upload(large_hf_folder, f"{bucket}/run/model")

    for args in (["inspect", url], ["list", f"{bucket}/run"], ["verify", url]):
        counting_proxy.reset()
        result = run_cli(*args, "--json")
        assert result.exit_code == 0, result.stderr
        wire = counting_proxy.received
        assert 0 < wire < size / 100, f"{args[0]} moved {wire} bytes of a {size}-byte checkpoint"
        if args[0] != "list":
            assert (
                0 < result.json["bytes_read"] <= wire
            )  # what ckptctl reports is the payload part of what crossed the wire

    inspected = run_cli("inspect", url, "--json").json
    assert inspected["totals"]["tensors"] == 48 and inspected["totals"]["bytes"] == 48 * 512 * 680 * 4


def test_digest_verify_transfers_the_whole_checkpoint_once(
    run_cli: Cli, s3_server: S3Server, bucket: str, large_hf_folder: Path, counting_proxy: CountingProxy
) -> None:
    size = sum(p.stat().st_size for p in large_hf_folder.iterdir())
    url = s3_server.upload(large_hf_folder, f"{bucket}/model")
    counting_proxy.reset()
    wrote = run_cli("verify", url, "--write-manifest", "--json")
    assert wrote.exit_code == 0, wrote.stderr
    assert size <= wrote.json["bytes_read"] <= counting_proxy.received < size * 1.02


class RequestCounter:
    """Counts the requests ckptctl's s3fs client sends, by operation (`ListObjectsV2`, `GetObject`, ...)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    async def __call__(self, event_name: str, **kwargs: object) -> None:
        self.counts[event_name.rsplit(".", 1)[-1]] += 1


@pytest.fixture
def requests(bucket: str) -> Iterator[RequestCounter]:
    io.exists(bucket)  # makes the client that io's filesystem instance keeps
    fs = fsspec.core.url_to_fs(bucket, use_listings_cache=False)[0]
    counter = RequestCounter()
    fs.s3.meta.events.register("before-send.s3", counter)
    try:
        yield counter
    finally:
        fs.s3.meta.events.unregister("before-send.s3", counter)


def test_list_sends_one_listing_whatever_the_number_of_checkpoints(
    run_cli: Cli, s3_server: S3Server, bucket: str, demo_dir: Path, tmp_path: Path, requests: RequestCounter
) -> None:
    # 100 DCP steps in nested folders: a DCP folder is judged from its listing alone, without reads.
    for step in range(100):
        folder = tmp_path / "run" / f"stage-{step // 50}" / f"step-{step}"
        folder.mkdir(parents=True)
        (folder / ".metadata").write_bytes(b"m")
        (folder / "__0_0.distcp").write_bytes(b"d" * step)
    url = s3_server.upload(tmp_path / "run", f"{bucket}/run")
    requests.counts.clear()
    listed = run_cli("list", url, "--json").json["checkpoints"]
    assert len(listed) == 100 and {c["state"] for c in listed} == {"complete"}
    assert sum(c["size_bytes"] for c in listed) == 100 + sum(range(100))
    assert requests.counts == {"ListObjectsV2": 1}

    # ckptctl's own checkpoints: their manifests are read (for step, time and state), nothing else.
    native = s3_server.upload(demo_dir / "native", f"{bucket}/native")
    requests.counts.clear()
    assert len(run_cli("list", native, "--json").json["checkpoints"]) == 3
    assert requests.counts == {"ListObjectsV2": 1, "GetObject": 3 + 1}  # + `latest`, read once
