"""torch DCP `.metadata`: parsed without torch and without executing the pickle, then validated.

torch writes `.metadata` with `pickle.dump(Metadata(...))` and reads it back with plain `pickle.load`.
ckptctl unpickles it with `dcp_metadata_classes.DCP_METADATA_GLOBALS` (inert stand-ins for the few torch
classes it names) and turns the result into the frozen dataclasses below, checking every type and value
on the way: a file that parses here has string keys, known dtypes, non-negative sizes and offsets whose
dimensions agree, and storage paths that stay inside the checkpoint folder. Whether the chunks tile
their tensors and the storage records fit their files is `verify`'s business (`families.dcp_folder`), so that it
can report each problem instead of stopping at the first.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ckptctl.checkpoint import dtype_itemsize, known_dtypes
from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.dcp_metadata_classes import DCP_METADATA_GLOBALS, DCP_STAND_INS
from ckptctl.formats.safe_pickle import (
    MAX_DIMS,
    Allowlist,
    OpaqueObject,
    StandIn,
    gc_paused,
    parse_pickle,
    state_fields,
)
from ckptctl.formats.torch_save_classes import DType

__all__ = [
    "METADATA_NAME",
    "RANK_METADATA",
    "DcpBytesItem",
    "DcpChunk",
    "DcpMetadata",
    "DcpTensor",
    "StorageKey",
    "StorageRecord",
    "dcp_metadata_from",
    "merge_rank_metadata",
    "parse_dcp_metadata",
]

#: The file name torch gives the global metadata of a DCP checkpoint.
METADATA_NAME = ".metadata"
#: What `dcp.save(..., use_collectives=False)` writes instead (torch 2.13 `filesystem.py` `finish`): each rank
#: its own `__{rank}.metadata`, describing only what that rank wrote, and nobody a global one.
RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")

#: Storage records are keyed by (flattened key, chunk offsets); bytes items have no offsets.
StorageKey = tuple[str, tuple[int, ...] | None]

_MAX_INT = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class DcpChunk:
    """One stored chunk of a tensor: where it sits in the full tensor and its shape."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class DcpTensor:
    """A tensor of the state dict: dtype (torch-style name), full size, and its stored chunks."""

    dtype: str
    size: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class DcpBytesItem:
    """A non-tensor value of the state dict (torch.save'd object bytes: learning rates, step counters)."""


class StorageRecord(NamedTuple):
    """Where one item's bytes are: a file relative to the checkpoint, and a byte range in it.

    A named tuple rather than a dataclass: a 100k-tensor checkpoint has 100k of them, and the parser builds
    them with `tuple.__new__` at C speed.

    Attributes:
        relative_path: the data file, relative to the checkpoint folder (never absolute, never `..`).
        offset: first byte of the item in that file.
        length: length of the item (for tensors, a whole torch.save archive).
        transforms: stream transforms applied at save time (e.g. compression extensions); empty for the
            default writer.
    """

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


_new_record = functools.partial(tuple.__new__, StorageRecord)


