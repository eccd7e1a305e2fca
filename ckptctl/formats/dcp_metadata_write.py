"""Writing a torch DCP `.metadata` from ckptctl's parsed view of one (`formats.dcp_metadata.DcpMetadata`):
the `Metadata` object torch's `FileSystemWriter.finish` pickles, made of torch's own classes, so that
`dcp.load` and `FileSystemReader` read it as one of theirs.

`slim` writes the `.metadata` of a DCP folder that keeps some of its items (the model, not the optimizer)
at new places: the kept entries, their storage records as given, the version, the save's id and path, and
the default planner's key paths of the kept keys. What the parsed view leaves out (the deprecated tensor
properties: layout, requires_grad, memory format, pinning) is written as torch's defaults, which no loader
reads. Nothing here unpickles: the input was parsed by the safe reader. Nothing here imports torch either:
`reshard --to dcp` writes the `.metadata` of a source that needs no torch to read.
"""

from __future__ import annotations

import io as pyio
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from ckptctl.checkpoint import known_dtypes
from ckptctl.errors import CkptctlError
from ckptctl.formats.dcp_metadata import DcpBytesItem, DcpMetadata, DcpTensor, StorageKey, StorageRecord
from ckptctl.formats.pickle_names import PickledName, PurePickler, global_opcode

__all__ = ["dcp_metadata_bytes", "write_dcp_metadata"]


def dcp_metadata_bytes(
    entries: Mapping[str, DcpTensor | DcpBytesItem],
    storage: Mapping[StorageKey, StorageRecord],
    *,
    version: str | None,
    save_id: str | None = None,
    checkpoint_id: str | None = None,
    planner_data: Any = None,
) -> bytes:
    """The pickle of torch's `Metadata` for `entries` stored at `storage` (every storage key names an entry).

    Written without importing torch: each of torch's objects as pickle writes it from its `__reduce_ex__` (a
    dataclass as NEWOBJ + BUILD of its fields; `TensorProperties` of the tuple its `__getstate__` gives, its
    memory format an `_MEM_FORMAT_ENCODING` member; a `torch.Size` as `Size(tuple)`; a dtype by name; the
    layout as `torch.serialization._get_layout("torch.strided")`, as torch's own reducer of layouts writes it).

    Raises:
        CkptctlError: a dtype torch does not have, or a storage record of a key not in `entries`.
    """
    state: dict[str, Any] = {}
    chunk_index: dict[StorageKey, int] = {}
    for key, item in entries.items():
        if isinstance(item, DcpBytesItem):
            state[key] = _New(_BYTES_METADATA, {})
            continue
        if item.dtype not in known_dtypes():
            raise CkptctlError(f"{key}: dtype {item.dtype} is not one torch has")
        chunks = []
        for n, chunk in enumerate(item.chunks):
            chunks.append(_New(_CHUNK_METADATA, {"offsets": _size(chunk.offsets), "sizes": _size(chunk.sizes)}))
            chunk_index[(key, chunk.offsets)] = n
        properties = _New(_TENSOR_PROPERTIES, (_dtype(item.dtype), _STRIDED, False, _CONTIGUOUS, False))
        state[key] = _New(_TENSOR_METADATA, {"properties": properties, "size": _size(item.size), "chunks": chunks})
    records: dict[Any, Any] = {}
    for (key, offsets), record in storage.items():
        if key not in state:
            raise CkptctlError(f"a storage record names {key!r}, which is not an entry")
        index = _New(
            _METADATA_INDEX,
            {
                "fqn": key,
                "offset": None if offsets is None else _size(offsets),
                "index": chunk_index.get((key, offsets)) if offsets is not None else None,
            },
        )
        records[index] = _New(
            _STORAGE_INFO,
            {
                "relative_path": record.relative_path,
                "offset": record.offset,
                "length": record.length,
                "transform_descriptors": list(record.transforms) if record.transforms else None,
            },
        )
    storage_meta = None
    if save_id is not None or checkpoint_id is not None:
        storage_meta = _New(
            _STORAGE_META, {"checkpoint_id": checkpoint_id, "save_id": save_id, "load_id": None, "modules": []}
        )
    metadata = _New(
        _METADATA,
        {
            "state_dict_metadata": state,
            "planner_data": planner_data,
            "storage_data": records,
            "storage_meta": storage_meta,
            "version": version,
        },
    )
    buffer = pyio.BytesIO()
    _Pickler(buffer, protocol=4).dump(metadata)
    return buffer.getvalue()


