"""The CRC-32s torch records in its zip archives, and checking them at read speed.

torch.save writes a zip archive (a whole `.pt`/`.pth`/`.bin` file, or one item of a DCP `.distcp` file)
whose every record (`<prefix>/data.pkl`, `<prefix>/data/<key>` with a storage's bytes, ...) is stored
uncompressed, and whose central directory holds the CRC-32 of each record's bytes, computed by torch as it
wrote them. Nothing reads them back: not torch.load, not DeepSpeed. Checking them proves that the content
of a checkpoint without a manifest is what its writer wrote, and names the record that changed.

- `archive_members` reads an archive's directory and its records' local headers (a few small reads at its
  ends), validating offsets and sizes; `TorchArchive` says where an archive lies.
- `RecordCrc` is the `io.sweep.SpanSink` that computes a record's CRC-32 from parts read by several
  threads (`crc32_combine` joins them), so that a 2 GiB record is checked by every core.
- `check_zip_crcs` checks one archive on its own (the layouts' verify and other tools call it).

`torch.serialization.set_crc32_options(False)` makes torch write 0 for every CRC: such an archive has
nothing to check (`ArchiveMembers.crc_recorded`).

`crc32` is zlib-ng's (`zlib-ng`, a dependency): it folds with carry-less multiplies (PCLMULQDQ/VPCLMULQDQ),
about 25 GB/s a core against stdlib zlib's 4, so that checking CRCs costs no more than reading the bytes.
Stdlib zlib is the fallback when zlib-ng does not import (a platform without its wheel, a broken build);
both release the GIL, so the sweep's threads share the work either way.
"""

from __future__ import annotations

import contextlib
import functools
import io
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptctl import io as ckpt_io
from ckptctl.errors import CorruptCheckpoint
from ckptctl.io.sweep import Feed, ReadInto, Span, Sweep, open_ranges

if TYPE_CHECKING:
    import zipfile

__all__ = [
    "SMALL_ARCHIVE",
    "ArchiveMembers",
    "ArchiveReader",
    "CrcCheck",
    "DamagedRecord",
    "RangeReader",
    "RecordCrc",
    "TorchArchive",
    "ZipMember",
    "archive_members",
    "check_zip_crcs",
    "crc32",
    "crc32_combine",
    "crc32_function",
    "is_zip",
    "mismatch",
]

ZIP_MAGIC = b"PK\x03\x04"
_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # signature ... file name length, extra field length
#: Bytes read from the end of a large archive before parsing it: its directory, the last records' headers.
_WINDOW = 64 << 10
#: Bytes read from its start: the local headers of its first records (a DCP item's data record is the fifth).
_HEAD = 4 << 10
#: Archives up to this size are read whole (one request) and checked from memory.
SMALL_ARCHIVE = 1 << 20


@dataclass(frozen=True, slots=True)
class TorchArchive:
    """Where a torch.save zip archive lies in a checkpoint.

    Attributes:
        file: the file, relative to the checkpoint (as `Checkpoint.files` names it).
        offset: the archive's first byte in the file (DCP items share a file).
        length: its length in bytes; None for the rest of the file (a whole torch.save file).
        entry: the state-dict key the archive holds, when one archive holds one entry (a DCP item).
        where: what a person needs to find the archive beside the file name (a DCP chunk's offsets).
    """

    file: str
    offset: int = 0
    length: int | None = None
    entry: str = ""
    where: str = ""


@dataclass(frozen=True, slots=True)
class ZipMember:
    """One record of an archive.

    Attributes:
        name: its name in the archive (`archive/data/0`).
        start: the first byte of its data, in the file (not the archive).
        size: its length.
        crc: the CRC-32 the writer recorded for it.
    """

    name: str
    start: int
    size: int
    crc: int


@dataclass(frozen=True, slots=True)
class ArchiveMembers:
    """The records of an archive and whether its writer recorded their CRC-32s."""

    members: tuple[ZipMember, ...]
    crc_recorded: bool


@dataclass(frozen=True, slots=True)
class DamagedRecord:
    """A record whose bytes do not match the CRC-32 recorded for them (`computed` None: unreadable)."""

    name: str
    recorded: int
    computed: int | None
    message: str


@dataclass(frozen=True, slots=True)
class CrcCheck:
    """What `check_zip_crcs` found: records checked, damaged ones, and whether CRCs were recorded at all."""

    checked: int
    damaged: tuple[DamagedRecord, ...]
    crc_recorded: bool


@functools.cache
def crc32_function() -> Callable[[Any, int], int]:
    """zlib's CRC-32 by the fastest implementation installed, found on first use: zlib-ng's import costs a few
    milliseconds that a command reading no torch.save archive should not pay (DESIGN §5: a command's fixed cost)."""
    try:
        from zlib_ng import zlib_ng
    except ImportError:
        return zlib.crc32
    return zlib_ng.crc32