@dataclass(frozen=True, slots=True)
class DcpMetadata:
    """A parsed, validated DCP `.metadata`.

    Attributes:
        entries: flattened state-dict key → tensor or bytes item, in the order torch stored them.
        storage: (key, chunk offsets or None) → storage record.
        version: the DCP format version string (torch 2.13 writes "1.0.0"; older files have none).
        save_id: the writer's id of this save, or None.
        checkpoint_id: the path the checkpoint was written to, as recorded, or None.
        raw_planner_data: the planner's data as unpickled (unvalidated); see `planner_data`.
    """

    entries: Mapping[str, DcpTensor | DcpBytesItem]
    storage: Mapping[StorageKey, StorageRecord]
    version: str | None = None
    save_id: str | None = None
    checkpoint_id: str | None = None
    raw_planner_data: Any = field(default=None, repr=False, compare=False)
    #: Data files that records left out of `storage` name (a merge of per-rank metadata keeps one record of
    #: an item every rank wrote), with the end of their last record.
    other_references: Mapping[str, int] = field(default_factory=dict, repr=False, compare=False)

    @property
    def planner_data(self) -> dict[str, tuple[str | int, ...]]:
        """Flattened key → original nested path, as the default planner records it ({} when absent).

        Validated on access rather than at parse time: nothing in ckptctl needs it to open a checkpoint,
        and custom planners store other things here (then this is empty).
        """
        value = self.raw_planner_data
        if type(value) is not dict:
            return {}
        out: dict[str, tuple[str | int, ...]] = {}
        for key, path in value.items():
            if type(key) is not str or type(path) is not tuple or len(path) > MAX_DIMS:
                return {}
            if not all(type(p) in (str, int) for p in path):
                return {}
            out[key] = path
        return out

    def tensors(self) -> Iterator[tuple[str, DcpTensor]]:
        """The tensor entries, in stored order."""
        for key, item in self.entries.items():
            if isinstance(item, DcpTensor):
                yield key, item

    @property
    def bytes_keys(self) -> tuple[str, ...]:
        return tuple(k for k, v in self.entries.items() if isinstance(v, DcpBytesItem))

    def referenced_files(self) -> dict[str, int]:
        """Data files the storage records name → the end of the last byte range each must hold."""
        ends: dict[str, int] = dict(self.other_references)
        for record in self.storage.values():
            end = record.offset + record.length
            if end > ends.get(record.relative_path, -1):
                ends[record.relative_path] = end
        return ends


def merge_rank_metadata(parts: Sequence[tuple[str, DcpMetadata]]) -> DcpMetadata:
    """One view of a save without collectives: the per-rank metadata `(file name, parsed)` of every rank,
    in rank order, merged as its tensors' chunks and records.

    A rank describes the tensors it holds with their full sizes and only its own chunks; an item several
    ranks wrote (a replicated tensor, a non-tensor value: nothing deduplicates them without collectives)
    keeps the first rank's record, and the others' files stay referenced (`other_references`).

    Raises:
        CorruptCheckpoint: the ranks disagree on a key's dtype, size or kind.
    """
    entries: dict[str, DcpTensor | DcpBytesItem] = {}
    storage: dict[StorageKey, StorageRecord] = {}
    others: dict[str, int] = {}
    for name, part in parts:
        for key, item in part.entries.items():
            seen = entries.get(key)
            if seen is None:
                entries[key] = item
            elif type(seen) is not type(item) or (
                isinstance(item, DcpTensor)
                and isinstance(seen, DcpTensor)
                and (seen.dtype, seen.size) != (item.dtype, item.size)
            ):
                raise CorruptCheckpoint(f"{name} describes {key!r} unlike the ranks before it (dtype, size or kind)")
            elif isinstance(item, DcpTensor) and isinstance(seen, DcpTensor):
                known = set(seen.chunks)
                added = tuple(chunk for chunk in item.chunks if chunk not in known)
                if added:
                    entries[key] = DcpTensor(seen.dtype, seen.size, seen.chunks + added)
        for index, record in part.storage.items():
            if index not in storage:
                storage[index] = record
            else:
                end = record.offset + record.length
                others[record.relative_path] = max(end, others.get(record.relative_path, 0))
    first = parts[0][1] if parts else DcpMetadata({}, {})
    return DcpMetadata(
        entries=entries,
        storage=storage,
        version=first.version,
        save_id=first.save_id,
        checkpoint_id=first.checkpoint_id,
        other_references=others,
    )


#: The largest `.metadata` read. It grows with tensors x ranks (a 70B model sharded over 2,048 ranks: a few
#: hundred MB); larger, it is not a real one (a sparse file, a device).
MAX_METADATA_BYTES = 1 << 30

