"""`verify`'s content checks, in one parallel pass over the bytes through small reused buffers.

- Digests: every file the manifest lists, hashed with blake3 (with `record_digests`, every file, to write
  a manifest).
- CRC-32s: every record of every torch.save zip archive the layout names (`Layout.torch_archives`: DCP
  items, DeepSpeed `*_states.pt`, the Trainer's `optimizer.pt`, ...) whose file no recorded digest covers.
  torch computed them as it wrote each record, so they vouch for the content of checkpoints that have no
  manifest, and they name the damaged record, which a digest cannot: a file whose digest fails is checked
  too.
- Deep: every chunk of every tensor located and read (a DCP item's archive is decoded as far as its
  header, whose dtype and shape must match the metadata); with `check_finite`, NaN/Inf are counted block
  by block.

Every byte is read once whichever checks want it (`io.sweep`), and memory stays flat: the workers'
buffers, small archives while they are checked, never a whole tensor (a chunk that is not one plain range
of its file is decoded on its own). Over the ranks of a job (`ops.distributed_work`), each rank reads the
bytes of its share of the checks (`ops.sweeping`) and every rank gets the whole report; every rank plans
them all (reads the tensor index, zip directories and item headers: metadata, well under 1% of the bytes). Checks that find no CRC to check say so: raw bytes (a safetensors
file, a DCP save in the safetensors format) are vouched for by a manifest only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, Problem, ProblemKind, TensorChunk, TensorEntry, dtype_itemsize
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.chunks import entry_tiling_problem, read_chunk
from ckptctl.formats.manifest import FileRecord, Manifest
from ckptctl.formats.torch_zip import (
    SMALL_ARCHIVE,
    ArchiveReader,
    DamagedRecord,
    RecordCrc,
    TorchArchive,
    archive_members,
    crc32,
    is_zip,
    mismatch,
)
from ckptctl.io.sweep import Feed, Job, Span
from ckptctl.ops.digests import DigestPlan
from ckptctl.ops.distributed_work import Ranks
from ckptctl.ops.report import Progress
from ckptctl.ops.sweeping import sweep_jobs, threads_for

if TYPE_CHECKING:
    from ckptctl.formats.raw_chunks import ChunkLocator

__all__ = ["ContentChecks", "ContentReport", "check_content"]


@dataclass(frozen=True, slots=True)
class ContentChecks:
    """Which content checks to run.

    Attributes:
        manifest: the recorded digests to check, or None.
        crc: check the CRC-32s of the torch.save archives no digest covers.
        deep: locate and read every tensor chunk.
        check_finite: with `deep`, flag NaN/Inf values.
        record_digests: hash every file to record a manifest (`ContentReport.digests`).
        workers: threads reading at once in this process (default: `ops.sweeping.threads_for`).
        ranks: the ranks of a job that share the reading by bytes (None: this process alone).
    """

    manifest: Manifest | None = None
    crc: bool = True
    deep: bool = False
    check_finite: bool = False
    record_digests: bool = False
    workers: int | None = None
    ranks: Ranks | None = None


@dataclass(frozen=True, slots=True)
class ContentReport:
    """What the content checks found.

    Attributes:
        problems: in the order digests, CRC-32s, tensors.
        digests_checked: files checked against a recorded digest.
        crc_records_checked: zip records whose CRC-32 was checked.
        tensors_read: tensors located and read (`deep`).
        digests: with `record_digests`, size and digest of every file read whole.
    """

    problems: tuple[Problem, ...]
    digests_checked: int
    crc_records_checked: int
    tensors_read: int
    digests: Mapping[str, FileRecord] = field(default_factory=dict)


def check_content(
    checkpoint: Checkpoint,
    archives: Sequence[TorchArchive],
    checks: ContentChecks,
    progress: Progress,
    skip: frozenset[str] = frozenset(),
) -> ContentReport:
    """Run `checks` over the checkpoint's bytes in one parallel pass.

    Args:
        checkpoint: the checkpoint (opened by its layout).
        archives: its torch.save archives (`Layout.torch_archives`).
        checks: what to check.
        progress: where to report progress.
        skip: files that structural verify found broken (missing, truncated): their archives are not
            checked again.

    With `deep`, a tensor index that cannot be read is a problem (and no tensor is read).
    """
    workers = threads_for(checks.workers, checks.ranks)
    digests = DigestPlan(checkpoint.url, checkpoint.files, checks.manifest, checks.record_digests)
    crcs = None
    if checks.crc:
        covered = digests.checked | skip
        crcs = _CrcPlan(checkpoint, [a for a in archives if a.file not in covered], workers, progress)
    deep = _DeepPlan(checkpoint, checks.check_finite, progress) if checks.deep else None
    jobs: list[Job[Any]] = [*digests.jobs, *(crcs.jobs if crcs else ()), *(deep.jobs if deep else ())]
    verdicts = sweep_jobs(jobs, checks.ranks, workers, progress, _description(checks, digests, crcs))
    digests.conclude(verdicts[: len(digests.jobs)])
    verdicts = verdicts[len(digests.jobs) :]

    problems = digests.problems()
    crc_records = 0
    if crcs is not None:
        crc_problems, crc_records = crcs.results(verdicts[: len(crcs.jobs)])
        verdicts = verdicts[len(crcs.jobs) :]
        problems += crc_problems
        # A file whose digest failed: its CRCs say which record changed.
        changed = digests.mismatched()
        again = [a for a in archives if a.file in changed and a.file not in skip]
        if again:
            named = _CrcPlan(checkpoint, again, workers, progress)
            found = sweep_jobs(named.jobs, checks.ranks, workers, progress, "finding the damaged records")
            named_problems, named_records = named.results(found)
            problems += named_problems
            crc_records += named_records
    tensors = 0
    if deep is not None:
        problems += deep.results(verdicts)
        tensors = deep.count
    return ContentReport(tuple(problems), digests.count, crc_records, tensors, digests.records())


def _description(checks: ContentChecks, digests: DigestPlan, crcs: _CrcPlan | None) -> str:
    parts = []
    if digests.jobs:
        parts.append("hashing")
    if crcs is not None and crcs.jobs:
        parts.append("checking CRC-32s")
    if checks.deep:
        parts.append("reading tensors")
    return ", ".join(parts) or "reading"


# --------------------------------------------------------------------------------------------------
# CRC-32s of torch.save archives.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What one archive's check found."""

    checked: int = 0
    damaged: tuple[DamagedRecord, ...] = ()
    error: str | None = None
    not_zip: bool = False
    no_crc: bool = False


