"""torch.save archives holding one tensor (what torch DCP stores per item): decode, or locate the raw bytes.

An archive is a zip (`PK\\x03\\x04`) with records `<name>/data.pkl` (a small pickle that rebuilds the
tensor from a storage), `<name>/byteorder`, and `<name>/data/<key>` (the storage's bytes, stored
uncompressed and 64-byte aligned by torch's writer).

- `decode_tensor` loads a tensor with torch's own allowlisting unpickler (`weights_only=True`); ckptctl
  never calls `pickle.load` or `weights_only=False` on checkpoint data.
- `inspect_archive`/`raw_record` (and `inspect_archive_at`, by range reads) find where the tensor's elements are inside the archive without torch:
  the zip's central directory gives the storage record's position, and `data.pkl` (read with the
  `TORCH_SAVE_GLOBALS` stand-ins) gives dtype, shape, stride and storage offset. When the tensor is a
  row-major view of its storage in little-endian order, its elements are one contiguous byte range that a
  converter can copy as is. DCP's writer clones views whose storage is larger than the tensor, so for
  items written by DCP the range is the whole storage record.
- `read_zip_directory` reads the directory of a whole torch.save file on disk or in an object store with
  a few range reads at its end; its `ZipDirectory` then reads single records and local headers
  (`formats.torch_pickle` builds on it).
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import re
import struct
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptctl import io as ckpt_io
from ckptctl.checkpoint import dtype_itemsize
from ckptctl.errors import CkptctlError, CorruptCheckpoint, UnsafePickle
from ckptctl.formats.torch_save_classes import (
    OBJECT_READ_GLOBALS,
    TORCH_SAVE_GLOBALS,
    DType,
    NumpyArray,
    NumpyDType,
    NumpyScalar,
    TensorRebuild,
    load_torch_save_pickle,
)
from ckptctl.formats.torch_zip import RangeReader

if TYPE_CHECKING:
    import torch

__all__ = [
    "ArchiveTensor",
    "ZipDirectory",
    "ZipRecord",
    "decode_tensor",
    "inspect_archive",
    "inspect_archive_at",
    "is_torch_save_archive",
    "load_object_archive",
    "raw_record",
    "read_object_archive",
    "read_zip_directory",
]

_ZIP_MAGIC = b"PK\x03\x04"
_REFUSED_GLOBAL = re.compile(r"unsupported global:?\s+(?:GLOBAL\s+)?([\w.]+)", re.IGNORECASE)
_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # signature ... file name length, extra field length
#: data.pkl of one tensor is ~200 bytes; a larger one is not a single plain tensor.
_MAX_DATA_PKL = 64 << 10
#: data.pkl of a DCP bytes item (an optimizer hyperparameter, a list of parameter names) is small.
_MAX_OBJECT_PKL = 16 << 20
#: Nesting deeper than any value a state dict holds.
_MAX_OBJECT_DEPTH = 100
#: What a plain value of a torch.save archive may be besides containers and tensors.
_PLAIN_VALUES = (str, bytes, int, float, complex, bool, type(None), DType)
_NUMPY_VALUES = (NumpyArray, NumpyScalar, NumpyDType)


@dataclass(frozen=True, slots=True)
class ArchiveTensor:
    """What a torch.save archive of one tensor holds, and where its elements are.

    Attributes:
        dtype: torch-style dtype name.
        shape: the tensor's shape.
        contiguous: whether the elements are stored row-major, little-endian, without gaps, so that
            `start:end` is exactly the tensor's bytes.
        start: first byte of the tensor's elements inside the archive (when `contiguous`).
        end: one past the last byte (when `contiguous`).
    """

    dtype: str
    shape: tuple[int, ...]
    contiguous: bool
    start: int
    end: int


def is_torch_save_archive(blob: bytes | memoryview) -> bool:
    """Whether `blob` starts like a torch.save zip archive."""
    return bytes(blob[:4]) == _ZIP_MAGIC


def decode_tensor(blob: bytes | memoryview, source: str) -> torch.Tensor:
    """Load the tensor of a torch.save archive with `torch.load(weights_only=True)`.

    Args:
        blob: the whole archive.
        source: where it came from (file and key), for messages.

    Raises:
        UnsafePickle: the archive's pickle asks for something torch's allowlist refuses.
        CorruptCheckpoint: it is not an archive of one tensor.
    """
    import pickle

    import torch

    if not is_torch_save_archive(blob):
        raise CorruptCheckpoint(
            f"{source}: not a torch.save archive",
            "the item may have been written with a stream transform or the safetensors serialization "
            "format, which ckptctl does not read",
        )
    try:
        value = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # weights_only refuses globals outside torch's allowlist with UnpicklingError. Its message
        # suggests retrying with weights_only=False, advice ckptctl must not pass on.
        refused = _REFUSED_GLOBAL.search(str(exc))
        if refused:
            raise UnsafePickle(
                f"{source}: the archive's pickle asks for {refused.group(1)}, which torch's weights_only loader "
                "refuses; nothing in it was executed"
            ) from exc
        raise CorruptCheckpoint(f"{source}: unreadable torch.save archive (the pickle is damaged)") from exc
    # torch.load reports damaged archives with RuntimeError (zip reader), EOFError, ValueError and more.
    except Exception as exc:
        raise CorruptCheckpoint(
            f"{source}: unreadable torch.save archive ({type(exc).__name__}: {_first_line(exc)})"
        ) from exc
    if not isinstance(value, torch.Tensor):
        raise CorruptCheckpoint(f"{source}: the archive holds a {type(value).__name__}, not a tensor")
    return value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def raw_record(blob: bytes | memoryview, source: str = "torch.save archive") -> tuple[int, int] | None:
    """The byte range `(start, end)` of the tensor's elements inside the archive, if it is one plain range.

    None when the tensor is not stored row-major and gapless in little-endian order (then decode it).

    Raises:
        CorruptCheckpoint: the archive is damaged or does not hold one tensor.
    """
    found = inspect_archive(blob, source)
    return (found.start, found.end) if found.contiguous else None


def inspect_archive(blob: bytes | memoryview, source: str) -> ArchiveTensor:
    """Read the zip directory and `data.pkl` of a one-tensor archive, without torch and without its data.

    Only the central directory, two small records and one local header are read, so passing a
    memoryview of an mmap'd data file costs no copy of the tensor bytes.

    Raises:
        UnsafePickle: `data.pkl` names a global outside `TORCH_SAVE_GLOBALS`.
        CorruptCheckpoint: the archive is damaged or does not hold one plain tensor.
    """
    archive = _open_archive(blob, source, _MAX_DATA_PKL)
    rebuilt = _one_tensor(archive.pickled, source)
    return _locate(archive.view, archive.infos, archive.prefix, rebuilt, archive.little, source)


def inspect_archive_at(read_at: Callable[[int, int], bytes], length: int, source: str) -> ArchiveTensor:
    """`inspect_archive` of the one-tensor archive `length` bytes long that `read_at(start, n)` reads (a DCP
    item inside its data file; never asked for bytes past `length`), reading its first and last few KiB
    only: `data.pkl`, `byteorder` and the data record's local header lie at its start, the zip directory at
    its end. Nothing is mapped: a read error is an exception, where a page-in error under a map (NFS, FUSE)
    kills the process.

    Raises:
        UnsafePickle: `data.pkl` names a global outside `TORCH_SAVE_GLOBALS`.
        CorruptCheckpoint: the archive is damaged, cut short, or does not hold one plain tensor.
    """
    archive = _open_view(_RangeView(read_at, length), source, _MAX_DATA_PKL)
    rebuilt = _one_tensor(archive.pickled, source)
    return _locate(archive.view, archive.infos, archive.prefix, rebuilt, archive.little, source)


#: What `_RangeView` reads at each end of an archive: torch puts its small records first (the data record's
#: header follows within the first KiB) and a one-tensor archive's directory is under 1 KiB.
_ENDS = 4 << 10


class _RangeView:
    """The bytes of an archive as `inspect_archive` slices them, read by `read_at`: its first and last `_ENDS`
    bytes once, any other range when asked (fewer bytes past a cut-short end, which the parsers refuse)."""

    def __init__(self, read_at: Callable[[int, int], bytes], length: int) -> None:
        self._read_at = read_at
        self._length = length
        self._head = read_at(0, min(length, _ENDS))
        self._tail_start = max(len(self._head), length - _ENDS)
        self._tail = read_at(self._tail_start, length - self._tail_start) if length > self._tail_start else b""

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: slice) -> bytes:
        start, stop, _ = index.indices(self._length)
        if stop <= start:
            return b""
        if stop <= len(self._head):
            return self._head[start:stop]
        if start >= self._tail_start:
            return self._tail[start - self._tail_start : stop - self._tail_start]
        return self._read_at(start, stop - start)


#: A one-tensor `data.pkl` is ~150 bytes; larger ones (crafted, or not one tensor) are not kept.
_KEPT_PICKLE = 1 << 10


@functools.lru_cache(maxsize=512)
def _tensor_of_pickle(pickled: bytes) -> TensorRebuild | None:
    rebuilt = load_torch_save_pickle(pickled, "data.pkl")
    return rebuilt if isinstance(rebuilt, TensorRebuild) else None


def _one_tensor(pickled: bytes, source: str) -> TensorRebuild:
    """The tensor a one-tensor archive's `data.pkl` rebuilds.

    Tensors of the same dtype, shape and strides pickle to the same bytes (storage key and location too): a
    DCP save holds hundreds of them (every layer's weights alike, each optimizer moment like its parameter),
    so the facts are kept by those bytes and each distinct pickle is unpickled once. What a pickle rebuilds
    depends on its bytes alone, and `_locate` only reads the facts. A pickle that fails is not kept: it is
    unpickled again, the message naming this archive.
    """
    try:
        rebuilt = _tensor_of_pickle(pickled) if len(pickled) <= _KEPT_PICKLE else None
    except CkptctlError:
        rebuilt = None
    if rebuilt is None:
        found = load_torch_save_pickle(pickled, f"{source} data.pkl")
        if not isinstance(found, TensorRebuild):
            raise CorruptCheckpoint(f"{source}: the archive does not hold a plain tensor")
        rebuilt = found
    return rebuilt


@dataclass(frozen=True, slots=True)
class _OpenedArchive:
    """A torch.save archive in memory: its zip directory, archive prefix, `data.pkl` and byte order."""

    view: memoryview | _RangeView
    infos: dict[str, zipfile.ZipInfo]
    prefix: str
    pickled: bytes
    little: bool


def _open_archive(blob: bytes | memoryview, source: str, max_pickle: int) -> _OpenedArchive:
    view = memoryview(blob).cast("B") if not isinstance(blob, bytes) else memoryview(blob)
    return _open_view(view, source, max_pickle)


def _open_view(view: memoryview | _RangeView, source: str, max_pickle: int) -> _OpenedArchive:
    if bytes(view[:4]) != _ZIP_MAGIC:  # `is_torch_save_archive`, for either kind of view
        raise CorruptCheckpoint(
            f"{source}: not a torch.save archive",
            "the item may have been written with a stream transform or the safetensors serialization "
            "format, which ckptctl does not read",
        )
    try:
        with zipfile.ZipFile(RangeReader(lambda start, n: bytes(view[start : start + n]), len(view))) as archive:
            infos = {info.filename: info for info in archive.infolist()}
            pkl_names = [n for n in infos if n.count("/") == 1 and n.endswith("/data.pkl")]
            if len(pkl_names) != 1:
                raise CorruptCheckpoint(f"{source}: not a torch.save archive (no single data.pkl record)")
            prefix = pkl_names[0][: -len("data.pkl")]
            pkl_info = infos[pkl_names[0]]
            if pkl_info.file_size > max_pickle:
                raise CorruptCheckpoint(f"{source}: data.pkl is larger than {max_pickle} bytes")
            pickled = _stored_bytes(view, pkl_info, source)
            order = infos.get(prefix + "byteorder")
            little = order is None or _stored_bytes(view, order, source) == b"little"
    except CkptctlError:
        raise
    # zipfile reports damaged directories with BadZipFile, struct.error, ValueError, EOFError, ...
    except Exception as exc:
        raise CorruptCheckpoint(f"{source}: damaged torch.save archive ({type(exc).__name__}: {exc})") from exc
    return _OpenedArchive(view, infos, prefix, pickled, little)


def read_object_archive(blob: bytes | memoryview, source: str) -> Any:
    """The object a torch.save archive of a plain value holds (a DCP bytes item: a learning rate, a
    tuple of betas, a list of parameter names, an RNG state), read with the `OBJECT_READ_GLOBALS` allowlist
    (numpy values come back as inert stand-ins).

    Tensors inside come back as `TensorRebuild` facts, checked to lie inside their storage records; use
    `load_object_archive` for real tensors. Nothing of the pickle runs: torch DCP itself would
    `torch.load(weights_only=False)` these bytes, which runs whatever a crafted pickle asks for.

    Raises:
        UnsafePickle: the pickle names a global outside the allowlist (nothing of it ran).
        CorruptCheckpoint: not a torch.save archive, damaged, or a tensor outside its storage.
    """
    value, _ = _object_and_tensors(blob, source, numpy=True)
    return value


def load_object_archive(blob: bytes | memoryview, source: str) -> Any:
    """`read_object_archive` with every tensor rebuilt as a real CPU `torch.Tensor` (copied out of `blob`)
    and every dtype as a real `torch.dtype`: the value torch.save was given, built without unpickling
    anything but plain containers and scalars.

    Raises:
        UnsafePickle, CorruptCheckpoint: as `read_object_archive`; big-endian storages are refused.
    """
    import torch

    value, located = _object_and_tensors(blob, source)

    def tensor_of(rebuilt: TensorRebuild) -> torch.Tensor:
        found = located[id(rebuilt)]
        dtype = getattr(torch, rebuilt.dtype)
        if math.prod(rebuilt.shape) == 0:
            return torch.empty(rebuilt.shape, dtype=dtype)
        if not found.little:
            raise CorruptCheckpoint(f"{source}: big-endian storages are not supported")
        itemsize = dtype_itemsize(rebuilt.dtype)
        span = 1 + sum((d - 1) * s for d, s in zip(rebuilt.shape, rebuilt.stride, strict=True))
        data = bytearray(found.view[found.start : found.start + span * itemsize])
        flat = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
        return torch.as_strided(flat, rebuilt.shape, rebuilt.stride).clone().requires_grad_(rebuilt.requires_grad)

    def convert(obj: Any, depth: int) -> Any:
        if depth > _MAX_OBJECT_DEPTH:
            raise CorruptCheckpoint(f"{source}: the value is nested deeper than {_MAX_OBJECT_DEPTH} levels")
        kind = type(obj)
        if kind is TensorRebuild:
            return tensor_of(obj)
        if kind is DType:
            return getattr(torch, obj)
        if kind is dict:
            # The keys are converted too, under the same depth bound: building the new dict hashes each key
            # again, and hashing a tuple a million levels deep overflows the C stack (this runs on the
            # caller's thread, not on the unpickler's deep one).
            return {convert(key, depth + 1): convert(item, depth + 1) for key, item in obj.items()}
        if kind is list:
            return [convert(item, depth + 1) for item in obj]
        if kind is tuple:
            return tuple(convert(item, depth + 1) for item in obj)
        return obj

    return convert(value, 0)


@dataclass(frozen=True, slots=True)
class _LocatedStorage:
    view: memoryview
    start: int
    little: bool


def _object_and_tensors(
    blob: bytes | memoryview, source: str, *, numpy: bool = False
) -> tuple[Any, dict[int, _LocatedStorage]]:
    """The unpickled value and, by `id()` of each `TensorRebuild` in it, where its first element is (`numpy`:
    numpy values are allowed, as inert stand-ins)."""
    archive = _open_archive(blob, source, _MAX_OBJECT_PKL)
    allowed = OBJECT_READ_GLOBALS if numpy else TORCH_SAVE_GLOBALS
    value = load_torch_save_pickle(archive.pickled, f"{source} data.pkl", allowed)
    plain = _PLAIN_VALUES + _NUMPY_VALUES if numpy else _PLAIN_VALUES
    located: dict[int, _LocatedStorage] = {}
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        obj, depth = stack.pop()
        kind = type(obj)
        if kind is TensorRebuild:
            found = _locate(archive.view, archive.infos, archive.prefix, obj, archive.little, source)
            # `_locate` gives the first element's byte, whatever the strides
            assert isinstance(archive.view, memoryview)  # `_open_archive`'s, never a `_RangeView`
            located[id(obj)] = _LocatedStorage(archive.view, found.start, archive.little)
        elif kind in (dict, list, tuple):
            if depth >= _MAX_OBJECT_DEPTH:
                raise CorruptCheckpoint(f"{source}: the value is nested deeper than {_MAX_OBJECT_DEPTH} levels")
            stack.extend((item, depth + 1) for item in (obj.values() if kind is dict else obj))
        elif not isinstance(obj, plain):
            # The allowlist has only tensor-rebuild helpers, storages and dtypes besides builtins; a
            # storage tag or other helper object as a value means the pickle was crafted.
            raise CorruptCheckpoint(f"{source}: the value holds a {kind.__name__}, which torch.save never writes there")
    return value, located


def _locate(
    view: memoryview | _RangeView,
    infos: dict[str, zipfile.ZipInfo],
    prefix: str,
    t: TensorRebuild,
    little: bool,
    source: str,
) -> ArchiveTensor:
    try:
        itemsize = dtype_itemsize(t.dtype)
    except KeyError:
        raise CorruptCheckpoint(f"{source}: unsupported dtype {t.dtype}") from None
    numel = math.prod(t.shape)
    nbytes = numel * itemsize
    if numel == 0:
        return ArchiveTensor(t.dtype, t.shape, True, 0, 0)
    record = infos.get(f"{prefix}data/{t.storage.key}")
    if record is None:
        raise CorruptCheckpoint(f"{source}: the storage record data/{t.storage.key} is missing")
    # Typed (legacy) storages count elements, untyped ones count bytes.
    storage_bytes = t.storage.numel * (itemsize if t.storage.dtype is not None else 1)
    if record.file_size != storage_bytes or record.compress_type != zipfile.ZIP_STORED:
        raise CorruptCheckpoint(f"{source}: the storage record does not hold the {storage_bytes} bytes data.pkl claims")
    # The furthest element the view reaches must lie inside the storage.
    last = t.storage_offset + sum((d - 1) * s for d, s in zip(t.shape, t.stride, strict=True))
    if any(s < 0 for s in t.stride) or (last + 1) * itemsize > storage_bytes:
        raise CorruptCheckpoint(f"{source}: the tensor reaches outside its storage")
    start = _data_start(view, record, source) + t.storage_offset * itemsize
    # A dimension of size 1 never steps, so its stride is irrelevant (torch leaves it arbitrary at times).
    contiguous = little and all(
        d == 1 or s == e for d, s, e in zip(t.shape, t.stride, _row_major_strides(t.shape), strict=True)
    )
    return ArchiveTensor(t.dtype, t.shape, contiguous, start, start + nbytes)


def _row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def _data_start(view: memoryview | _RangeView, info: zipfile.ZipInfo, source: str) -> int:
    offset = info.header_offset
    if offset + _LOCAL_HEADER.size > len(view):
        raise CorruptCheckpoint(f"{source}: a zip record header lies outside the archive")
    start = offset + _local_header_length(view[offset : offset + _LOCAL_HEADER.size], source)
    if start + info.file_size > len(view):
        raise CorruptCheckpoint(f"{source}: a zip record runs past the end of the archive")
    return start


def _local_header_length(header: bytes | memoryview, source: str) -> int:
    """Bytes from a record's local header to its data (the fixed part, its name and its extra field)."""
    if len(header) < _LOCAL_HEADER.size:
        raise CorruptCheckpoint(f"{source}: a zip record header lies outside the file", "the file is truncated")
    fields = _LOCAL_HEADER.unpack_from(header, 0)
    if fields[0] != _ZIP_MAGIC:
        raise CorruptCheckpoint(f"{source}: a zip record header is damaged")
    return int(_LOCAL_HEADER.size + fields[-2] + fields[-1])


def _stored_bytes(view: memoryview | _RangeView, info: zipfile.ZipInfo, source: str) -> bytes:
    if info.compress_type != zipfile.ZIP_STORED:
        raise CorruptCheckpoint(f"{source}: record {info.filename} is compressed, torch.save never does that")
    start = _data_start(view, info, source)
    return bytes(view[start : start + info.file_size])


# --------------------------------------------------------------------------------------------------
# torch.save files on disk (or in an object store): the zip directory and single records by range reads.
# --------------------------------------------------------------------------------------------------

#: Bytes read from the end of a file in the first request: the end-of-directory records and, for the
#: files a training state holds (a few dozen records), the whole central directory.
_TAIL_READ = 8 << 10


@dataclass(frozen=True, slots=True)
class ZipRecord:
    """One record of a torch.save zip file, from its central directory.

    Attributes:
        name: the record's name (`optimizer/data.pkl`, `optimizer/data/3`).
        header_offset: where its local header starts.
        size: its length in bytes (stored records: compressed size = size).
        stored: whether it is stored uncompressed (torch.save never compresses).
    """

    name: str
    header_offset: int
    size: int
    stored: bool


class ZipDirectory:
    """The central directory of a zip file read by range reads, and the file's last bytes (`_TAIL_READ`).

    Reads that fall inside those last bytes are served from memory, so a small file is read once.

    Attributes:
        url: the file.
        size: its size in bytes.
        records: record name -> `ZipRecord`.
    """

    def __init__(self, url: str, size: int, records: dict[str, ZipRecord], tail: bytes) -> None:
        self.url = url
        self.size = size
        self.records = records
        self._tail = tail
        self._tail_start = size - len(tail)

    def read(self, start: int, length: int) -> bytes:
        """`length` bytes from `start` (fewer at the end of the file)."""
        if start >= self._tail_start:
            return self._tail[start - self._tail_start : start - self._tail_start + length]
        if start + length > self._tail_start:  # only the part before the bytes already read
            return (
                ckpt_io.read_bytes(self.url, start, self._tail_start - start)
                + self._tail[: start + length - self._tail_start]
            )
        return ckpt_io.read_bytes(self.url, start, length)

    def data_starts(self, records: Iterable[ZipRecord]) -> dict[str, int]:
        """Where the data of each record starts (past its local header), reading only the headers.

        Raises:
            CorruptCheckpoint: a header is damaged, or a record's data runs past the end of the file.
        """
        starts: dict[str, int] = {}
        wanted = sorted(records, key=lambda r: r.header_offset)
        outside = [r for r in wanted if r.header_offset < self._tail_start]
        handle = ckpt_io.open_read(self.url) if outside else contextlib.nullcontext(None)
        with handle as f:
            for record in wanted:
                if f is not None and record.header_offset < self._tail_start:
                    f.seek(record.header_offset)
                    header = f.read(_LOCAL_HEADER.size)
                    ckpt_io.count_read(len(header))
                else:
                    header = self.read(record.header_offset, _LOCAL_HEADER.size)
                start = record.header_offset + _local_header_length(header, f"{self.url} ({record.name})")
                if start + record.size > self.size:
                    raise CorruptCheckpoint(
                        f"{self.url}: record {record.name} runs past the end of the file ({self.size} bytes)",
                        "the file is truncated",
                    )
                starts[record.name] = start
        return starts

    def read_record(self, record: ZipRecord, limit: int) -> bytes:
        """The bytes of one small stored record (data.pkl), its local header fetched in the same read.

        Raises:
            CorruptCheckpoint: compressed, larger than `limit`, damaged header, or past the end of the file.
        """
        where = f"{self.url} ({record.name})"
        if not record.stored:
            raise CorruptCheckpoint(f"{where}: the record is compressed, torch.save never does that")
        if record.size > limit:
            raise CorruptCheckpoint(f"{where}: {record.size} bytes, more than the {limit} this record may have")
        # One read covers the header, the name, torch's alignment padding (< 64 bytes) and the data.
        guess = _LOCAL_HEADER.size + len(record.name.encode()) + 128 + record.size
        blob = self.read(record.header_offset, guess)
        start = _local_header_length(blob, where)
        if record.header_offset + start + record.size > self.size:
            raise CorruptCheckpoint(f"{where}: the record runs past the end of the file", "the file is truncated")
        if start + record.size > len(blob):
            blob += self.read(record.header_offset + len(blob), start + record.size - len(blob))
        return blob[start : start + record.size]


def read_zip_directory(url: str, size: int | None = None) -> ZipDirectory:
    """The records of the zip file at `url`, from its central directory only (a few range reads at its end).

    Args:
        url: the file.
        size: its size when the caller knows it (saves a stat).

    Raises:
        CorruptCheckpoint: no zip directory (truncated, or not a torch.save zip file at all) or a damaged one.
    """
    if size is None:
        size = ckpt_io.file_size(url)
    reader = _UrlReader(url, size)
    try:
        with zipfile.ZipFile(reader) as archive:
            infos = archive.infolist()
    except zipfile.BadZipFile as exc:
        head = reader.read_at(0, 4)
        if head.startswith(_ZIP_MAGIC):
            raise CorruptCheckpoint(
                f"{url}: the zip directory at its end is missing or damaged ({exc})", "the file is truncated"
            ) from exc
        if head[:1] == b"\x80":
            raise CorruptCheckpoint(
                f"{url}: a torch.save file in the legacy (pre-1.6, non-zip) format, which ckptctl does not read",
                "re-save it with a current torch",
            ) from exc
        raise CorruptCheckpoint(f"{url}: not a torch.save zip file") from exc
    # zipfile reports other damage with struct.error, ValueError, EOFError, UnicodeDecodeError, ...
    except Exception as exc:
        raise CorruptCheckpoint(f"{url}: damaged zip directory ({type(exc).__name__}: {exc})") from exc
    records = {}
    for info in infos:
        if info.header_offset < 0 or info.header_offset + _LOCAL_HEADER.size + info.compress_size > size:
            raise CorruptCheckpoint(
                f"{url}: record {info.filename} lies outside the file ({size} bytes)", "the file is truncated"
            )
        records[info.filename] = ZipRecord(
            info.filename, info.header_offset, info.file_size, info.compress_type == zipfile.ZIP_STORED
        )
    return ZipDirectory(url, size, records, reader.tail)


class _UrlReader(RangeReader):
    """A seekable read-only file over `ckptctl.io` range reads, the file's last bytes fetched at once."""

    def __init__(self, url: str, size: int) -> None:
        self._url = url
        self._tail_start = max(0, size - _TAIL_READ)
        self._tail = ckpt_io.read_bytes(url, self._tail_start) if size else b""
        super().__init__(self.read_at, size)

    @property
    def tail(self) -> bytes:
        return self._tail

    def read_at(self, start: int, length: int) -> bytes:
        if start >= self._tail_start:
            return self._tail[start - self._tail_start : start - self._tail_start + length]
        return ckpt_io.read_bytes(self._url, start, length)
