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
tensor in `DCP_SHARDING_INFO`. Nothing records the full shapes: torch's `HuggingFaceStorageReader` takes
where the pieces end, so a folder that lost the last rank's files would read as a smaller model that still
tiles. Here the full shapes are also held against what `config.json` gives (the embeddings and `lm_head` are
`[vocab_size, hidden_size]`, the language model's norms `[hidden_size]`) and against each other (a norm is as long as the
embeddings are wide): a tensor whose pieces end short of that has the config's shape, its pieces do not
cover it, and the ranks whose files would hold the rest (from the size of the first rank's piece) are named
as missing files. Files of a rank between others missing show up by their numbering (ranks `1..P`).
Replicated tensors are written once (torch's planner deduplicates them across ranks).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ckptctl import io
from ckptctl.checkpoint import ChunkEncoding, Component, Problem, ProblemKind, TensorChunk, TensorEntry
from ckptctl.contract.base import absent_numbers
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.chunks import tiling_problem
from ckptctl.formats.documents import parse_json, read_json
from ckptctl.formats.safetensors import SafetensorsHeader, read_header

__all__ = ["SHARD_FILE", "is_distributed", "missing_rank_files", "rank_files", "shards_index", "shards_problems"]

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


#: Tensors whose full shape config.json gives, by name: the config keys of their dimensions.
#: Only the language model's own names (a vision tower's norms are of another width).
_TEXT_MODEL = r"^(?:model\.)?(?:language_model\.)?(?:model\.)?"
_EMBEDDING = re.compile(_TEXT_MODEL + r"embed_tokens\.weight$")
_CONFIG_SHAPES = (
    (re.compile(_TEXT_MODEL + r"embed_tokens\.weight$|^lm_head\.weight$"), ("vocab_size", "hidden_size")),
    (
        re.compile(_TEXT_MODEL + r"(?:norm|layers\.\d+\.(?:input_layernorm|post_attention_layernorm))\.weight$"),
        ("hidden_size",),
    ),
)
#: The largest config.json read (real ones are a few KiB).
_MAX_CONFIG = 1 << 20


def _config_sizes(url: str) -> dict[str, int]:
    """`vocab_size` and `hidden_size` from the folder's `config.json` (or its `text_config`), those it gives as
    integers; none without one."""
    try:
        config = read_json(io.join(url, "config.json"), max_bytes=_MAX_CONFIG)
    except CkptctlError:
        return {}  # verify names a config that does not parse
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config")
    sizes = {}
    for key in ("vocab_size", "hidden_size"):
        value = config.get(key, text.get(key) if isinstance(text, dict) else None)
        if type(value) is int and value > 0:
            sizes[key] = value
    return sizes


def _whole_shapes(url: str, pieces: Mapping[str, list[_Piece]]) -> dict[str, tuple[int, ...]]:
    """Each tensor's full shape: where its pieces end, or larger where config.json or the embeddings' width
    say so (see the module docstring)."""
    sizes = _config_sizes(url)
    if "hidden_size" not in sizes:  # the embeddings' width, which a dim-0 sharding never cuts
        for name, parts in pieces.items():
            if _EMBEDDING.search(name) and len(parts[0].sizes) == 2:
                sizes["hidden_size"] = _full_shape(parts)[1]
                break
    shapes = {}
    for name, parts in pieces.items():
        shape = _full_shape(parts)
        keys = next((keys for pattern, keys in _CONFIG_SHAPES if pattern.search(name)), None)
        if keys is not None and len(keys) == len(shape) and all(k in sizes for k in keys):
            want = tuple(sizes[k] for k in keys)
            if all(w >= s for w, s in zip(want, shape, strict=True)):
                shape = want
        shapes[name] = shape
    return shapes


def _read_pieces(url: str, files: Mapping[str, int], problems: list[Problem] | None) -> dict[str, list[_Piece]]:
    """The pieces of every tensor in the shard files among `files`, by tensor name.

    Raises:
        CorruptCheckpoint: a header or its sharding info does not parse (unless `problems` takes it).
    """
    pieces: dict[str, list[_Piece]] = {}
    for file in sorted(f for f in files if SHARD_FILE.match(f)):
        try:
            found = _pieces(read_header(io.join(url, file), files[file]), file)
        except CkptctlError as exc:
            if problems is None:
                raise
            problems.append(Problem.from_error(exc, file))
            continue
        for name, piece in found:
            pieces.setdefault(name, []).append(piece)
    return pieces


def missing_rank_files(url: str, files: Mapping[str, int]) -> list[str]:
    """The shard files of the ranks a folder lacks: those between present ranks, and those after the last one
    that tensors cut short of their full shape (`_whole_shapes`) need, counted from the first rank's piece."""
    by_rank = rank_files(files)
    if not by_rank:
        return []
    try:
        pieces = _read_pieces(url, files, None)
    except CkptctlError:
        pieces = {}  # verify names the unreadable file; the names alone still show gaps
    needed = max(by_rank)
    for name, whole in _whole_shapes(url, pieces).items():
        parts = pieces[name]
        ends = _full_shape(parts)
        for dim, (end, size) in enumerate(zip(ends, whole, strict=True)):
            first = next((p.sizes[dim] for p in parts if p.offsets[dim] == 0 and p.sizes[dim]), 0)
            if end < size and first:
                needed = max(needed, -(-size // first))
    suffixes = sorted({f.partition("-model-")[2] for names in by_rank.values() for f in names})
    listed, _ = absent_numbers([r - 1 for r in by_rank], needed)
    return [f"shard-{r + 1:05d}-model-{suffix}" for r in listed for suffix in suffixes]


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
    pieces = _read_pieces(url, files, None)
    for name, parts in pieces.items():
        if len({p.dtype for p in parts}) > 1 or len({len(p.sizes) for p in parts}) > 1:
            raise CorruptCheckpoint(f"the pieces of {name!r} differ in dtype or dimensions")
    shapes = _whole_shapes(url, pieces)
    entries = []
    for name, parts in pieces.items():
        shape = shapes[name]
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
    problems: list[Problem] = []
    listed, absent = absent_numbers([r - 1 for r in by_rank], max(by_rank))
    missing = missing_rank_files(url, files)
    problems += [
        Problem(ProblemKind.MISSING_FILE, name, f"{name} is missing: the pieces of rank plan {name[6:11].lstrip('0')}")
        for name in missing
    ]
    if absent > len(listed):
        problems.append(Problem(ProblemKind.MISSING_FILE, "", f"{absent - len(listed)} more ranks have no shard files"))
    pieces = _read_pieces(url, {f: files[f] for fs in by_rank.values() for f in fs}, problems)
    consistent = {
        name: parts
        for name, parts in pieces.items()
        if len({p.dtype for p in parts}) == 1 and len({len(p.sizes) for p in parts}) == 1
    }
    shapes = _whole_shapes(url, consistent)
    for name, parts in sorted(pieces.items()):
        if len({p.dtype for p in parts}) > 1:
            problems.append(Problem(ProblemKind.BAD_METADATA, parts[0].file, f"the pieces of {name!r} differ in dtype"))
            continue
        if len({len(p.sizes) for p in parts}) > 1:
            problems.append(
                Problem(ProblemKind.BAD_METADATA, parts[0].file, f"the pieces of {name!r} differ in dimensions")
            )
            continue
        whole = shapes[name]
        why = tiling_problem(whole, [(p.offsets, p.sizes) for p in parts])
        if why is not None:
            short = " (config.json's shape: some rank's pieces are missing)" if whole != _full_shape(parts) else ""
            problems.append(Problem(ProblemKind.COVERAGE, name, f"{name} {list(whole)}{short}: {why}"))
    return problems