class _SmallArchive:
    """A sink that gathers a small archive's bytes (from any pieces) and checks it when the last arrive."""

    __slots__ = ("_buf", "_got", "_lock", "archive", "base", "length", "outcome", "span", "where")

    def __init__(
        self, url: str, archive: TorchArchive, base: int, length: int, where: str, lock: threading.Lock
    ) -> None:
        self.archive = archive
        self.base = base
        self.length = length
        self.where = where
        self.outcome: _Outcome | None = None
        self.span = Span(url, base, base + length, self)
        self._buf: bytearray | None = None
        self._got = 0
        self._lock = lock

    def piece(self, offset: int) -> Feed:
        at = offset

        def feed(block: memoryview) -> None:
            nonlocal at
            with self._lock:
                if self._buf is None:
                    if self.outcome is not None:  # failed already
                        return
                    self._buf = bytearray(self.length)
                buf = self._buf
            buf[at : at + len(block)] = block
            at += len(block)
            with self._lock:
                self._got += len(block)
                complete = self._got == self.length
            if complete:
                self._buf = None
                self.outcome = _check_bytes(buf, self.base, self.where)

        return feed

    def failed(self, message: str) -> None:
        with self._lock:
            self._buf = None
            self.outcome = _Outcome(error=f"{self.where}: {message}")

    def result(self) -> _Outcome:
        """After the sweep: what the check found."""
        return self.outcome or _Outcome(error=f"{self.where}: its bytes were not all read")


