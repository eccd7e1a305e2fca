"""One parallel pass over byte ranges of many files, through small reused buffers (verify's content checks).

A `Span` is a byte range of a file and the `SpanSink` that consumes its bytes: a CRC-32 of a zip record, a
blake3 digest of a whole file, a NaN count of a tensor. `Sweep` reads every byte any span needs exactly
once, however many spans overlap it:

- spans of one file are merged into regions (nearby spans too, so that thousands of small records are read
  as one sequential stream rather than one request each);
- regions are cut into pieces of `piece` bytes that worker threads read at once, each through one buffer
  of `block` bytes it reuses; a span that a cut crosses is fed in one part per piece, and its sink puts the
  parts together (`SpanSink.piece`): a CRC-32 combines, a count adds. A span that must be fed in order from
  one thread (a hash of a whole file) keeps its region in one piece.

Memory is the workers' buffers, whatever the size of the files. Local files are read with `preadv` straight
into the buffer and hinted as sequential; other files by range reads through `io.open_read`. A piece of a
local file whose file system is known local (`io.local.maps_safely`) and that no hash reads (no ordered
span) is mapped instead, `MAP_BLOCK` at a time, and its bytes handed to the sinks with no copy: the copy
into the buffer was half of a CRC-32 check's CPU. A map goes before the next is made, so memory stays a
block a worker (mapped pages count as the process's memory). The work in sinks (zlib, blake3, torch)
releases the GIL, so threads scale to the cores.

A large file hashed in order would leave cores idle when there are fewer pieces than threads (a DCP save
of 2 big `.distcp` files): such a piece is read through a larger buffer, and its sink is told how many
threads it may hash on (`ThreadedSink`), the threads the pool would not use, split between those pieces
and bounded by the cores (at least `MIN_HASH_THREADS` each, or none). The larger buffers together stay under `HASH_BUFFERS`.
Where the pool's threads are as many as the cores, such sinks are told to hash on their reader's thread alone.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Generic, Protocol, TypeVar, runtime_checkable

from ckptctl.errors import CkptctlError
from ckptctl.io.counting import count_read
from ckptctl.io.failures import translate_errors
from ckptctl.io.local import LOCAL, map_block, maps_safely
from ckptctl.io.parallel import ContextThreadPool
from ckptctl.io.paths import is_local
from ckptctl.io.remote import FSSPEC

__all__ = [
    "BLOCK",
    "PIECE",
    "REMOTE_BLOCK",
    "Feed",
    "Job",
    "ReadInto",
    "Span",
    "SpanSink",
    "Sweep",
    "ThreadedSink",
    "block_reader",
    "job_groups",
    "local_reader",
    "open_ranges",
]

R = TypeVar("R")

#: Bytes read at once into a worker's buffer: large enough to amortise a system call, small enough that
#: what a sink does with it stays in the CPU's caches.
BLOCK = 1 << 20
#: The buffer of a remote file: one range request each, large enough to amortise its latency. (Local
#: ordered pieces, hashes, use `BLOCK` too, unless given spare threads: `HASH_BLOCK`.)
REMOTE_BLOCK = 8 << 20
#: Bytes of a region one worker reads before another takes the next part: the grain of parallelism inside
#: one file (a 2 GiB tensor record is checked by every core).
PIECE = 64 << 20
#: Bytes of a local file mapped at once (`Sweep` docstring). A CRC-32 over maps of a warm 400 MB file took 0.016
#: CPU-s with 4 or 8 MiB maps, 0.017 with 2 MiB, 0.041 with 1 MiB (a map's own cost), against 0.031 for `preadv`
#: into a 1 MiB buffer; 4 MiB keeps a worker's mapped pages small.
MAP_BLOCK = 4 << 20
#: Spans of a file closer than this are read as one stream (the bytes between them are read and dropped):
#: cheaper than a request per span for the small records of a zip archive.
GAP = 256 << 10
#: The buffer of a large ordered local piece hashed on several threads: blake3 spreads one update over
#: threads only in parts of about 1 MiB per thread, so a 1 MiB update would keep them waiting.
HASH_BLOCK = 16 << 20
#: The most memory the buffers of such pieces take together (smaller buffers when there are many).
HASH_BUFFERS = 128 << 20
#: An ordered local piece this large is worth threads of its own (a smaller one is hashed before they start).
THREADED_PIECE = 64 << 20
#: Fewer threads than this do not pay for the larger buffer: on 2 cores, blake3 over a warm 1.5 GB file
#: ran at 2.9-3.6 GB/s with 1 MiB updates on one thread, 1.6-2.8 GB/s with 16 MiB updates on two.
MIN_HASH_THREADS = 3

#: Consumes consecutive blocks of one part of a span.
Feed = Callable[[memoryview], object]
#: `read_into(buffer, offset)`: fills `buffer` from `offset` of a file, returns the bytes read (fewer only at
#: the file's end).
ReadInto = Callable[[memoryview, int], int]


class SpanSink(Protocol):
    """What consumes the bytes of a span."""

    def piece(self, offset: int) -> Feed:
        """A feed for the part of the span from `offset` (bytes from the span's start) on.

        Each feed is given the part's bytes in order, from one thread; feeds of different parts may run on
        different threads at once. A part ends where the next one's `offset` starts (or at the span's end).
        """
        ...

    def failed(self, message: str) -> None:
        """Some of the span's bytes could not be read (the file is shorter than expected, an I/O error)."""
        ...


