"""The Hugging Face model-folder layout against folders written by transformers `save_pretrained`."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from ckptctl.checkpoint import CheckpointState, Component, ProblemKind
from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.chunks import read_tensor
from ckptctl.formats.safetensors import read_header
from ckptctl.layouts import detect, open_checkpoint
from ckptctl.ops.verification import verify_checkpoint
from tests.conftest import copy_tree


@pytest.mark.parametrize("variant", ["single", "sharded"])
def test_open_matches_the_saved_model(hf_model_dirs: dict[str, Path], variant: str) -> None:
    reference = torch.load(hf_model_dirs["reference"], weights_only=True)
    ckpt = open_checkpoint(str(hf_model_dirs[variant]))
    assert ckpt.layout == "hf"
    assert {Component.MODEL, Component.CONFIG} <= ckpt.components
    index = {t.name: t for t in ckpt.tensor_index()}
    assert set(index) == set(reference)
    for name, tensor in reference.items():
        assert index[name].shape == tuple(tensor.shape)
        assert index[name].dtype == str(tensor.dtype).removeprefix("torch.")
        assert torch.equal(read_tensor(ckpt.url, index[name]), tensor)
    if variant == "sharded":
        assert ckpt.metadata["weight_files"] >= 4
    assert ckpt.metadata["config"]["model_type"] == "llama"


def test_sharded_and_single_verify(hf_model_dirs: dict[str, Path]) -> None:
    for variant in ("single", "sharded"):
        result = verify_checkpoint(str(hf_model_dirs[variant]))
        assert result.ok, result.problems


def test_missing_shard_named_by_index_is_broken_and_fails_verify(
    hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    folder = copy_tree(hf_model_dirs["sharded"], tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (folder / victim).unlink()
    _, ref = detect(str(folder))
    assert ref.state is CheckpointState.BROKEN
    result = verify_checkpoint(str(folder))
    assert not result.ok
    assert any(p.kind == ProblemKind.MISSING_FILE and p.path == victim for p in result.problems)


def test_truncated_shard_fails_verify(hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_tree(hf_model_dirs["single"], tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 100])
    result = verify_checkpoint(str(folder))
    assert not result.ok
    assert any(p.path == "model.safetensors" and "truncated" in p.message for p in result.problems)


def test_index_naming_a_file_that_does_not_exist(hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_tree(hf_model_dirs["sharded"], tmp_path / "m")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "model-99999-of-99999.safetensors"
    index_path.write_text(json.dumps(index))
    result = verify_checkpoint(str(folder))
    assert not result.ok
    assert any(
        p.kind == ProblemKind.MISSING_FILE and p.path == "model-99999-of-99999.safetensors" for p in result.problems
    )


@pytest.mark.parametrize(
    "header",
    [
        b"not json",
        json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 999999]}}).encode(),
        json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode(),
        json.dumps({"w": {"dtype": "Q99", "shape": [4], "data_offsets": [0, 16]}}).encode(),
        json.dumps({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}).encode(),
        json.dumps(
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
            }
        ).encode(),
        # every field of a type no writer writes (issue 21.5): each was a foreign exception before
        b'{"w": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}}',
        b'{"w": {"dtype": {"F32": 1}, "shape": [4], "data_offsets": [0, 16]}}',
        b'{"w": {"dtype": ' + b"9" * 5000 + b', "shape": [4], "data_offsets": [0, 16]}}',
        b'{"w": {"dtype": "F32", "shape": [0, 18446744073709551616], "data_offsets": [0, 0]}}',
        b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": ["0", 16]}}',
        b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "__metadata__": []}',
        b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "__metadata__": {"a": 1}}',
        b"[" * 100_000 + b"]" * 100_000,
    ],
    ids=[
        "garbage",
        "offset-past-end",
        "length-disagrees",
        "unknown-dtype",
        "negative-shape",
        "overlap",
        "list-dtype",
        "object-dtype",
        "huge-int-dtype",
        "dimension-past-int64",
        "string-offset",
        "list-metadata",
        "int-metadata-value",
        "deep-nesting",
    ],
)
def test_lying_headers_are_refused(tmp_path: Path, header: bytes) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 32)
    with pytest.raises(CorruptCheckpoint):
        read_header(str(path))


def test_header_length_claiming_terabytes_is_refused_without_allocating(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CorruptCheckpoint, match="header claims"):
        read_header(str(path))