def _check_bytes(data: bytearray, base: int, where: str) -> _Outcome:
    """Check a whole archive held in memory."""
    if not is_zip(data):
        return _Outcome(not_zip=True)
    view = memoryview(data)
    try:
        found = archive_members(lambda start, n: bytes(view[start : start + n]), len(data), base, where)
    except CorruptCheckpoint as exc:
        return _Outcome(error=exc.message)
    if not found.crc_recorded:
        return _Outcome(no_crc=True)
    damaged = []
    for member in found.members:
        start = member.start - base
        computed = crc32(view[start : start + member.size], 0)
        if computed != member.crc:
            damaged.append(mismatch(member, computed))
    return _Outcome(len(found.members), tuple(damaged))


@dataclass(slots=True)
class _LargeArchive:
    """A large archive: its directory read before the sweep, one `RecordCrc` per record."""

    archive: TorchArchive
    base: int
    length: int
    sinks: list[RecordCrc] = field(default_factory=list)
    outcome: _Outcome | None = None  # set before the sweep when there is nothing to read

    def result(self) -> _Outcome:
        if self.outcome is not None:
            return self.outcome
        damaged = tuple(d for d in (s.damage() for s in self.sinks) if d is not None)
        return _Outcome(len(self.sinks), damaged)


class _CrcPlan:
    """The CRC checks of `archives`: small ones are read whole by the sweep and checked from memory, large
    ones have their directories read now (in parallel) and each record checked as the sweep reads it."""

    def __init__(self, checkpoint: Checkpoint, archives: Sequence[TorchArchive], workers: int, progress: Progress):
        self._root = checkpoint.url
        self._files = checkpoint.files
        self._small: list[_SmallArchive] = []
        self._large: list[_LargeArchive] = []
        lock = threading.Lock()
        large_by_file: dict[str, list[_LargeArchive]] = {}
        for archive in archives:
            size = self._files.get(archive.file)
            if size is None:
                continue
            length = size - archive.offset if archive.length is None else archive.length
            if length <= 0 or archive.offset + length > size:
                continue  # structural verify reports records outside their file
            url = io.join(self._root, archive.file)
            if length <= SMALL_ARCHIVE:
                self._small.append(_SmallArchive(url, archive, archive.offset, length, self._where(archive), lock))
            else:
                large = _LargeArchive(archive, archive.offset, length)
                self._large.append(large)
                large_by_file.setdefault(archive.file, []).append(large)
        if large_by_file:
            progress.start("reading zip directories", len(self._large))
            io.parallel_map(lambda group: self._directories(*group, progress), list(large_by_file.items()), workers)
            progress.finish()
        #: One job per archive; its verdict is an `_Outcome`.
        self.jobs: list[Job[_Outcome]] = [Job([s.span], s.result) for s in self._small]
        for large in self._large:
            url = io.join(self._root, large.archive.file)
            spans = [Span(url, s.member.start, s.member.start + s.member.size, s) for s in large.sinks]
            self.jobs.append(Job(spans, large.result))

    def _directories(self, file: str, group: list[_LargeArchive], progress: Progress) -> None:
        try:
            with ArchiveReader(io.join(self._root, file)) as reader:
                for large in group:
                    self._directory(reader, large)
                    progress.advance(1)
        except CkptctlError as exc:  # the file vanished or cannot be opened
            for large in group:
                if large.outcome is None and not large.sinks:
                    large.outcome = _Outcome(error=exc.message)

    def _directory(self, reader: ArchiveReader, large: _LargeArchive) -> None:
        where = self._where(large.archive)
        read_at = reader.window(large.base, large.length)
        if not is_zip(read_at(0, 4)):
            large.outcome = _Outcome(not_zip=True)
            return
        try:
            found = archive_members(read_at, large.length, large.base, where)
        except CorruptCheckpoint as exc:
            large.outcome = _Outcome(error=exc.message)
            return
        if not found.crc_recorded:
            large.outcome = _Outcome(no_crc=True)
            return
        large.sinks = [RecordCrc(m) for m in found.members]

    def _where(self, archive: TorchArchive) -> str:
        """The archive, for messages: its file (the checkpoint's name for a single file) and its entry."""
        file = archive.file or io.name_of(self._root)
        if archive.entry:
            return f"{file} ({archive.entry}{', ' + archive.where if archive.where else ''})"
        return file

    def results(self, verdicts: Sequence[_Outcome]) -> tuple[list[Problem], int]:
        """The problems `jobs`' verdicts (in their order) show, and the number of records checked."""
        placed = [(s.archive, s.base, s.length) for s in self._small] + [
            (a.archive, a.base, a.length) for a in self._large
        ]
        outcomes = [(*where, outcome) for where, outcome in zip(placed, verdicts, strict=True)]
        outcomes.sort(key=lambda o: (o[0].file, o[1]))
        zips_in = {a.file for a, _, _, o in outcomes if not o.not_zip}
        problems: list[Problem] = []
        no_crc: dict[str, int] = {}
        checked = 0
        for archive, base, length, outcome in outcomes:
            checked += outcome.checked
            if outcome.no_crc:
                no_crc[archive.file] = no_crc.get(archive.file, 0) + 1
            elif outcome.not_zip:
                # A whole file named like torch.save but not a zip (a legacy pickle), or a DCP save in the
                # safetensors format: nothing recorded to check. An item among zips lost its first bytes.
                if archive.entry and archive.file in zips_in:
                    problems.append(
                        Problem(
                            ProblemKind.BAD_METADATA,
                            archive.file,
                            f"{archive.file}: {_item(archive, base, length)} does not start like a torch.save "
                            "archive, as the other items of the file do: its first bytes are damaged",
                            entry=archive.entry,
                        )
                    )
            elif outcome.error is not None:
                kind = ProblemKind.TRUNCATED if "truncated" in outcome.error else ProblemKind.BAD_METADATA
                problems.append(Problem(kind, archive.file, outcome.error, entry=archive.entry))
            elif outcome.damaged:
                problems += self._damage(archive, base, length, outcome.damaged)
        for file, count in sorted(no_crc.items()):
            problems.append(
                Problem(
                    ProblemKind.NO_CRC,
                    file,
                    f"{file}: {count} torch.save archive(s) record no CRC-32 (written with torch's CRC computation "
                    "off): only a manifest (`verify --write-manifest`) can vouch for their content",
                    severity="warning",
                )
            )
        return problems, checked

    def _damage(
        self, archive: TorchArchive, base: int, length: int, damaged: tuple[DamagedRecord, ...]
    ) -> list[Problem]:
        if archive.entry:  # one item of a file holding many (DCP): the item names the entry
            return [
                Problem(
                    _kind(d),
                    archive.file,
                    f"{archive.file}: {_item(archive, base, length)}: record {d.name} {_what(d.name)}{d.message}",
                    record=d.name,
                    entry=archive.entry,
                )
                for d in damaged
            ]
        entries = _entries_by_record(io.join(self._root, archive.file))
        problems = []
        for d in damaged:
            names = entries.get(d.name, ())
            of = f" ({_listed(names)})" if names else ""
            problems.append(
                Problem(
                    _kind(d),
                    archive.file,
                    f"{archive.file or io.name_of(self._root)}: record {d.name}{of} {_what(d.name)}{d.message}",
                    record=d.name,
                    entry=", ".join(names),
                )
            )
        return problems