@runtime_checkable
class ThreadedSink(Protocol):
    """An ordered span's sink that can spread its work over threads of its own (a blake3 hash)."""

    def use_threads(self, threads: int) -> None:
        """Work on up to `threads` threads; called before the span's first piece, when cores would idle."""
        ...


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes `start:end` of the file at `url`, for `sink`.

    Attributes:
        ordered: the sink needs the whole span in order from one thread (a hash), so its region is read as
            one piece.
    """

    url: str
    start: int
    end: int
    sink: SpanSink
    ordered: bool = False


@dataclass(frozen=True, slots=True)
class Job(Generic[R]):
    """Spans whose sinks together give one verdict: a file's digest, an archive's CRC-32s, a chunk's read.

    The unit of work that the ranks of a job share (`job_groups`): its spans are read by one process, which
    calls `result` after the sweep and hands the others the (picklable) verdict.

    Attributes:
        spans: the byte ranges the sweep feeds.
        result: the verdict, once the sweep has read the spans.
        extra: bytes `result` reads itself, outside the sweep (a chunk decoded on its own): its weight.
    """

    spans: Sequence[Span]
    result: Callable[[], R]
    extra: int = 0


def job_groups(jobs: Sequence[Job[Any]]) -> list[tuple[list[int], int]]:
    """`jobs` grouped so that jobs reading the same bytes of a file (a file's digest and the CRC-32s or
    tensors inside it) fall in one group, whose bytes one process then reads once: `(job indices, bytes
    to read)` per group, in the order of their first job."""
    parent = list(range(len(jobs)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    by_url: dict[str, list[tuple[int, int, int]]] = {}
    for i, job in enumerate(jobs):
        for span in job.spans:
            if span.end > span.start:
                by_url.setdefault(span.url, []).append((span.start, span.end, i))
    weight = [job.extra for job in jobs]
    for ranges in by_url.values():
        ranges.sort()
        start, end, first = ranges[0]
        for lo, hi, i in ranges[1:]:
            if lo < end:  # overlaps the run of ranges so far: the same group
                parent[root(i)] = root(first)
                end = max(end, hi)
                continue
            weight[first] += end - start
            start, end, first = lo, hi, i
        weight[first] += end - start
    # Bytes are counted on the job that began each run of ranges, so a group weighs the sum over its jobs.
    groups: dict[int, list[int]] = {}
    for i in range(len(jobs)):
        groups.setdefault(root(i), []).append(i)
    return [(members, sum(weight[i] for i in members)) for members in groups.values()]


@dataclass(slots=True)
class _Piece:
    url: str
    start: int
    end: int
    spans: list[Span] = field(default_factory=list)
    large: bool = False  # read through the large buffer (a remote file)
    ordered: bool = False  # one of its spans must be fed in order from one thread (a hash)
    block: int = 0  # the size of its buffer, set by `Sweep.run`


class Sweep:
    """A planned pass over `spans`: `total` bytes to read, `run` reads them.

    Args:
        spans: the ranges to read; empty ones are never fed (a sink of an empty span sees no piece).
        block: the size of each worker's buffer.
        large_block: the size of its buffer for remote files.
        piece: how much of a region one worker reads before the next part goes to another.
        gap: spans of one file closer than this are read as one stream.
    """

    def __init__(
        self,
        spans: Iterable[Span],
        *,
        block: int = BLOCK,
        large_block: int = REMOTE_BLOCK,
        piece: int = PIECE,
        gap: int = GAP,
    ) -> None:
        self._block = block
        self._large_block = large_block
        by_url: dict[str, list[Span]] = {}
        for span in spans:
            if span.end > span.start:
                by_url.setdefault(span.url, []).append(span)
        self._pieces: list[_Piece] = []
        for url, group in by_url.items():
            group.sort(key=lambda s: s.start)
            for region in _regions(group, gap):
                for cut in _cut(url, region, piece):
                    cut.large = not is_local(url)
                    self._pieces.append(cut)
        self.total = sum(p.end - p.start for p in self._pieces)

    def run(self, workers: int, advance: Callable[[int], object] | None = None) -> None:
        """Read every piece on `workers` threads, feeding the spans; `advance(n)` after each block read.

        A piece that cannot be read (the file vanished, is shorter than its spans, an I/O error) fails its
        spans that were not fed whole (`SpanSink.failed`); the other pieces go on.
        """
        for piece in self._pieces:
            piece.block = self._large_block if piece.large else self._block
        self._spread(workers)
        local = threading.local()

        def read(piece: _Piece) -> None:
            buffers: dict[int, bytearray] | None = getattr(local, "buffers", None)
            if buffers is None:
                buffers = local.buffers = {}
            buf = buffers.get(piece.block)
            if buf is None:
                buf = buffers[piece.block] = bytearray(piece.block)
            _read_piece(piece, memoryview(buf), advance)

        if workers <= 1 or len(self._pieces) <= 1:
            for piece in self._pieces:
                read(piece)
            return
        with ContextThreadPool(max_workers=min(workers, len(self._pieces))) as pool:
            for _ in pool.map(read, self._pieces):
                pass

    def _spread(self, workers: int) -> None:
        """Give the threads that no piece would use to the large ordered local pieces' sinks, with larger
        buffers (one per such piece at most: each is read by one thread); where the pool's threads alone
        keep every core busy, the ordered sinks hash on their reader's thread alone."""
        if min(workers, len(self._pieces)) >= (os.cpu_count() or 1):
            # blake3's own threads (its default takes every core) would contend with the pool's: over the 2
            # files of the bench's 0.75 GB DCP save on 2 cores, hashing on the reader's thread took 0.180-0.188
            # CPU-s against 0.190-0.195 (medians of 7 over 3 rounds: 0.182-0.204 against 0.195-0.241).
            for piece in self._pieces:
                for span in piece.spans:
                    if span.ordered and isinstance(span.sink, ThreadedSink):
                        span.sink.use_threads(1)
            return
        big = [p for p in self._pieces if p.ordered and not p.large and p.end - p.start >= THREADED_PIECE]
        spare = workers - len(self._pieces)
        if not big or spare < len(big):
            return
        # Each such piece's reader waits while its hash runs, so its thread counts among the hash's.
        threads = min(1 + spare // len(big), max(1, (os.cpu_count() or 1) // len(big)))
        if threads < MIN_HASH_THREADS:
            return
        block = max(self._block, min(HASH_BLOCK, HASH_BUFFERS // len(big)))
        for piece in big:
            piece.block = block
            for span in piece.spans:
                if span.ordered and isinstance(span.sink, ThreadedSink):
                    span.sink.use_threads(threads)


def _regions(spans: Sequence[Span], gap: int) -> Iterator[tuple[int, int, list[Span], bool]]:
    """Spans sorted by start, grouped into regions `(start, end, spans, ordered)` to read as one stream."""
    start, end, members, ordered = spans[0].start, spans[0].end, [spans[0]], spans[0].ordered
    for span in spans[1:]:
        if span.start <= end + gap:
            end = max(end, span.end)
            members.append(span)
            ordered = ordered or span.ordered
            continue
        yield start, end, members, ordered
        start, end, members, ordered = span.start, span.end, [span], span.ordered
    yield start, end, members, ordered


def _cut(url: str, region: tuple[int, int, list[Span], bool], size: int) -> list[_Piece]:
    """A region as pieces of about `size` bytes, each with the spans it overlaps (spans sorted by start)."""
    start, end, spans, ordered = region
    if ordered or end - start <= size:
        return [_Piece(url, start, end, spans, ordered=ordered)]
    pieces = [_Piece(url, at, min(at + size, end)) for at in range(start, end, size)]
    for span in spans:
        first = (span.start - start) // size
        last = (span.end - 1 - start) // size
        for piece in pieces[first : last + 1]:
            piece.spans.append(span)
    return [p for p in pieces if p.spans]


def _read_piece(piece: _Piece, buf: memoryview, advance: Callable[[int], object] | None) -> None:
    spans = piece.spans
    feeds: dict[int, Feed] = {}
    active: list[Span] = []
    nxt = 0
    pos = piece.start
    try:
        with _open_blocks(piece, buf) as (read_block, step):
            while pos < piece.end:
                want = min(step, piece.end - pos)
                block = read_block(pos, want)
                got = len(block)
                if not got:  # the file ends before the piece does
                    raise _ShortFile(pos)
                count_read(got)
                if advance is not None:
                    advance(got)
                block_end = pos + got
                while nxt < len(spans) and spans[nxt].start < block_end:
                    active.append(spans[nxt])
                    nxt += 1
                for span in active:
                    lo = max(span.start, pos)
                    hi = min(span.end, block_end)
                    if lo < hi:
                        feed = feeds.get(id(span))
                        if feed is None:
                            feed = feeds[id(span)] = span.sink.piece(lo - span.start)
                        feed(block[lo - pos : hi - pos])
                del block  # a map goes now, before the next is made
                active = [s for s in active if s.end > block_end]
                pos = block_end
    except _ShortFile as short:
        for span in spans:
            if span.end > short.size:
                span.sink.failed(f"the file ends at byte {short.size}, before byte {span.end} (truncated?)")
    except (CkptctlError, OSError) as exc:
        message = exc.message if isinstance(exc, CkptctlError) else f"cannot read: {exc.strerror or exc}"
        for span in spans:
            if span.end > pos:
                span.sink.failed(message)


#: `read_block(offset, length)`: a view of up to `length` bytes of a file from `offset` (none only at its end),
#: valid until the next call.
_ReadBlock = Callable[[int, int], memoryview]


@contextlib.contextmanager
def _open_blocks(piece: _Piece, buf: memoryview) -> Iterator[tuple[_ReadBlock, int]]:
    """The piece's file opened for block reads, and the size of a block: mapped where that is safe and pays
    (`Sweep` docstring), else read into `buf`."""
    with block_reader(piece.url, buf, populate=True, may_map=not piece.ordered) as (read_block, mapped):
        yield read_block, MAP_BLOCK if mapped else len(buf)


@contextlib.contextmanager
def block_reader(
    url: str, buf: memoryview, *, populate: bool, may_map: bool = True
) -> Iterator[tuple[_ReadBlock, bool]]:
    """Block reads of the file at `url` (`_ReadBlock`), and whether they are mapped: where `may_map` and the
    file is on a file system known local (`maps_safely`), through maps (`_mapped_reader`, `populate` as
    there); else read into `buf` (an object store, NFS, Lustre, FUSE: a page a map could not bring in from
    them would be a SIGBUS, which kills the command with no message, where a failed read is an error)."""
    if not may_map or not is_local(url):
        with open_ranges(url) as read_into:
            yield (lambda offset, length: buf[: read_into(buf[:length], offset)]), False
        return
    with translate_errors(url), LOCAL.open_read(url) as f:
        fd = f.fileno()
        if not maps_safely(fd):
            read_into = local_reader(fd)
            yield (lambda offset, length: buf[: read_into(buf[:length], offset)]), False
            return
        yield _mapped_reader(fd, buf, populate=populate), True


def _mapped_reader(fd: int, buf: memoryview, *, populate: bool) -> _ReadBlock:
    """Block reads of the open local file `fd` through maps (`io.local.map_block`, `populate` as there;
    nothing mapped past the size it has now: a page there would fault), through `buf` where a block will not
    map. Only where `maps_safely(fd)`."""
    size = os.fstat(fd).st_size
    read_into = local_reader(fd)

    def read_block(offset: int, length: int) -> memoryview:
        available = max(0, min(length, size - offset))
        if available == 0:
            return memoryview(b"")
        mapped = map_block(fd, offset, available, populate=populate)
        if mapped is None:  # will not map, shorter now, or a page would not come in: read, which says why
            return buf[: read_into(buf[: min(len(buf), available)], offset)]
        return mapped

    return read_block


class _ShortFile(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


@contextlib.contextmanager
def open_ranges(url: str) -> Iterator[ReadInto]:
    """The file at `url` opened for range reads into caller's buffers (`ReadInto`); errors of the storage,
    inside the block too, come out as ckptctl errors. Reads are not counted: callers count them."""
    backend = LOCAL if is_local(url) else FSSPEC
    with translate_errors(url), backend.open_read(url) as f:
        yield local_reader(f.fileno()) if is_local(url) else _remote_reader(f)


def local_reader(fd: int) -> ReadInto:
    """Range reads of the open local file `fd` with `preadv`, straight into the caller's buffer (the file
    hinted as read in order)."""
    with contextlib.suppress(AttributeError, OSError):  # a hint: not every system has it
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def read_into(buf: memoryview, offset: int) -> int:
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    return read_into


def _remote_reader(f: IO[bytes]) -> ReadInto:
    def read_into(buf: memoryview, offset: int) -> int:
        f.seek(offset)
        done = 0
        while done < len(buf):
            data = f.read(len(buf) - done)
            if not data:
                break
            buf[done : done + len(data)] = data
            done += len(data)
        return done

    return read_into