def crc32(data: Any, value: int) -> int:
    """zlib's CRC-32 of `data` continuing from `value` (`crc32_function`'s)."""
    return crc32_function()(data, value)


def is_zip(head: bytes | bytearray) -> bool:
    """Whether bytes start like a zip archive (a local file header)."""
    return bytes(head[:4]) == ZIP_MAGIC


# --------------------------------------------------------------------------------------------------
# CRC-32 of a record read in parts (zlib's crc32_combine; Python's zlib does not expose it).
# --------------------------------------------------------------------------------------------------

_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (bit-reflected)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


@functools.cache  # built by the first combine, not at import (a command's fixed cost)
def _x2n_table() -> tuple[int, ...]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return tuple(table)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of `A + B` from `crc1` of A, `crc2` of B and B's length (as zlib's `crc32_combine`)."""
    x2n = _x2n_table()
    p = 1 << 31  # x^0
    k = 3  # x^(8 * len2): bytes to bits
    n = len2
    while n:
        if n & 1:
            p = _multmodp(x2n[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


class RecordCrc:
    """The `SpanSink` of one record: its CRC-32 from parts read on any threads, against the recorded one."""

    __slots__ = ("_parts", "error", "member")

    def __init__(self, member: ZipMember) -> None:
        self.member = member
        self.error: str | None = None
        self._parts: dict[int, list[int]] = {}

    def piece(self, offset: int) -> Feed:
        part = self._parts[offset] = [0, 0]  # crc, length

        def feed(block: memoryview) -> None:
            part[0] = crc32(block, part[0])
            part[1] += len(block)

        return feed

    def failed(self, message: str) -> None:
        self.error = message

    @property
    def computed(self) -> int | None:
        """The CRC-32 of the record's bytes as read (None when they were not all read)."""
        if self.error is not None:
            return None
        crc = 0
        at = 0
        for offset in sorted(self._parts):
            part_crc, length = self._parts[offset]
            if offset != at:
                return None
            crc = crc32_combine(crc, part_crc, length) if at else part_crc
            at += length
        return crc if at == self.member.size else None

    def damage(self) -> DamagedRecord | None:
        """The record's damage, or None when its bytes match."""
        computed = self.computed
        if computed == self.member.crc:
            return None
        if computed is None:
            reason = f" ({self.error})" if self.error else ""
            return DamagedRecord(self.member.name, self.member.crc, None, f"could not be read whole{reason}")
        return mismatch(self.member, computed)


def mismatch(member: ZipMember, computed: int) -> DamagedRecord:
    """The damage of a record whose bytes have the CRC-32 `computed`, not the recorded one."""
    return DamagedRecord(
        member.name,
        member.crc,
        computed,
        f"does not match the CRC-32 torch recorded when writing it (recorded {member.crc:08x}, read {computed:08x}): "
        "its bytes changed since",
    )


# --------------------------------------------------------------------------------------------------
# The directory and local headers of one archive.
# --------------------------------------------------------------------------------------------------

ReadAt = Callable[[int, int], bytes]


def archive_members(read_at: ReadAt, length: int, base: int, where: str) -> ArchiveMembers:
    """The stored records of the archive `length` bytes long that `read_at(start, n)` reads.

    Args:
        read_at: reads `n` bytes from `start` (relative to the archive); fewer only at the archive's end.
        length: the archive's length.
        base: where the archive starts in its file (added to each member's `start`).
        where: the archive, for messages.

    Raises:
        CorruptCheckpoint: no zip directory (truncated, or not a zip), a damaged directory or local header,
            a record outside the archive, or a compressed or encrypted record (torch writes neither).
    """
    import zipfile  # imported here: every command imports this module, only torch.save archives need zipfile

    reader = RangeReader(read_at, length)
    try:
        with zipfile.ZipFile(reader) as archive:
            infos = archive.infolist()
    except zipfile.BadZipFile as exc:
        raise CorruptCheckpoint(
            f"{where}: the zip directory at its end is missing or damaged ({exc})", "the file is truncated or damaged"
        ) from exc
    # zipfile reports other damage with struct.error, ValueError, EOFError, UnicodeDecodeError, ...
    except Exception as exc:
        raise CorruptCheckpoint(f"{where}: damaged zip directory ({type(exc).__name__}: {exc})") from exc
    members = []
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
            raise CorruptCheckpoint(
                f"{where}: record {info.filename} is compressed or encrypted (method {info.compress_type}), which "
                "torch.save never writes: its directory entry is damaged"
            )
        if info.compress_size != info.file_size:
            raise CorruptCheckpoint(f"{where}: record {info.filename} has two different sizes in its directory entry")
        start = _data_start(read_at, length, info, where)
        members.append(ZipMember(info.filename, base + start, info.file_size, info.CRC))
    # torch.serialization.set_crc32_options(False) records 0 for every record; a real CRC-32 is 0 once in 2^32.
    recorded = any(m.crc for m in members) or not any(m.size for m in members)
    return ArchiveMembers(tuple(members), recorded)