def _kind(damage: DamagedRecord) -> ProblemKind:
    return ProblemKind.CRC_MISMATCH if damage.computed is not None else ProblemKind.UNREADABLE


def _item(archive: TorchArchive, base: int, length: int) -> str:
    where = f", {archive.where}" if archive.where else ""
    return f"item {archive.entry} (bytes {base}..{base + length}{where})"


def _what(record: str) -> str:
    if record.endswith("/data.pkl"):
        return "(the pickled structure) "
    return ""


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:3])
    return shown if len(names) <= 3 else f"{shown} and {len(names) - 3} more"


def _entries_by_record(url: str) -> dict[str, list[str]]:
    """Record name -> the dotted paths of the tensors stored in it, from the file's `data.pkl` (safely)."""
    from ckptctl.formats.torch_pickle import open_torch_pickle

    try:
        opened = open_torch_pickle(url)
        found: dict[str, list[str]] = {}
        for path, ref in opened.tensors():
            found.setdefault(f"{opened.prefix}data/{ref.storage_key}", []).append(path)
    except CkptctlError:  # data.pkl itself may be what is damaged: the record's name must do
        return {}
    return found


# --------------------------------------------------------------------------------------------------
# Deep: every tensor chunk located and read.
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _EntryState:
    entry: TensorEntry
    jobs: range = range(0)  # its chunks' jobs in `_DeepPlan.jobs`
    problems: list[Problem] = field(default_factory=list)


