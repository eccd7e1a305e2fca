"""Streaming safetensors writer: the header is computed from metadata first, then data flows in block by block.

A safetensors header depends only on names, dtypes and shapes, so the whole output can be laid out before
a byte of data is read. `StreamCopier.write_file` then produces the file as one sequential stream of
fixed-size blocks: each block is filled from the sources it overlaps (`RangeSource`: a byte range of
another file, copied as is or converted element-wise to another dtype; `BufferSource`: bytes produced in
memory, for tensors that must be assembled) and written at its offset. A small thread pool fills and
writes blocks in parallel (pread/pwrite release the GIL) while the calling thread hashes them in file
order, so the blake3 digest of every file comes out of the same single pass. Every byte of the file is
written exactly once.

Blocks live in page-aligned buffers reused for the whole copy and are written with `O_DIRECT` where the
filesystem allows it: the output bypasses the page cache (no fresh page-cache pages to allocate, nothing
left to flush at fsync, no eviction of the source's cached pages) and goes to the disk at its own speed.
Elsewhere (tmpfs, some network filesystems) the same blocks go through ordinary buffered writes.

Memory in flight is bounded by `depth × block_bytes` (plus `CAST_PIECE_BYTES` of conversion scratch per
block), whatever the tensors' size.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from functools import cache
from typing import Any

import blake3

from ckptctl import io
from ckptctl.checkpoint import dtype_itemsize
from ckptctl.errors import CorruptCheckpoint, StorageError
from ckptctl.formats.safetensors import WrittenFile

__all__ = [
    "BLOCK_BYTES",
    "BufferSource",
    "RangeSource",
    "StreamCopier",
    "cast_block",
    "plan_shards",
    "shard_file_names",
]

#: Bytes per block: large enough that per-call overhead vanishes, small enough to bound memory.
BLOCK_BYTES = 16 << 20
#: Source bytes read and cast at a time by `--dtype` conversions (per block in flight).
CAST_PIECE_BYTES = 1 << 20
#: O_DIRECT needs buffer addresses, file offsets and lengths aligned to the device's logical block size;
#: 4 KiB covers every device in use.
_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True, slots=True)
class RangeSource:
    """`length` bytes at `offset` of the file at `url`, elements of `dtype`, written as `out_dtype`."""

    url: str
    offset: int
    length: int
    dtype: str
    out_dtype: str

    @property
    def out_length(self) -> int:
        return self.length // dtype_itemsize(self.dtype) * dtype_itemsize(self.out_dtype)


@dataclass(frozen=True, slots=True)
class BufferSource:
    """`length` bytes that `produce` computes when their turn comes (a tensor assembled in memory)."""

    produce: Callable[[], memoryview | bytes]
    length: int

    @property
    def out_length(self) -> int:
        return self.length


Source = RangeSource | BufferSource


def plan_shards(sizes: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Split tensors (by byte size, in order) into shards of at most `max_bytes` of data each.

    Same rule as transformers' `save_pretrained`: a new shard starts when the next tensor would overflow
    the current one; a tensor larger than the limit gets a shard of its own.

    Returns:
        The indices of the tensors of each shard, in order (one empty shard for no tensors).
    """
    shards: list[list[int]] = [[]]
    filled = 0
    for i, size in enumerate(sizes):
        if shards[-1] and filled + size > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(i)
        filled += size
    return shards