@dataclass(frozen=True, slots=True, eq=False)
class _New:
    """An object of class `cls` built as pickle builds a dataclass: NEWOBJ, then BUILD with `state`. Compared
    by identity, as pickle's memo and a dict of `MetadataIndex` keys take objects."""

    cls: PickledName
    state: Any


@dataclass(frozen=True, slots=True, eq=False)
class _Call:
    """`func(*args)`, as pickle writes an object whose `__reduce__` gives a callable and its arguments."""

    func: PickledName
    args: tuple[Any, ...]


_DCP = "torch.distributed.checkpoint.metadata"
_METADATA = PickledName(_DCP, "Metadata")
_TENSOR_METADATA = PickledName(_DCP, "TensorStorageMetadata")
_BYTES_METADATA = PickledName(_DCP, "BytesStorageMetadata")
_CHUNK_METADATA = PickledName(_DCP, "ChunkStorageMetadata")
_TENSOR_PROPERTIES = PickledName(_DCP, "TensorProperties")
_STORAGE_META = PickledName(_DCP, "StorageMeta")
_METADATA_INDEX = PickledName(_DCP, "MetadataIndex")
_STORAGE_INFO = PickledName("torch.distributed.checkpoint.filesystem", "_StorageInfo")
_TORCH_SIZE = PickledName("torch", "Size")
_STRIDED = _Call(PickledName("torch.serialization", "_get_layout"), ("torch.strided",))
_CONTIGUOUS = _Call(PickledName(_DCP, "_MEM_FORMAT_ENCODING"), (0,))


@cache
def _dtype(name: str) -> PickledName:
    """One object per dtype, so that pickle's memo names each once and refers back to it after."""
    return PickledName("torch", name)


def _size(dims: tuple[int, ...]) -> _Call:
    return _Call(_TORCH_SIZE, (tuple(dims),))


class _Pickler(PurePickler):
    """pickle's own pickler, writing `PickledName`, `_New` and `_Call` as the torch objects they stand for."""

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        kind = type(obj)
        if kind is not PickledName and kind is not _New and kind is not _Call:
            super().save(obj, save_persistent_id)
            return
        memo = self.memo.get(id(obj))
        if memo is not None:
            self.write(self.get(memo[0]))
            return
        if kind is PickledName:
            self.write(global_opcode(obj.module, obj.name))
        elif kind is _New:
            self.save(obj.cls)
            self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
            self.memoize(obj)
            self.save(obj.state)
            self.write(pickle.BUILD)
            return
        else:
            self.save(obj.func)
            self.save(obj.args)
            self.write(pickle.REDUCE)
        self.memoize(obj)


def write_dcp_metadata(path: str, metadata: DcpMetadata, **overrides: Any) -> None:
    """Write `dcp_metadata_bytes` of `metadata` (its fields, or `overrides` of `entries`, `storage`,
    `planner_data`) to `path`, fsynced."""
    fields: dict[str, Any] = {
        "entries": metadata.entries,
        "storage": metadata.storage,
        "version": metadata.version,
        "save_id": metadata.save_id,
        "checkpoint_id": metadata.checkpoint_id,
        "planner_data": metadata.planner_data or None,
    }
    fields.update(overrides)
    data = dcp_metadata_bytes(fields.pop("entries"), fields.pop("storage"), **fields)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