def _data_start(read_at: ReadAt, length: int, info: zipfile.ZipInfo, where: str) -> int:
    name = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437", "replace")
    offset = info.header_offset
    if offset < 0 or offset + _LOCAL_HEADER.size > length:
        raise CorruptCheckpoint(f"{where}: record {info.filename} lies outside the archive", "the file is truncated")
    header = read_at(offset, _LOCAL_HEADER.size + len(name))
    if len(header) < _LOCAL_HEADER.size + len(name):
        raise CorruptCheckpoint(f"{where}: record {info.filename} lies outside the archive", "the file is truncated")
    fields = _LOCAL_HEADER.unpack_from(header, 0)
    if fields[0] != ZIP_MAGIC or header[_LOCAL_HEADER.size :] != name:
        raise CorruptCheckpoint(f"{where}: the local header of record {info.filename} is damaged")
    start = offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
    if start + info.file_size > length:
        raise CorruptCheckpoint(
            f"{where}: record {info.filename} runs past the end of the archive", "the file is truncated"
        )
    return start


class RangeReader(io.RawIOBase):
    """A seekable read-only file of `length` bytes over `read_at`, for zipfile (`torch_save` reads its
    archives through one too)."""

    def __init__(self, read_at: ReadAt, length: int) -> None:
        super().__init__()
        self._read_at = read_at
        self._length = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self._length if size is None or size < 0 else min(self._length, self._pos + size)
        if end <= self._pos:
            return b""
        data = self._read_at(self._pos, end - self._pos)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)


class ArchiveReader:
    """One file kept open for reading the directories of the archives it holds (a context manager).

    `window(base, length)` gives a `ReadAt` for the archive at `base` that serves its directory and first
    local headers from one read at each end; `whole(base, length)` reads a small archive at once. Every read
    is counted.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._stack = contextlib.ExitStack()
        self._read_into: ReadInto | None = None

    def __enter__(self) -> ArchiveReader:
        self._read_into = self._stack.enter_context(open_ranges(self.url))
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self._stack.__exit__(*exc)

    def read(self, start: int, n: int) -> bytes:
        """`n` bytes from `start` of the file (fewer at its end)."""
        assert self._read_into is not None, "use ArchiveReader as a context manager"
        buf = bytearray(n)
        got = self._read_into(memoryview(buf), start)
        ckpt_io.count_read(got)
        del buf[got:]
        return bytes(buf)

    def whole(self, base: int, length: int) -> tuple[bytes, ReadAt]:
        """The archive's bytes, and a `ReadAt` over them."""
        data = self.read(base, length)
        return data, lambda start, n: data[start : start + n]

    def window(self, base: int, length: int) -> ReadAt:
        """A `ReadAt` over the archive at `base` that reads its two ends once and the rest on demand."""
        tail_start = max(0, length - _WINDOW)
        tail = self.read(base + tail_start, length - tail_start)
        head_len = min(_HEAD, tail_start)
        head = self.read(base, head_len) if head_len else b""

        def read_at(start: int, n: int) -> bytes:
            if start >= tail_start:
                return tail[start - tail_start : start - tail_start + n]
            if start + n <= head_len:
                return head[start : start + n]
            return self.read(base + start, max(0, min(n, length - start)))

        return read_at


def check_zip_crcs(url: str, offset: int = 0, length: int | None = None, workers: int = 1) -> CrcCheck:
    """Check every recorded CRC-32 of the torch.save zip archive at `url` (a whole file, or `length` bytes
    from `offset`: a DCP item), reading its records through small reused buffers.

    Raises:
        CorruptCheckpoint: the archive's directory is unreadable (see `archive_members`).
    """
    if length is None:
        length = ckpt_io.file_size(url) - offset
    with ArchiveReader(url) as reader:
        found = archive_members(reader.window(offset, length), length, offset, url)
    if not found.crc_recorded:
        return CrcCheck(0, (), False)
    sinks = [RecordCrc(m) for m in found.members]
    Sweep(Span(url, s.member.start, s.member.start + s.member.size, s) for s in sinks).run(workers)
    damaged = tuple(d for d in (s.damage() for s in sinks) if d is not None)
    return CrcCheck(len(sinks), damaged, True)