#: What reading one chunk found: (why it could not be read, as the problem says it, or None; NaN/Inf counted).
_ChunkRead = tuple[str | None, int]


class _ChunkBytes:
    """The sink of one chunk's element bytes: read them, and count NaN/Inf when asked.

    A part may start or end inside an element (parts are cut at byte offsets): the bytes before its first
    whole element (`lead`) and after its last (`carry`) are kept, and joined with the next part's at the end.
    """

    __slots__ = ("_count", "_parts", "dtype", "error", "finite", "itemsize")

    def __init__(self, dtype: str, finite: bool) -> None:
        self.dtype = dtype
        self.itemsize = dtype_itemsize(dtype)
        self.finite = finite
        self.error: str | None = None
        self._parts: dict[int, list[Any]] = {}  # offset -> [lead, carry, bad]
        if finite:  # numpy only when values are looked at (importing it costs a plain verify ~0.3 s)
            from ckptctl.formats.nonfinite import non_finite

            self._count = non_finite

    def piece(self, offset: int) -> Feed:
        if not self.finite:
            return _ignore
        size = self.itemsize
        part: list[Any] = [bytearray(), bytearray(), 0]
        self._parts[offset] = part
        lead = (-offset) % size

        def feed(block: memoryview) -> None:
            nonlocal lead
            view = block
            if lead:
                take = min(lead, len(view))
                part[0] += view[:take]
                lead -= take
                view = view[take:]
            carry = part[1]
            if carry:
                take = min(size - len(carry), len(view))
                carry += view[:take]
                view = view[take:]
                if len(carry) < size:
                    return
                part[2] += self._count(carry, self.dtype)
                carry.clear()
            whole = len(view) - len(view) % size
            if whole:
                part[2] += self._count(view[:whole], self.dtype)
            carry += view[whole:]

        return feed

    def failed(self, message: str) -> None:
        self.error = message

    def bad(self) -> int:
        """After the sweep: the NaN/Inf values found, elements cut between parts included."""
        total = 0
        previous: bytearray | None = None
        for offset in sorted(self._parts):
            lead, carry, bad = self._parts[offset]
            total += bad
            if previous is not None and len(previous) + len(lead) == self.itemsize:
                total += self._count(previous + lead, self.dtype)
            previous = carry
        return total


def _ignore(block: memoryview) -> None:
    pass


def _counts_non_finite(dtype: str) -> bool:
    from ckptctl.formats.nonfinite import counts_non_finite

    return counts_non_finite(dtype)