def shard_file_names(count: int, stem: str = "model") -> list[str]:
    """`model.safetensors` for one shard, else `model-00001-of-0000N.safetensors` ... (transformers' names)."""
    if count == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class _Slot:
    """One block's page-aligned buffer (anonymous map), reused for the whole copy: fresh pages are
    costly, warm ones are not. Conversion scratch is allocated on first use."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.map = mmap.mmap(-1, size)
        self.view = memoryview(self.map)
        self._scratch: dict[str, bytearray] = {}

    def scratch(self, kind: str, size: int) -> memoryview:
        buffer = self._scratch.get(kind)
        if buffer is None or len(buffer) < size:
            buffer = self._scratch[kind] = bytearray(size)
        return memoryview(buffer)[:size]

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):
            self.map.close()


#: (data, first byte, end byte, offset in the block): bytes [first, end) of a source's output.
_Segment = tuple[RangeSource | memoryview, int, int, int]


class _Output:
    """An output file descriptor that falls back from O_DIRECT to buffered writes when refused."""

    def __init__(self, path: str, direct: bool) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self.direct = False
        if direct and _O_DIRECT:
            try:
                self.fd = os.open(path, flags | _O_DIRECT, 0o644)
                self.direct = True
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT (tmpfs)
                    raise
        self.fd = os.open(path, flags, 0o644)

    def write(self, data: memoryview, position: int, length: int) -> None:
        """Write `data` (whose first `length` bytes matter) at `position`; with O_DIRECT the padded tail of
        a final block is written too, and cut off later by `truncate`."""
        if self.direct:
            try:
                _pwrite_all(self.fd, data[: _round_up(length, _ALIGN)], position)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._buffered()
        _pwrite_all(self.fd, data[:length], position)

    def _buffered(self) -> None:
        # Some filesystems accept O_DIRECT at open and refuse the writes: switch this descriptor.
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        self.direct = False


class StreamCopier:
    """Writes files from sources with parallel block copies and in-order hashing; a context manager.

    Args:
        workers: threads filling and writing blocks.
        block_bytes: bytes per block (rounded up to 4 KiB).
        on_bytes: called with a number of bytes each time a block has been written (progress).
        direct: write with O_DIRECT where the filesystem allows it.
    """

    def __init__(
        self,
        workers: int = 2,
        block_bytes: int = BLOCK_BYTES,
        on_bytes: Callable[[int], None] | None = None,
        *,
        direct: bool = True,
    ) -> None:
        self._workers = max(1, workers)
        self._block = _round_up(max(block_bytes, 1), _ALIGN)
        self._depth = self._workers + 2
        self._on_bytes = on_bytes or (lambda n: None)
        self._direct = direct
        # Its tasks read the source: they count in the converting operation's byte counter.
        self._pool = io.ContextThreadPool(max_workers=self._workers, thread_name_prefix="ckptctl-copy")
        self._free: list[_Slot] = []
        self._pending: collections.deque[tuple[Future[memoryview], _Slot]] = collections.deque()
        self._fds: dict[str, int] = {}
        self._fd_lock = threading.Lock()
        self._hasher: blake3.blake3 | None = None

    def __enter__(self) -> StreamCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._abort()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for slot in self._free:
            slot.close()
        self._free.clear()
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def write_file(self, path: str, header: bytes, sources: Iterable[Source]) -> WrittenFile:
        """Create the local file `path` (it must not exist): `header`, then every source's bytes in order.

        The file is fsynced before this returns. Returns its size and blake3 digest, computed from the
        bytes as they were written.

        Raises:
            CorruptCheckpoint: a source range is shorter than promised (truncated input).
            StorageError: the output cannot be written (disk full, permissions).
        """
        items = list(sources)
        total = len(header) + sum(s.out_length for s in items)
        block = min(self._block, _round_up(max(total, 1), _ALIGN))
        try:
            output = _Output(path, self._direct)
        except OSError as exc:
            raise StorageError(f"cannot create {path}: {exc.strerror or exc}") from exc
        hasher = self._hasher = blake3.blake3()
        try:
            start = 0  # the current block's first byte in the file
            segments: list[_Segment] = []
            filled = 0
            for source in (memoryview(header), *items):
                data: RangeSource | memoryview
                if isinstance(source, BufferSource):
                    data = memoryview(source.produce()).cast("B")
                    if len(data) != source.length:
                        raise CorruptCheckpoint(f"an assembled tensor has {len(data)} bytes, expected {source.length}")
                else:
                    data = source
                length = data.out_length if isinstance(data, RangeSource) else len(data)
                done = 0
                while done < length:
                    n = min(block - filled, length - done)
                    segments.append((data, done, done + n, filled))
                    done += n
                    filled += n
                    if filled == block:
                        self._submit(output, segments, start, filled, block)
                        start += filled
                        segments, filled = [], 0
            if filled:
                self._submit(output, segments, start, filled, block)
            self._drain()
            os.ftruncate(output.fd, total)  # cuts the padding of an O_DIRECT final block
            os.fsync(output.fd)
        except OSError as exc:
            raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from exc
        finally:
            self._abort()
            os.close(output.fd)
        return WrittenFile(total, hasher.hexdigest())

    def digest(self, path: str) -> str:
        """The blake3 digest of a local file, read back through the copier's buffers (with O_DIRECT where
        possible, so it comes from the disk rather than from a cache) while the next block is read.

        Raises:
            StorageError: the file cannot be read.
        """
        hasher = blake3.blake3()
        try:
            fd = os.open(path, os.O_RDONLY | (_O_DIRECT if self._direct else 0))
        except OSError:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise StorageError(f"cannot read {path}: {exc.strerror or exc}") from exc
        try:
            size = os.fstat(fd).st_size
            block = min(self._block, _round_up(max(size, 1), _ALIGN))
            slots = [self._slot(block), self._slot(block)]
            reads: collections.deque[Future[int]] = collections.deque()
            try:
                offsets = list(range(0, size, block))
                for i, offset in enumerate(offsets[:2]):
                    reads.append(self._pool.submit(_read_block, fd, slots[i].view[:block], offset))
                for i, offset in enumerate(offsets):
                    n = reads.popleft().result()
                    if n != min(block, size - offset):
                        raise StorageError(f"{path} changed while it was read back")
                    hasher.update(slots[i % 2].view[:n])
                    self._on_bytes(n)
                    if i + 2 < len(offsets):
                        reads.append(self._pool.submit(_read_block, fd, slots[i % 2].view[:block], offsets[i + 2]))
            finally:
                wait(list(reads))
                self._free.extend(slots)
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)
        return str(hasher.hexdigest())

    # --- the pipeline ------------------------------------------------------------------------------

    def _submit(self, output: _Output, segments: list[_Segment], start: int, length: int, block: int) -> None:
        if len(self._pending) >= self._depth:
            self._retire()
        slot = self._slot(block)
        future = self._pool.submit(self._fill_and_write, output, slot, segments, start, length)
        self._pending.append((future, slot))

    def _slot(self, size: int) -> _Slot:
        for i, slot in enumerate(self._free):
            if slot.size >= size:
                return self._free.pop(i)
        if self._free:  # replace a small free buffer rather than hold more buffers than the depth
            self._free.pop().close()
        return _Slot(size)

    def _retire(self) -> None:
        future, slot = self._pending.popleft()
        try:
            written = future.result()
            assert self._hasher is not None
            self._hasher.update(written)
            self._on_bytes(len(written))
        finally:
            self._free.append(slot)

    def _drain(self) -> None:
        while self._pending:
            self._retire()

    def _abort(self) -> None:
        """Cancel what has not started and wait for what has (a failure or Ctrl-C mid-copy)."""
        if not self._pending:
            return
        futures = [f for f, _ in self._pending]
        for f in futures:
            f.cancel()
        wait(futures)
        self._free.extend(slot for _, slot in self._pending)
        self._pending.clear()

    def _fill_and_write(
        self, output: _Output, slot: _Slot, segments: list[_Segment], start: int, length: int
    ) -> memoryview:
        view = slot.view
        for data, first, end, at in segments:
            target = view[at : at + end - first]
            if isinstance(data, RangeSource):
                self._produce(slot, data, first, end, target)
            else:
                target[:] = data[first:end]
        padded = _round_up(length, _ALIGN)
        if output.direct and padded > length:
            view[length:padded] = bytes(padded - length)
        output.write(view, start, length)
        return view[:length]

    def _produce(self, slot: _Slot, source: RangeSource, first: int, end: int, target: memoryview) -> None:
        """Output bytes [first, end) of `source` into `target`, converting elements when asked."""
        if source.dtype == source.out_dtype:
            self._read_into(source.url, source.offset + first, target)
            return
        itemsize, out_itemsize = dtype_itemsize(source.dtype), dtype_itemsize(source.out_dtype)
        # Elements covering the range (a block boundary may cut an output element in two), read and cast a
        # piece at a time so that the scratch stays small: a whole block of fp32 sources for a bf16 block
        # would double the memory of the copy.
        e0, e1 = first // out_itemsize, -(-end // out_itemsize)
        # (an object store's source is read in one request per block, as uncast copies are)
        piece = max(1, CAST_PIECE_BYTES // itemsize) if io.is_local(source.url) else e1 - e0
        for p0 in range(e0, e1, piece):
            count = min(piece, e1 - p0)
            raw = slot.scratch("raw", count * itemsize)
            self._read_into(source.url, source.offset + p0 * itemsize, raw)
            lo, hi = p0 * out_itemsize, (p0 + count) * out_itemsize  # this piece's bytes of the output
            if first <= lo and hi <= end:
                cast_block(raw, source.dtype, target[lo - first : hi - first], source.out_dtype, count)
                continue
            converted = slot.scratch("converted", count * out_itemsize)
            cast_block(raw, source.dtype, converted, source.out_dtype, count)
            a, b = max(lo, first), min(hi, end)
            target[a - first : b - first] = converted[a - lo : b - lo]

    def _read_into(self, url: str, offset: int, view: memoryview) -> None:
        if not io.is_local(url):  # locally the fast path: `pread` straight into the view, no copy
            data = io.read_bytes(url, offset, len(view))
            if len(data) != len(view):
                raise CorruptCheckpoint(f"{url}: expected {len(view)} bytes at {offset}, read {len(data)}")
            view[:] = data
            return
        _pread_into(self._source_fd(url), view, offset, url)
        io.count_read(len(view))

    def _source_fd(self, url: str) -> int:
        with self._fd_lock:
            fd = self._fds.get(url)
            if fd is None:
                try:
                    fd = self._fds[url] = os.open(io.local_path(url), os.O_RDONLY)
                except FileNotFoundError as exc:
                    raise StorageError(f"file vanished: {url}") from exc
                except OSError as exc:
                    raise StorageError(f"cannot open {url}: {exc.strerror or exc}") from exc
                with contextlib.suppress(OSError, AttributeError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            return fd


@cache
def _numpy_types() -> dict[str, Any]:
    """numpy element types of the casts done without torch.

    Importing torch costs a convert ~200 MiB of resident memory, and its intra-op threads fight the copy
    threads for the cores; ml_dtypes' C loops cast a block in one pass on the calling thread, rounding
    to nearest even as torch does (bit-identical results but for NaN payloads)."""
    import ml_dtypes
    import numpy as np

    return {"float32": np.float32, "float16": np.float16, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16}


def cast_block(raw: memoryview, dtype: str, out: memoryview, out_dtype: str, count: int) -> None:
    """Cast `count` elements of `dtype` in `raw` into `out` as `out_dtype` (numpy + ml_dtypes; torch for float8)."""
    types = _numpy_types()
    if dtype in types and out_dtype in types:
        import numpy as np

        elements = np.frombuffer(raw, dtype=types[dtype], count=count)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf and NaNs are the cast's meaning
            np.copyto(np.frombuffer(out, dtype=types[out_dtype], count=count), elements, casting="unsafe")
        return
    import torch  # dtypes numpy has no type for (float8 variants)

    source = torch.frombuffer(raw, dtype=getattr(torch, dtype), count=count)
    target = torch.frombuffer(out, dtype=getattr(torch, out_dtype), count=count)
    target.copy_(source)


def _pread_into(fd: int, view: memoryview, offset: int, name: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CorruptCheckpoint(
                f"{name}: ends before byte {offset + len(view)} (read {done} of {len(view)} bytes at {offset})",
                "the file is truncated",
            )
        done += n


def _read_block(fd: int, view: memoryview, offset: int) -> int:
    """Read up to `len(view)` bytes at `offset` in one call (fewer at the end of the file); how many.

    One call, because with O_DIRECT a second one would start at an unaligned offset; the caller checks
    the count against the file size."""
    return os.preadv(fd, [view], offset)


def _pwrite_all(fd: int, data: memoryview, position: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], position + done)