_BYTES_ITEM = DcpBytesItem()
#: Doubles as the membership check and the way back from a `DType` stand-in to a plain str.
_DTYPE_NAMES = {name: name for name in known_dtypes()}
_STRIDED = "torch.strided"


#: What `parse_dcp_metadata` resolves: DCP's classes, and any other class that runs no code as an opaque value
#: (a storage writer of another library pickles its own `_StorageInfo` subclass: `_storage_info_fields`).
_READ_GLOBALS = Allowlist(DCP_METADATA_GLOBALS, opaque_unknown=True)


def parse_dcp_metadata(data: bytes, source: str) -> DcpMetadata:
    """Parse and validate the bytes of a DCP `.metadata` file; runs nothing the file names.

    Args:
        data: the whole file.
        source: its path or URL, for messages.

    Raises:
        UnsafePickle: the pickle names a global that runs code (any other unknown class is read as opaque).
        CorruptCheckpoint: it is not a DCP metadata pickle, or a value in it is invalid.
    """
    # The parser keys its caches by raw values from the file, so it runs where the unpickler does: on a
    # stack deep enough to hash whatever nesting the file holds. The stand-in tree is freed while
    # collection is still paused: otherwise the first collection after the pause walks millions of
    # objects about to go anyway (a quarter second on 100k keys).
    with gc_paused():
        return parse_pickle(data, _READ_GLOBALS, source, _Parser(source, len(data)).checked_metadata)


def dcp_metadata_from(root: Any, source: str, size: int) -> DcpMetadata:
    """Validate an unpickled stand-in tree (`root`: a `DCP_STAND_INS["Metadata"]`) as `parse_dcp_metadata` does,
    for a checkpointing library whose `.metadata` pickles DCP's classes under a top-level class of its own
    (ByteCheckpoint's), unpickled with an allowlist that maps that class to DCP's stand-in. Call it from the
    `parse` of `safe_pickle.parse_pickle`, which provides the deep stack its caches need.

    Args:
        root: the unpickled object.
        source: the file's path or URL, for messages.
        size: the file's size in bytes (bounds the chunks it may describe).

    Raises:
        CorruptCheckpoint: it is not DCP metadata, or a value in it is invalid.
    """
    return _Parser(source, size).checked_metadata(root)


