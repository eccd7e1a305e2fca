"""Writing a torch DCP `.metadata` from ckptctl's parsed view of one (`formats.dcp_metadata.DcpMetadata`):
the `Metadata` object torch's `FileSystemWriter.finish` pickles, made of torch's own classes, so that
`dcp.load` and `FileSystemReader` read it as one of theirs.

`slim` writes the `.metadata` of a DCP folder that keeps some of its items (the model, not the optimizer)
at new places: the kept entries, their storage records as given, the version, the save's id and path, and
the default planner's key paths of the kept keys. What the parsed view leaves out (the deprecated tensor
properties: layout, requires_grad, memory format, pinning) is written as torch's defaults, which no loader
reads. Nothing here unpickles: the input was parsed by the safe reader.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any

from ckptctl.errors import CkptctlError
from ckptctl.formats.dcp_metadata import DcpBytesItem, DcpMetadata, DcpTensor, StorageKey, StorageRecord

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

    Raises:
        CkptctlError: a dtype torch does not have, or a storage record of a key not in `entries`.
    """
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    state: dict[str, Any] = {}
    chunk_index: dict[StorageKey, int] = {}
    for key, item in entries.items():
        if isinstance(item, DcpBytesItem):
            state[key] = BytesStorageMetadata()
            continue
        dtype = getattr(torch, item.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise CkptctlError(f"{key}: dtype {item.dtype} is not one torch has")
        chunks = []
        for n, chunk in enumerate(item.chunks):
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)))
            chunk_index[(key, chunk.offsets)] = n
        state[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(item.size), chunks)
    records: dict[Any, Any] = {}
    for (key, offsets), record in storage.items():
        if key not in state:
            raise CkptctlError(f"a storage record names {key!r}, which is not an entry")
        index = MetadataIndex(
            fqn=key,
            offset=None if offsets is None else torch.Size(offsets),
            index=chunk_index.get((key, offsets)) if offsets is not None else None,
        )
        records[index] = _StorageInfo(
            relative_path=record.relative_path,
            offset=record.offset,
            length=record.length,
            transform_descriptors=list(record.transforms) if record.transforms else None,
        )
    storage_meta = None
    if save_id is not None or checkpoint_id is not None:
        storage_meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id)
    metadata = Metadata(
        state_dict_metadata=state,
        planner_data=planner_data,
        storage_data=records,
        storage_meta=storage_meta,
        version=version,
    )
    return pickle.dumps(metadata)


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
