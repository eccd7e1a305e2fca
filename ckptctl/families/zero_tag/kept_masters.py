"""The master weights `slim` keeps of a ZeRO tag's optimizer partitions (`parts.zero_tag.slim`): a safetensors
file in the tag folder holding what `master_weights` gave, under its names and in its order, which
`convert` (`checkpoint_master_weights`) and the tag's tensor index (`tag_index`) read once the partitions
are gone."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ckptctl import io
from ckptctl.checkpoint import Component, TensorChunk, TensorEntry
from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.safetensors import read_header

if TYPE_CHECKING:  # imported where one is built: the capabilities' dataclasses would cost every reader of a tag
    from ckptctl.contract.capabilities import MasterWeights

__all__ = ["KEPT_MASTERS", "NOTES_KEY", "UPCAST_KEY", "kept_master_weights"]

#: What `slim` keeps of a tag's optimizer partitions: the master weights, as a safetensors file in the tag
#: folder (`parts.zero_tag.slim`), with the names `master_weights` gives them, in its order.
KEPT_MASTERS = "ckptctl-master-weights.safetensors"
#: Its metadata keys: the names of the buffers `convert` upcasts, and the notes (JSON lists).
UPCAST_KEY = "ckptctl.upcast"
NOTES_KEY = "ckptctl.notes"


def kept_master_weights(checkpoint_url: str, prefix: str) -> MasterWeights:
    """The master weights `slim` kept of a tag (`KEPT_MASTERS` at `prefix` in the checkpoint), as
    `master_weights` gave them before: the same names, order, dtypes and upcast buffers.

    Raises:
        CorruptCheckpoint: the file is not a safetensors file, or its metadata is not what slim writes.
    """
    from ckptctl.contract.capabilities import MasterWeights

    rel = f"{prefix}{KEPT_MASTERS}"
    url = io.join(checkpoint_url, rel)
    header = read_header(url)
    metadata = header.metadata or {}
    try:
        upcast = json.loads(metadata.get(UPCAST_KEY, "[]"))
        notes = json.loads(metadata.get(NOTES_KEY, "[]"))
    except ValueError as exc:
        raise CorruptCheckpoint(f"{url}: bad metadata ({exc})") from exc
    if not all(isinstance(x, str) for x in [*upcast, *notes]):
        raise CorruptCheckpoint(f"{url}: bad metadata (lists of names and notes expected)")
    entries = tuple(
        TensorEntry(
            t.name,
            Component.MODEL,
            t.dtype,
            t.shape,
            (TensorChunk(rel, t.begin, t.end - t.begin, (0,) * len(t.shape), t.shape),),
        )
        for t in sorted(header.tensors, key=lambda t: t.begin)
    )
    return MasterWeights(entries, frozenset(upcast), tuple(notes))