class _Parser:
    """Turns the stand-in tree into dataclasses; every check names the key it is about."""

    def __init__(self, source: str, size: int) -> None:
        self.source = source
        self.chunk_budget = max(size // 8, 16)
        #: Validated sizes and chunks, shared between the tensors that have them.
        self.dims: dict[Any, tuple[int, ...]] = {}  # keyed by untrusted values: lookups only
        self.chunks: dict[Any, DcpChunk] = {}
        self.tensors: dict[tuple[Any, ...], DcpTensor] = {}

    def fail(self, message: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(
            f"{self.source}: {message}", "the .metadata file is damaged or not a DCP metadata file"
        )

    def checked_metadata(self, root: Any) -> DcpMetadata:
        try:
            return self.metadata(root)
        except CorruptCheckpoint:
            raise
        # The parser checks types before it uses values; should a hostile file still find a path it did
        # not foresee, the caller gets the promised error rather than a traceback.
        except Exception as exc:
            raise CorruptCheckpoint(f"{self.source}: unexpected content ({type(exc).__name__}: {exc})") from exc

    def metadata(self, root: Any) -> DcpMetadata:
        if type(root) is not DCP_STAND_INS["Metadata"]:
            raise self.fail("not a torch DCP metadata pickle (the top object is not a Metadata)")
        state = state_fields(root, self.source)
        raw_entries = state.get("state_dict_metadata")
        if type(raw_entries) is not dict:
            raise self.fail("state_dict_metadata is missing or not a dict")
        entries = self.entries(raw_entries)
        raw_storage = state.get("storage_data")
        if type(raw_storage) is not dict:
            raise self.fail("storage_data is missing or not a dict (not written by the file-system writer)")
        storage = self.storage(raw_storage)
        version = state.get("version")
        if version is not None and (type(version) is not str or len(version) > 64):
            raise self.fail("version is not a short string")
        save_id, checkpoint_id = self.storage_meta(state.get("storage_meta"))
        return DcpMetadata(
            entries=entries,
            storage=storage,
            raw_planner_data=state.get("planner_data"),
            version=version,
            save_id=save_id,
            checkpoint_id=checkpoint_id,
        )

    def entries(self, raw: dict[Any, Any]) -> dict[str, DcpTensor | DcpBytesItem]:
        # The hot loop of a 100k-tensor file. Tensors repeat (every layer has the same dtype, shapes and
        # sharding), so each distinct one is validated once by `tensor_checked` and later found by its
        # raw values (`signature`, inlined here); anything that is not such a hit goes the validating way,
        # which words the error.
        out: dict[str, DcpTensor | DcpBytesItem] = {}
        tensors = self.tensors
        known = tensors.get
        signature_of = self.signature
        tensor_class, bytes_class = DCP_STAND_INS["TensorStorageMetadata"], DCP_STAND_INS["BytesStorageMetadata"]
        for key, item in raw.items():
            kind = type(item)
            if kind is tensor_class and type(key) is str:
                signature = signature_of(item)
                if signature is not None:
                    try:
                        tensor = known(signature)
                    except TypeError:  # unhashable values: not a real tensor record
                        tensor = None
                    if tensor is None:
                        tensor = tensors[signature] = self.tensor_checked(key, item)
                    out[key] = tensor
                    continue
            if type(key) is not str:
                raise self.fail("a state_dict_metadata key is not a string")
            if kind is bytes_class:
                out[key] = _BYTES_ITEM
                continue
            if kind is not tensor_class:
                raise self.fail(f"{key!r} is neither a TensorStorageMetadata nor a BytesStorageMetadata")
            out[key] = self.tensor_checked(key, item)
        return out

    def signature(self, item: StandIn) -> tuple[Any, ...] | None:
        """The raw (dtype, layout, size, chunk offsets and sizes) of a record shaped like torch writes it."""
        try:
            state = item.state
            pstate = state["properties"].state
            raw_chunks = state["chunks"]
            size = state["size"]
        except (AttributeError, KeyError, TypeError):
            return None
        if (
            type(state) is not dict
            or type(pstate) is not tuple
            or len(pstate) != 5
            or type(pstate[0]) is not DType
            or type(raw_chunks) is not list
            or type(state["properties"]) is not DCP_STAND_INS["TensorProperties"]
        ):
            return None
        # A real chunk costs dozens of pickle bytes, but a hostile file can reference one chunk list from
        # many tensors through the memo; this budget keeps the work linear in the file size.
        self.chunk_budget -= len(raw_chunks)
        if self.chunk_budget < 0:
            raise self.fail("more chunks than the file can hold")
        chunk_class = DCP_STAND_INS["ChunkStorageMetadata"]
        if len(raw_chunks) == 1:  # the common case, without the loop
            chunk = raw_chunks[0]
            chunk_state = getattr(chunk, "state", None) if type(chunk) is chunk_class else None
            if type(chunk_state) is not dict:
                return None
            return pstate[0], pstate[1], size, chunk_state.get("offsets"), chunk_state.get("sizes")
        parts = [pstate[0], pstate[1], size]
        for chunk in raw_chunks:
            chunk_state = getattr(chunk, "state", None) if type(chunk) is chunk_class else None
            if type(chunk_state) is not dict:
                return None
            parts.append(chunk_state.get("offsets"))
            parts.append(chunk_state.get("sizes"))
        return tuple(parts)

    def spend(self, n: int) -> None:
        self.chunk_budget -= n
        if self.chunk_budget < 0:
            raise self.fail("more chunks than the file can hold")

    def tensor_checked(self, key: str, item: StandIn) -> DcpTensor:
        state = state_fields(item, self.source)
        dtype = self.dtype(key, state.get("properties"))
        size = self.shape(key, state.get("size"), "size")
        raw_chunks = state.get("chunks")
        if type(raw_chunks) is not list:
            raise self.fail(f"{key!r}: chunks is not a list")
        self.spend(len(raw_chunks))
        ndim = len(size)
        chunks = []
        for raw in raw_chunks:
            if type(raw) is not DCP_STAND_INS["ChunkStorageMetadata"]:
                raise self.fail(f"{key!r}: a chunk is not a ChunkStorageMetadata")
            chunk_state = state_fields(raw, self.source)
            offsets = self.shape(key, chunk_state.get("offsets"), "chunk offsets")
            sizes = self.shape(key, chunk_state.get("sizes"), "chunk sizes")
            if len(offsets) != ndim or len(sizes) != ndim:
                raise self.fail(f"{key!r}: a chunk has {len(offsets)}/{len(sizes)} dims but the tensor has {ndim}")
            chunk = self.chunks.get((offsets, sizes))
            if chunk is None:
                chunk = self.chunks[(offsets, sizes)] = DcpChunk(offsets, sizes)
            chunks.append(chunk)
        return DcpTensor(dtype, size, tuple(chunks))

    def dtype(self, key: str, properties: Any) -> str:
        if type(properties) is not DCP_STAND_INS["TensorProperties"]:
            raise self.fail(f"{key!r}: properties is not a TensorProperties")
        state = getattr(properties, "state", None)
        # TensorProperties.__getstate__ pickles (dtype, layout, requires_grad, memory_format, pin_memory);
        # a plain dict state (a dataclass without __getstate__) is accepted too.
        if type(state) is tuple and len(state) == 5:
            dtype, layout = state[0], state[1]
        else:
            fields = state_fields(properties, self.source)
            dtype, layout = fields.get("dtype"), fields.get("layout", _STRIDED)
        name = _DTYPE_NAMES.get(dtype) if type(dtype) is DType else None
        if name is None:
            raise self.fail(f"{key!r}: dtype is missing or unknown")
        if layout != _STRIDED:
            raise self.fail(f"{key!r}: only dense (strided) tensors are supported")
        return name

    def shape(self, key: str, value: Any, what: str) -> tuple[int, ...]:
        # Shapes repeat a lot (every chunk of every layer): each distinct one is checked once and the
        # checked tuple is shared, which also saves memory on 100k tensors.
        try:
            known = self.dims.get(value)
        except TypeError:  # unhashable: not a size at all
            known = None
            value = None
        if known is not None:
            return known
        if type(value) is not tuple or len(value) > MAX_DIMS:
            raise self.fail(f"{key!r}: {what} is not a torch.Size")
        for d in value:
            if type(d) is not int or not 0 <= d <= _MAX_INT:
                raise self.fail(f"{key!r}: {what} {value!r} has a negative or non-integer entry")
        self.dims[value] = value
        return value

    def storage(self, raw: dict[Any, Any]) -> dict[StorageKey, StorageRecord]:
        out: dict[StorageKey, StorageRecord] = {}
        paths: dict[Any, str] = {}
        dims = self.dims
        new_record = _new_record
        index_class, info_class = DCP_STAND_INS["MetadataIndex"], DCP_STAND_INS["_StorageInfo"]
        for index, info in raw.items():
            # Fast path for what torch writes: known offsets, a file name seen before, plain ints.
            if type(index) is index_class and type(info) is info_class:
                try:
                    istate = index.state
                    rstate = info.state
                    fqn, offset = istate["fqn"], istate["offset"]
                    start, length = rstate["offset"], rstate["length"]
                    path = paths.get(rstate["relative_path"])
                    offsets = None if offset is None else dims.get(offset)
                    plain = (
                        type(istate) is dict and type(rstate) is dict and rstate.get("transform_descriptors") is None
                    )
                except (AttributeError, KeyError, TypeError):  # let the checked path say what is wrong
                    plain = False
                if (
                    plain
                    and type(fqn) is str
                    and path is not None
                    and (offset is None or offsets is not None)
                    and type(start) is int
                    and type(length) is int
                    and 0 <= start <= _MAX_INT
                    and 0 <= length <= _MAX_INT
                ):
                    out[(fqn, offsets)] = new_record((path, start, length, ()))
                    continue
            key, record = self.record_checked(index, info, paths)
            out[key] = record
        return out

    def record_checked(self, index: Any, info: Any, paths: dict[Any, str]) -> tuple[StorageKey, StorageRecord]:
        rec = self.storage_info_fields(info)
        if type(index) is not DCP_STAND_INS["MetadataIndex"] or rec is None:
            raise self.fail("a storage_data entry is not a MetadataIndex → _StorageInfo pair")
        idx = state_fields(index, self.source)
        fqn = idx.get("fqn")
        if type(fqn) is not str:
            raise self.fail("a storage record has no key name")
        offset = idx.get("offset")
        key: StorageKey = (fqn, None if offset is None else self.shape(fqn, offset, "storage offset"))
        path = rec.get("relative_path")
        if type(path) is not str:
            raise self.fail(f"{fqn!r}: storage record has no file name")
        checked = paths[path] = self.relative_path(fqn, path)
        start, length = rec.get("offset"), rec.get("length")
        if (
            type(start) is not int
            or type(length) is not int
            or not (0 <= start <= _MAX_INT and 0 <= length <= _MAX_INT)
        ):
            raise self.fail(f"{fqn!r}: storage record has an invalid byte range")
        transforms = rec.get("transform_descriptors")
        return key, StorageRecord(
            checked, start, length, () if transforms is None else self.transforms(fqn, transforms)
        )

    def storage_info_fields(self, info: Any) -> dict[str, Any] | None:
        """The fields of a storage record: DCP's `_StorageInfo`, or a class of another library (a storage
        writer's own subclass, read as opaque) whose state holds `_StorageInfo`'s fields, which is how
        `FileSystemReader` uses it (`relative_path`, `offset`, `length`); None for anything else."""
        if type(info) is DCP_STAND_INS["_StorageInfo"]:
            return state_fields(info, self.source)
        if not isinstance(info, OpaqueObject) or type(info.state) is not dict:
            return None
        fields = info.state
        if type(fields.get("relative_path")) is str and type(fields.get("offset")) is int:
            return fields if type(fields.get("length")) is int else None
        return None

    def relative_path(self, fqn: str, path: str) -> str:
        # The file names come from the file: one that pointed outside the folder would make ckptctl read
        # (and report sizes of) files the checkpoint does not own.
        parts = path.split("/")
        if (
            not path
            or len(path) > 1024
            or path.startswith("/")
            or "\\" in path
            or "\x00" in path
            or any(p in ("", ".", "..") for p in parts)
        ):
            raise self.fail(f"{fqn!r}: storage file name {path[:100]!r} is not a plain relative path")
        return path

    def transforms(self, fqn: str, value: Any) -> tuple[str, ...]:
        if type(value) not in (list, tuple) or len(value) > 16 or not all(type(v) is str for v in value):
            raise self.fail(f"{fqn!r}: transform_descriptors is not a list of names")
        return tuple(value)

    def storage_meta(self, value: Any) -> tuple[str | None, str | None]:
        if value is None:
            return None, None
        if type(value) is not DCP_STAND_INS["StorageMeta"]:
            raise self.fail("storage_meta is not a StorageMeta")
        state = state_fields(value, self.source)
        save_id, checkpoint_id = state.get("save_id"), state.get("checkpoint_id")
        return (
            save_id if type(save_id) is str else None,
            checkpoint_id if type(checkpoint_id) is str else None,
        )
