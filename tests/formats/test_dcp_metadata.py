"""Parsing DCP `.metadata`: real files from torch, exact allowlist use, validation of hostile values."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.dcp_metadata import DcpBytesItem, DcpChunk, DcpTensor, StorageRecord, parse_dcp_metadata
from ckptctl.formats.dcp_metadata_classes import DCP_METADATA_GLOBALS
from ckptctl.formats.safe_pickle import SafeUnpickler
from tests.writers.dcp_writer import WrittenDcp


def test_real_metadata_parses_to_what_was_saved(raw_dcp: WrittenDcp, real_metadata: bytes) -> None:
    parsed = parse_dcp_metadata(real_metadata, "raw/.metadata")
    reference = raw_dcp.reference_tensors()
    tensors = dict(parsed.tensors())
    assert set(tensors) == set(reference)
    for key, tensor in tensors.items():
        assert tensor.dtype == str(reference[key].dtype).removeprefix("torch.")
        assert tensor.size == tuple(reference[key].shape)
        assert tensor.chunks == (DcpChunk((0,) * len(tensor.size), tensor.size),)
        record = parsed.storage[(key, (0,) * len(tensor.size))]
        assert record.relative_path == "__0_0.distcp"
        assert record.length >= tensor.nbytes
    assert set(parsed.bytes_keys) == set(raw_dcp.non_tensor_keys)
    assert all(parsed.storage[(k, None)].relative_path == "__0_0.distcp" for k in parsed.bytes_keys)
    size = (raw_dcp.path / "__0_0.distcp").stat().st_size
    assert max(r.offset + r.length for r in parsed.storage.values()) == size
    assert parsed.version == "1.0.0"
    assert parsed.checkpoint_id == str(raw_dcp.path)
    assert parsed.planner_data["weight"] == ("weight",)


def test_real_metadata_uses_only_allowlisted_globals(real_metadata: bytes) -> None:
    seen: set[tuple[str, str]] = set()

    class Recording(SafeUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    import io

    Recording(io.BytesIO(real_metadata), DCP_METADATA_GLOBALS, "x").load()
    assert seen <= set(DCP_METADATA_GLOBALS)
    structural = {g for g in seen if g[0] != "torch" or g[1] == "Size"}
    assert structural == {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "MetadataIndex",
            "_MEM_FORMAT_ENCODING",
        )
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
    }


def test_parsing_needs_no_torch(real_metadata: bytes, tmp_path: Any) -> None:
    path = tmp_path / "m"
    path.write_bytes(real_metadata)
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now fails
        "from ckptctl.formats.dcp_metadata import parse_dcp_metadata\n"
        f"m = parse_dcp_metadata(open({str(path)!r}, 'rb').read(), 'm')\n"
        "print(len(m.entries))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) > 10


def _tensor(dtype: torch.dtype, size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Any:
    return TensorStorageMetadata(
        TensorProperties(dtype=dtype),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )


def _metadata(entries: dict[str, Any], storage: dict[Any, Any] | None = None, **fields: Any) -> bytes:
    if storage is None:
        storage = {}
        for key, item in entries.items():
            chunks = item.chunks if isinstance(item, TensorStorageMetadata) else [None]
            for chunk in chunks:
                offset = None if chunk is None else chunk.offsets
                storage[MetadataIndex(key, offset)] = _StorageInfo("__0_0.distcp", len(storage) * 100, 100)
    return pickle.dumps(Metadata(state_dict_metadata=entries, storage_data=storage, **fields))


def test_synthetic_metadata_round_trip() -> None:
    data = _metadata(
        {
            "w": _tensor(torch.bfloat16, (4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 6))]),
            "lr": BytesStorageMetadata(),
        }
    )
    parsed = parse_dcp_metadata(data, "m")
    assert parsed.entries["w"] == DcpTensor("bfloat16", (4, 6), (DcpChunk((0, 0), (2, 6)), DcpChunk((2, 0), (2, 6))))
    assert parsed.entries["lr"] == DcpBytesItem()
    assert parsed.storage[("w", (2, 0))] == StorageRecord("__0_0.distcp", 100, 100)
    assert parsed.storage[("lr", None)] == StorageRecord("__0_0.distcp", 200, 100)
    assert parsed.version is None


def _bad_storage(path: Any = "__0_0.distcp", offset: Any = 0, length: Any = 10) -> Callable[[], bytes]:
    def build() -> bytes:
        entries = {"w": _tensor(torch.float32, (2,), [((0,), (2,))])}
        return _metadata(entries, {MetadataIndex("w", (0,)): _StorageInfo(path, offset, length)})

    return build


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: pickle.dumps({"state_dict_metadata": {}}), "top object is not a Metadata"),
        (lambda: _metadata({"w": _tensor(torch.complex32, (2,), [((0,), (2,))])}), "torch.complex32 is not supported"),
        (lambda: _metadata({"w": _tensor(torch.float32, (2, 3), [((0,), (2,))])}), "dims but the tensor has 2"),
        (lambda: _metadata({"w": _tensor(torch.float32, (-2,), [((0,), (2,))])}), "negative or non-integer"),
        (lambda: _metadata({"w": _tensor(torch.float32, (2,), [((-1,), (2,))])}), "negative or non-integer"),
        (lambda: _metadata({3: BytesStorageMetadata()}), "key is not a string"),  # type: ignore[dict-item]
        (lambda: _metadata({"w": "not metadata"}), "neither a TensorStorageMetadata"),
        (lambda: _metadata({}, storage=None, version=3), "version is not a short string"),
        (_bad_storage(path="../../etc/passwd"), "not a plain relative path"),
        (_bad_storage(path="/etc/passwd"), "not a plain relative path"),
        (_bad_storage(path="a/./b"), "not a plain relative path"),
        (_bad_storage(offset=-5), "invalid byte range"),
        (_bad_storage(length="10"), "invalid byte range"),
        (_bad_storage(path=7), "no file name"),
    ],
)
def test_invalid_values_are_refused_with_a_clear_message(build: Callable[[], bytes], message: str) -> None:
    with pytest.raises(CorruptCheckpoint, match=message):
        parse_dcp_metadata(build(), "m")


def test_storage_data_must_be_a_dict() -> None:
    data = pickle.dumps(Metadata(state_dict_metadata={}, storage_data=None))
    with pytest.raises(CorruptCheckpoint, match="storage_data is missing"):
        parse_dcp_metadata(data, "m")


def test_shared_chunk_lists_cannot_amplify_the_work() -> None:
    # One chunk list referenced by many tensors through the memo: linear pickle, quadratic naive work.
    chunks = [ChunkStorageMetadata(torch.Size((i,)), torch.Size((1,))) for i in range(2000)]
    entries: dict[str, Any] = {
        f"t{i}": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size((2000,)), chunks)
        for i in range(2000)
    }
    data = pickle.dumps(Metadata(state_dict_metadata=entries, storage_data={}))
    with pytest.raises(CorruptCheckpoint, match="more chunks than the file can hold"):
        parse_dcp_metadata(data, "m")


def test_transform_descriptors_are_kept() -> None:
    entries = {"w": _tensor(torch.float32, (2,), [((0,), (2,))])}
    storage = {MetadataIndex("w", (0,)): _StorageInfo("__0_0.distcp", 0, 10, transform_descriptors=["zstd"])}
    parsed = parse_dcp_metadata(_metadata(entries, storage), "m")
    assert parsed.storage[("w", (0,))].transforms == ("zstd",)


def test_twenty_thousand_tensors_parse_whole() -> None:
    # How fast is bench/list_inspect.py's to say (no timed assertions here); this says every entry is read.
    n = 20_000
    entries = {
        f"model.layers.{i}.w": _tensor(torch.float32, (64, 32), [((0, 0), (32, 32)), ((32, 0), (32, 32))])
        for i in range(n)
    }
    parsed = parse_dcp_metadata(_metadata(entries), "m")
    assert len(parsed.storage) == 2 * n
    assert {key for key, _ in parsed.storage} == set(entries)
    assert {offsets for _, offsets in parsed.storage} == {(0, 0), (32, 0)}
