"""Per-rank safetensors shards: what transformers' `save_pretrained(distributed_checkpoint=True)` writes
(transformers 5.24 `distributed/checkpoint.py` `_save_model_checkpoint_distributed`), through torch's
`HuggingFaceStorageWriter(save_distributed=True)` (torch 2.13 `distributed/checkpoint/hf_storage.py`,
`_hf_utils.py`).

```
DIR/config.json, generation_config.json            rank 0 (save_pretrained)
DIR/shard-{p:05d}-model-{i:05d}-of-{n:05d}.safetensors
    one set per rank: p is the rank's plan number (rank + 1); i-of-n the file of the model (n = 1 unless a
    `fqn_to_index_mapping` spreads the tensors over several)
    __metadata__ = {"DCP_SHARDING_INFO": '{name: {"saved_offsets": [..]}}', "DCP_VERSION": "1.0", "format": "pt"}
```

Each file holds this rank's piece of each tensor under the tensor's own name, with its offsets in the full
tensor in `DCP_SHARDING_INFO`. Nothing records the full shapes: like torch's `HuggingFaceStorageReader`,
the full shape is where the pieces end, so a folder that lost the last rank's files reads as a smaller
model that still tiles; files of the other ranks missing show up (ranks `1..P` are numbered).
Replicated tensors are written once (torch's planner deduplicates them across ranks).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ckptctl import io
from ckptctl.checkpoint import ChunkEncoding, Component, Problem, ProblemKind, TensorChunk, TensorEntry
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.chunks import tiling_problem
from ckptctl.formats.documents import parse_json
from ckptctl.formats.safetensors import SafetensorsHeader, read_header
from ckptctl.layouts.base import absent_numbers

__all__ = ["SHARD_FILE", "is_distributed", "rank_files", "shards_index", "shards_problems"]

SHARD_FILE = re.compile(r"^shard-(?P<rank>\d{5})-model-(?P<i>\d{5})-of-(?P<n>\d{5})\.safetensors$")
_SHARDING_INFO = "DCP_SHARDING_INFO"
_OFFSETS = "saved_offsets"
#: The sharding info is one JSON string in the header, bounded with it (`MAX_HEADER_BYTES`).
_MAX_DEPTH = 4


def is_distributed(names: Iterable[str]) -> bool:
    """Whether a folder's file names include per-rank shards."""
    return any(SHARD_FILE.match(n) for n in names)


def rank_files(names: Iterable[str]) -> dict[int, list[str]]:
    """The shard files by rank plan number (1-based), each list sorted."""
    found: dict[int, list[str]] = {}
    for name in sorted(names):
        if m := SHARD_FILE.match(name):
            found.setdefault(int(m.group("rank")), []).append(name)
    return found


@dataclass(frozen=True, slots=True)
class _Piece:
    file: str
    dtype: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    begin: int
    end: int


def _pieces(header: SafetensorsHeader, file: str) -> list[tuple[str, _Piece]]:
    """Each tensor record of one shard file with its offsets from the sharding info.

    Raises:
        CorruptCheckpoint: no sharding info, or info that does not name a tensor's offsets in its dimensions.
    """
    raw = header.metadata.get(_SHARDING_INFO)
    if raw is None:
        raise CorruptCheckpoint(f"{file}: no {_SHARDING_INFO} in its header: where its pieces go is unknown")
    info = parse_json(raw, f"{file} ({_SHARDING_INFO})", max_depth=_MAX_DEPTH)
    if not isinstance(info, dict):
        raise CorruptCheckpoint(f"{file}: {_SHARDING_INFO} is not a JSON object")
    found = []
    for rec in header.tensors:
        entry = info.get(rec.name)
        offsets = entry.get(_OFFSETS) if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != len(rec.shape)
            or not all(type(o) is int and 0 <= o < 1 << 62 for o in offsets)
        ):
            raise CorruptCheckpoint(
                f"{file}: {_SHARDING_INFO} gives no valid offsets of {rec.name!r} ({len(rec.shape)} dimensions)"
            )
        found.append((rec.name, _Piece(file, rec.dtype, tuple(offsets), rec.shape, rec.begin, rec.end)))
    return found


def shards_index(url: str, files: Mapping[str, int]) -> tuple[TensorEntry, ...]:
    """The full tensors of the per-rank shard files among `files` (name -> size), their pieces as chunks.

    Raises:
        CorruptCheckpoint: a header or its sharding info does not parse, or the pieces of a tensor disagree
            on its dtype.
    """
    pieces: dict[str, list[_Piece]] = {}
    for file in sorted(f for f in files if SHARD_FILE.match(f)):
        for name, piece in _pieces(read_header(io.join(url, file), files[file]), file):
            pieces.setdefault(name, []).append(piece)
    entries = []
    for name, parts in pieces.items():
        dtypes = {p.dtype for p in parts}
        if len(dtypes) > 1 or len({len(p.sizes) for p in parts}) > 1:
            raise CorruptCheckpoint(f"the pieces of {name!r} differ in dtype or dimensions")
        shape = _full_shape(parts)
        chunks = tuple(
            TensorChunk(p.file, p.begin, p.end - p.begin, p.offsets, p.sizes, ChunkEncoding.RAW) for p in parts
        )
        entries.append(TensorEntry(name, Component.MODEL, parts[0].dtype, shape, chunks))
    return tuple(entries)


def _full_shape(parts: list[_Piece]) -> tuple[int, ...]:
    """Where the pieces end in each dimension: the full shape, as torch's `HuggingFaceStorageReader` takes it."""
    return tuple(max(p.offsets[d] + p.sizes[d] for p in parts) for d in range(len(parts[0].sizes)))


def shards_problems(url: str, files: Mapping[str, int]) -> list[Problem]:
    """Files of every rank `1..P` present, each header and its sharding info valid, and the pieces of each
    tensor tiling it."""
    by_rank = rank_files(files)
    problems = []
    listed, absent = absent_numbers([r - 1 for r in by_rank], max(by_rank))
    problems += [
        Problem(ProblemKind.MISSING_FILE, f"shard-{r + 1:05d}-*", f"no shard files of rank plan {r + 1}")
        for r in listed
    ]
    if absent > len(listed):
        problems.append(Problem(ProblemKind.MISSING_FILE, "", f"{absent - len(listed)} more ranks have no shard files"))
    pieces: dict[str, list[_Piece]] = {}
    for file in sorted(f for fs in by_rank.values() for f in fs):
        try:
            found = _pieces(read_header(io.join(url, file), files[file]), file)
        except CkptctlError as exc:
            problems.append(Problem.from_error(exc, file))
            continue
        for name, piece in found:
            pieces.setdefault(name, []).append(piece)
    for name, parts in sorted(pieces.items()):
        if len({p.dtype for p in parts}) > 1:
            problems.append(Problem(ProblemKind.BAD_METADATA, parts[0].file, f"the pieces of {name!r} differ in dtype"))
            continue
        if len({len(p.sizes) for p in parts}) > 1:
            problems.append(
                Problem(ProblemKind.BAD_METADATA, parts[0].file, f"the pieces of {name!r} differ in dimensions")
            )
            continue
        why = tiling_problem(_full_shape(parts), [(p.offsets, p.sizes) for p in parts])
        if why is not None:
            problems.append(Problem(ProblemKind.COVERAGE, name, f"{name}: {why}"))
    return problems
