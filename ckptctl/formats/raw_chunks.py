"""Where a chunk's raw element bytes are, so that a converter can copy them without decoding the tensor.

A chunk is stored either as raw row-major bytes (safetensors) or as a torch.save archive (DCP items) whose
storage record holds the same raw bytes uncompressed. When the chunk is full in its trailing dimensions,
its bytes land in contiguous runs of the full tensor's row-major bytes (one run for an FSDP dim-0 shard,
one per row for a tensor-parallel column shard), and converting is a byte copy.

`ChunkLocator.locate` finds the raw range; `row_major_runs` says where a chunk's rows land in its tensor;
`flat_ranges` puts both together into the byte ranges that hold a whole tensor in row-major order.
`row_slice` makes a part of a stored tensor (a layer of stacked layers, some of its rows) a tensor of its own
whose chunks point at those bytes. Importing this module does not import torch.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ckptctl import io
from ckptctl.checkpoint import ChunkEncoding, TensorChunk, TensorEntry, dtype_itemsize
from ckptctl.errors import CorruptCheckpoint, StorageError
from ckptctl.formats.torch_save import ArchiveTensor, inspect_archive, inspect_archive_at

__all__ = ["ByteRange", "ChunkLocator", "FlatRange", "flat_ranges", "row_major_runs", "row_slice"]


@dataclass(frozen=True, slots=True)
class ByteRange:
    """`length` bytes at `offset` of the file at `url`."""

    url: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class FlatRange:
    """`count` elements of a tensor, from its row-major element `start` on, stored raw at `offset` of `url`."""

    start: int
    count: int
    url: str
    offset: int


def row_major_runs(
    shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], limit: int = 1 << 20
) -> list[tuple[int, int, int]] | None:
    """How a chunk's row-major elements map onto its full tensor's row-major elements, as contiguous runs.

    A chunk that is full in its trailing dimensions (from some dimension `k` on) is contiguous in the
    tensor for every index of its leading dimensions: an FSDP dim-0 shard is one run, a tensor-parallel
    column shard (`Shard(1)` of a matrix) one run per row. Each run is contiguous in the chunk's own
    row-major bytes as well, so copying the runs copies the chunk.

    Args:
        limit: the most runs worth describing; beyond it the chunk is better assembled in memory.

    Returns:
        `(first element in the tensor, first element in the chunk, element count)` per run, in chunk
        order; None when there would be more than `limit` runs.
    """
    ndim = len(shape)
    if ndim == 0:
        return [(0, 0, 1)]
    k = ndim - 1
    while k > 0 and offsets[k] == 0 and sizes[k] == shape[k]:
        k -= 1
    # Dimensions after k are full; dimension k is partial (or k == 0). One run per index of dims < k.
    count = math.prod(sizes[:k])
    if count > limit:
        return None
    strides = _row_major_strides(shape)
    run = sizes[k] * strides[k]
    base = sum(o * st for o, st in zip(offsets, strides, strict=True))
    if k == 0:
        return [(base, 0, run)]
    runs = []
    for chunk_index, index in enumerate(itertools.product(*(range(s) for s in sizes[:k]))):
        start = base + sum(i * st for i, st in zip(index, strides, strict=False))
        runs.append((start, chunk_index * run, run))
    return runs


def _row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return tuple(strides)


def row_slice(
    entry: TensorEntry,
    name: str,
    index: tuple[int, ...],
    rows: Sequence[tuple[int, int]] | None,
    locator: ChunkLocator,
) -> TensorEntry:
    """A part of a stored tensor as a tensor of its own named `name`, whose RAW chunks point at the stored bytes.

    The part is the sub-tensor at `index` of the leading dimensions (a layer of stacked layers) and, of the
    next dimension, the `rows` ranges one after the other (the query rows of each group of a fused projection;
    None: all of them). Within each stored chunk such a part is one contiguous run of its row-major bytes, so
    each chunk it meets gives one RAW chunk of the result: tensor-parallel parts stay separate chunks, and
    converting is still a byte copy.

    Raises:
        ValueError: the part lies outside the tensor, or a chunk's elements are not one range the locator
            finds (a non-contiguous view inside a torch.save archive, an archive on an object store).
        CorruptCheckpoint: a record lies outside its file or disagrees with the metadata (`locate`).
    """
    shape = entry.shape
    k = len(index)
    if k >= len(shape) or any(not 0 <= i < d for i, d in zip(index, shape, strict=False)):
        raise ValueError(f"index {list(index)} lies outside the shape {list(shape)}")
    ranges = tuple(rows) if rows is not None else ((0, shape[k]),)
    if any(not 0 <= a < b <= shape[k] for a, b in ranges):
        raise ValueError(f"rows {list(ranges)} lie outside dimension {k} of the shape {list(shape)}")
    itemsize = dtype_itemsize(entry.dtype)
    chunks: list[TensorChunk] = []
    position = 0
    for a, b in ranges:
        for chunk in entry.chunks:
            offsets, sizes = chunk.offsets, chunk.sizes
            lo, hi = max(a, offsets[k]), min(b, offsets[k] + sizes[k])
            if lo >= hi or any(not offsets[j] <= index[j] < offsets[j] + sizes[j] for j in range(k)):
                continue
            found = locator.locate(entry, chunk)
            if found is None:
                raise ValueError(f"the chunk at {list(offsets)} is not stored as one contiguous local byte range")
            strides = _row_major_strides(sizes)
            first = sum((index[j] - offsets[j]) * strides[j] for j in range(k)) + (lo - offsets[k]) * strides[k]
            chunks.append(
                TensorChunk(
                    chunk.file,
                    found.offset + first * itemsize,
                    (hi - lo) * strides[k] * itemsize,
                    (position + lo - a, *offsets[k + 1 :]),
                    (hi - lo, *sizes[k + 1 :]),
                    ChunkEncoding.RAW,
                )
            )
        position += b - a
    return TensorEntry(name, entry.component, entry.dtype, (position, *shape[k + 1 :]), tuple(chunks))


#: Archives up to this size are read whole to be inspected; larger ones are mapped (only their directory
#: and header pages are then read).
_READ_WHOLE = 256 << 10


class ChunkLocator:
    """Finds the raw bytes of chunks of one checkpoint; a context manager that caches open files.

    Local torch.save archives are inspected in place: a small one read whole (one read costs less than a
    map), a larger one through a memory map of the archive alone, so that only its zip directory and its
    small `data.pkl` record are read, never its tensor bytes.
    """

    def __init__(self, checkpoint_url: str) -> None:
        self._root = checkpoint_url
        self._sizes: dict[str, int] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> ChunkLocator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def locate(self, entry: TensorEntry, chunk: TensorChunk) -> ByteRange | None:
        """The range holding `chunk`'s elements row-major and little-endian, or None when there is none.

        None means the bytes must be decoded instead: a torch.save archive of a non-contiguous view, one on
        a remote store (reading its directory would mean fetching it whole), or another encoding.

        Raises:
            CorruptCheckpoint: the record lies outside its file, or its content disagrees with the metadata.
        """
        url = io.join(self._root, chunk.file)
        where = f"{chunk.file}@{chunk.byte_offset} ({entry.name})"
        size = self._size(url)
        if chunk.byte_offset < 0 or chunk.byte_offset + chunk.byte_length > size:
            raise CorruptCheckpoint(
                f"{where}: bytes {chunk.byte_offset}..{chunk.byte_offset + chunk.byte_length} lie outside "
                f"{chunk.file} ({size} bytes)",
                "the file is truncated",
            )
        expected = chunk.numel * dtype_itemsize(entry.dtype)
        if chunk.encoding == ChunkEncoding.RAW:
            if chunk.byte_length != expected:
                raise CorruptCheckpoint(
                    f"{where}: holds {chunk.byte_length} bytes but {entry.dtype}{list(chunk.sizes)} needs {expected}"
                )
            return ByteRange(url, chunk.byte_offset, chunk.byte_length)
        # A local archive is opened in place to find its record (a fast path); a remote one is read whole.
        if chunk.encoding != ChunkEncoding.TORCH_SAVE or not io.is_local(url):
            return None  # `chunks.read_tensor` knows every encoding; this only the ones worth a byte copy
        found = self._inspect(url, chunk, where)
        if found.dtype != entry.dtype or found.shape != chunk.sizes:
            raise CorruptCheckpoint(
                f"{where}: holds {found.dtype}{list(found.shape)} but the metadata says {entry.dtype}{list(chunk.sizes)}"
            )
        if not found.contiguous:
            return None
        return ByteRange(url, chunk.byte_offset + found.start, found.end - found.start)

    def _size(self, url: str) -> int:
        size = self._sizes.get(url)
        if size is None:
            size = self._sizes[url] = io.file_size(url)
        return size

    def _fd(self, url: str) -> int:
        with self._lock:
            fd = self._fds.get(url)
            if fd is None:
                try:
                    fd = self._fds[url] = os.open(io.local_path(url), os.O_RDONLY)
                except OSError as exc:
                    raise StorageError(f"cannot open {url}: {exc.strerror or exc}") from exc
            return fd

    def _inspect(self, url: str, chunk: TensorChunk, where: str) -> ArchiveTensor:
        if chunk.byte_length == 0:
            raise CorruptCheckpoint(f"{where}: the record is empty, not a torch.save archive")
        fd = self._fd(url)
        if chunk.byte_length <= _READ_WHOLE:
            # A DCP save holds hundreds of small items (norms, biases): one read each, no map and unmap.
            return inspect_archive(self._pread(url, fd, chunk.byte_length, chunk.byte_offset), where)
        # A larger one: its head and zip directory are read (a few KiB, not the item), wherever it is stored;
        # mapping it risks a SIGBUS off a known-local file system, and one read of 2 GiB or more comes back short.
        return inspect_archive_at(
            lambda start, n: self._pread(url, fd, n, chunk.byte_offset + start), chunk.byte_length, where
        )

    @staticmethod
    def _pread(url: str, fd: int, length: int, offset: int) -> bytes:
        try:
            return os.pread(fd, length, offset)
        except OSError as exc:
            raise StorageError(f"cannot read {url}: {exc.strerror or exc}") from exc


def flat_ranges(entry: TensorEntry, locator: ChunkLocator, min_average_bytes: int = 1) -> list[FlatRange] | None:
    """The raw byte ranges that hold `entry`'s elements, in row-major order, adjacent ones merged.

    None when the tensor must be assembled by decoding instead (`chunks.read_tensor`): a chunk without a
    raw range (`ChunkLocator.locate`), one scattered into more row runs than `row_major_runs` describes,
    row runs shorter than `min_average_bytes` on average (interleaved tensor-parallel shards of tiny
    rows: one read each would cost more than decoding), or chunks that leave a gap or overlap (which
    `read_tensor` reports with its coverage check).

    Raises:
        CorruptCheckpoint: a chunk's record lies outside its file or disagrees with the metadata.
    """
    itemsize = dtype_itemsize(entry.dtype)
    runs: list[tuple[int, int, str, int]] = []  # (first element, count, file, byte offset)
    for chunk in entry.chunks:
        if chunk.numel == 0:
            continue
        layout = row_major_runs(entry.shape, chunk.offsets, chunk.sizes)
        if layout is None:
            return None
        found = locator.locate(entry, chunk)
        if found is None:
            return None
        runs.extend((start, count, found.url, found.offset + first * itemsize) for start, first, count in layout)
    if len(runs) > len(entry.chunks) and entry.nbytes / len(runs) < min_average_bytes:
        return None
    runs.sort(key=lambda run: run[0])
    merged: list[FlatRange] = []
    position = 0
    for start, count, url, offset in runs:
        if start != position:
            return None
        position += count
        last = merged[-1] if merged else None
        if last is not None and last.url == url and last.offset + last.count * itemsize == offset:
            merged[-1] = FlatRange(last.start, last.count + count, url, last.offset)
        else:
            merged.append(FlatRange(start, count, url, offset))
    return merged if position == entry.numel else None
