"""blake3 digests: of whole files (read through a small reused buffer) and of bytes as they are written.

blake3 is used rather than sha256 because it hashes at memory speed on several threads; the manifest
records the algorithm name so that another one can be added without breaking old manifests.
"""

from __future__ import annotations

import functools
import io as pyio
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, Protocol

import blake3

from ckptctl import io
from ckptctl.errors import CheckpointNotFound, StorageError
from ckptctl.formats.manifest import FileRecord
from ckptctl.io.sweep import Feed, Span, Sweep

ALGORITHM = "blake3"


class DigestSink:
    """The `io.sweep.SpanSink` of a whole file's blake3 digest (its span must be `ordered`).

    A sweep that has threads to spare gives them to the sink of a large file (`io.sweep.ThreadedSink`),
    which then hashes its larger updates on threads of its own.
    """

    __slots__ = ("_hasher", "error")

    def __init__(self) -> None:
        self._hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        self.error: str | None = None

    def use_threads(self, threads: int) -> None:
        # blake3's threaded hash of the same bytes is the same digest, by design.
        self._hasher = blake3.blake3(max_threads=threads)

    def piece(self, offset: int) -> Feed:
        if offset:
            raise ValueError("a digest is fed from the start of its file, in order (an ordered span)")
        return self._hasher.update

    def failed(self, message: str) -> None:
        self.error = message

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


def file_digest(url: str) -> str:
    """Hex blake3 digest of a file, read through a small reused buffer (no memory map: memory stays flat).

    Raises:
        StorageError: the file vanished or could not be read whole.
    """
    try:
        size = io.file_size(url)
    except CheckpointNotFound as exc:
        raise StorageError(f"file vanished while hashing: {url}") from exc
    sink = DigestSink()
    Sweep([Span(url, 0, size, sink, ordered=True)]).run(1)
    if sink.error is not None:
        raise StorageError(f"cannot hash {url}: {sink.error}")
    return sink.hexdigest()


def copy_hashed(url: str, path: str, max_workers: int = 1) -> FileRecord:
    """Copy a file (remote or local) to the new local file `path` (`io.download_file`, its ranged reads on
    `max_workers` threads), hashing each block as it is written: the copy's size and digest, with no second
    read of it."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    size = io.download_file(url, path, hasher.update, max_workers=max_workers)
    return FileRecord(size, hasher.hexdigest())


def bytes_digest(data: bytes | bytearray | memoryview) -> str:
    """Hex blake3 digest of bytes in memory (a small file written whole: the same digest as `file_digest`'s)."""
    return blake3.blake3(data).hexdigest()


#: Writes at least this large are hashed on a helper thread while the calling thread writes them.
_OVERLAP = 1 << 20
#: They go in parts of this many bytes: each part's hash and write run at once, and the disk is asked to
#: start writing each part out as soon as it is written (`io.start_writeback`).
_PART = 16 << 20


@functools.cache
def _hash_pool() -> ThreadPoolExecutor:
    # Shared by every writer: each waits for its own part before the next, so its updates stay in order.
    # A context pool also hashes in the caller once the interpreter is exiting (an `atexit` save).
    return io.ContextThreadPool(max_workers=4, thread_name_prefix="ckptctl-hash")


class RawWriter(Protocol):
    """What a `HashingWriter` writes through: a binary file (or an fd's writer) that writes all it is given."""

    def write(self, data: bytes | bytearray | memoryview, /) -> int: ...

    def fileno(self) -> int: ...


class HashingWriter:
    """Wraps a binary file: every byte written is hashed and counted, so no second read is needed.

    Large writes overlap three things that would otherwise add up: the hash of a part (on a helper
    thread; blake3 releases the GIL), its write into the page cache (this thread), and the disk writing
    out the parts before it (`io.start_writeback`), so the caller's final fsync finds little left to do.
    The caller still fsyncs: the head start changes when bytes reach the disk, not what is durable.
    `threads` is how many threads blake3 hashes each part on (None: as many as it sees fit).
    """

    def __init__(self, raw: RawWriter, threads: int | None = None) -> None:
        self._raw = raw
        self._hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if threads is None else threads)
        self.size = 0
        try:
            self._fd: int | None = raw.fileno()
        except (AttributeError, OSError, ValueError):  # not a real file (an in-memory buffer)
            self._fd = None
        self._written_back = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if len(data) < _OVERLAP:
            self._hasher.update(data)
            written = self._raw.write(data)
            self.size += len(data)
            return written
        view = memoryview(data).cast("B")
        pool = _hash_pool()
        for start in range(0, len(view), _PART):
            part = view[start : start + _PART]
            hashed = pool.submit(self._hasher.update, part)
            try:
                self._raw.write(part)
            finally:
                hashed.result()  # before the next part's update, and before the caller may reuse `data`
            self.size += len(part)
            self._write_back()
        return len(view)

    def _write_back(self) -> None:
        if self._fd is None:
            return
        # The writer's files start empty, so its count is the offset (a buffered writer may still hold the
        # last few bytes: they go with the fsync).
        start, self._written_back = self._written_back, self.size
        io.start_writeback(self._fd, start, self._written_back - start)

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


class HashingStream(pyio.IOBase):
    """A stream torch's DCP writer writes one file through (`core.distributed.save_dcp`, `dcp_writer.
    data_file_writer`): bytes hashed as they go (`HashingWriter`).

    `tell()` is the byte count (the file starts empty; torch records each item's offset with it), and
    `fileno()` flushes Python's buffer first: torch fsyncs `stream.fileno()` without flushing, which would
    leave the buffered tail of each file (a torch.save archive's end records, most of `.metadata`) out of
    the fsync that the commit protocol counts on.
    """

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self._raw = raw
        self._writer = HashingWriter(raw)

    @property
    def size(self) -> int:
        return self._writer.size

    def hexdigest(self) -> str:
        return self._writer.hexdigest()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._writer.write(data)

    def tell(self) -> int:
        return self._writer.size

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def fileno(self) -> int:
        self.flush()
        return self._raw.fileno()

    def close(self) -> None:
        self.flush()
        super().close()  # the file itself is closed by `create_stream`, after the digest is taken