class _DeepPlan:
    """Every chunk of every tensor: checked against its metadata now, its bytes read by the sweep (one job
    per chunk; a chunk that is not one plain range of its file is a job that decodes it alone)."""

    def __init__(self, checkpoint: Checkpoint, check_finite: bool, progress: Progress) -> None:
        self.jobs: list[Job[_ChunkRead]] = []
        self._states: list[_EntryState] = []
        self._unreadable: list[Problem] = []
        try:
            index = checkpoint.tensor_index()
        except CkptctlError as exc:  # a truncated file: structure says so too, and nothing more can be read
            self._unreadable.append(Problem.from_error(exc, ""))
            index = ()
        self.count = len(index)
        progress.start("locating tensors", len(index))
        from ckptctl.formats.raw_chunks import ChunkLocator  # torch.save's readers: for reading tensors alone

        with ChunkLocator(checkpoint.url) as locator:
            for entry in index:
                self._states.append(self._plan(checkpoint.url, locator, entry, check_finite))
                progress.advance(1)
        progress.finish()

    def _plan(self, url: str, locator: ChunkLocator, entry: TensorEntry, check_finite: bool) -> _EntryState:
        state = _EntryState(entry)
        problem = entry_tiling_problem(entry)
        if problem is not None:
            state.problems.append(Problem(ProblemKind.UNREADABLE, entry.name, f"{entry.name}: {problem}"))
            return state
        finite = check_finite and _counts_non_finite(entry.dtype)
        jobs: list[Job[_ChunkRead]] = []
        try:
            for chunk in entry.chunks:
                if chunk.numel == 0:
                    continue
                found = locator.locate(entry, chunk)
                if found is None:  # not one plain range (a strided view, a remote archive): decode it alone
                    nbytes = chunk.numel * dtype_itemsize(entry.dtype)
                    jobs.append(Job((), _decoded(url, entry, chunk, finite), extra=nbytes))
                    continue
                sink = _ChunkBytes(entry.dtype, finite)
                span = Span(found.url, found.offset, found.offset + found.length, sink)
                jobs.append(Job([span], _read(sink, entry.name)))
        except CkptctlError as exc:
            state.problems.append(Problem(ProblemKind.UNREADABLE, entry.name, exc.message))
            return state
        state.jobs = range(len(self.jobs), len(self.jobs) + len(jobs))
        self.jobs += jobs
        return state

    def results(self, verdicts: Sequence[_ChunkRead]) -> list[Problem]:
        """The problems `jobs`' verdicts (in their order) show: unreadable tensors, and those holding NaN/Inf."""
        problems = list(self._unreadable)
        for state in self._states:
            problems += state.problems
            reads = [verdicts[i] for i in state.jobs]
            failed = next((error for error, _ in reads if error is not None), None)
            if failed is not None:
                problems.append(Problem(ProblemKind.UNREADABLE, state.entry.name, failed))
                continue
            bad = sum(n for _, n in reads)
            if bad:
                numel = state.entry.numel
                problems.append(
                    Problem(ProblemKind.NOT_FINITE, state.entry.name, f"{bad} of {numel} values are NaN or Inf")
                )
        return problems


def _read(sink: _ChunkBytes, name: str) -> Callable[[], _ChunkRead]:
    def verdict() -> _ChunkRead:
        return (f"{name}: {sink.error}", 0) if sink.error is not None else (None, sink.bad())

    return verdict


def _decoded(url: str, entry: TensorEntry, chunk: TensorChunk, finite: bool) -> Callable[[], _ChunkRead]:
    def verdict() -> _ChunkRead:
        try:
            tensor = read_chunk(url, entry, chunk)
        except CkptctlError as exc:
            return exc.message, 0
        return None, int(tensor.numel() - tensor.isfinite().sum()) if finite else 0

    return verdict
