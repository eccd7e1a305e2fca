"""`sync SRC DST`: mirror a run between a local folder and an object store, checkpoint by checkpoint (DESIGN §4).

What goes, and when:

- The run is scanned once (`layouts.scan_run`) and each side listed once (`io.list_tree`). Every file belongs
  to the innermost checkpoint whose folder holds it (a file checkpoint is its own file), or else to the run.
- A checkpoint complete at SRC (also `superseded` and `slim`: whole, as far as they go) is copied unless it
  is whole at DST already: each of its files listed at DST with its SRC size, and a digest record at DST (its
  own manifest or digests file as copied, else the `ckptctl-digests.json` sync wrote) no older than its files
  at SRC (with `_SLACK`: object stores keep whole seconds). Nothing of such a checkpoint is read again.
- In progress, abandoned, broken and unknown checkpoints are not copied; each is listed with why (a broken
  one is a problem: the command exits 1).
- The run's own files (pointers, trackers, configs; hidden names aside) go after every checkpoint, and a
  folder's small files (pointers are small) only while every checkpoint that a `latest`-style pointer of the
  folder names (`layouts.pointed_children`, asked before and after reading them) is whole at DST: a pointer
  at DST never names a checkpoint that is not whole there.

How one checkpoint goes (`io.commit`'s object-store protocol, used on a local DST too, file by file):

1. What DST holds of it already (an older or torn copy) loses its digest record and completion markers
   first, so that it never passes for complete with mixed content.
2. Every file but the completion markers (of any layout: `_markers`) goes up in parallel on one pool of
   `workers` threads shared by all the checkpoints of the pass (so the next checkpoint's files are sent
   while this one's markers go), the largest first, hashed (blake3) as it is read. Each file appears whole
   or not at all: an object PUT (a multipart upload with parts in parallel for large files, `io.remote`),
   or a hidden temporary file renamed into place on a local DST.
3. The markers go one after another in their layout's order, once every other file of the checkpoint is
   up. Before the last: the digests must equal SRC's own record where it has one.
4. Last, the digest record `ckptctl-digests.json`, where SRC has none, so that `verify` at DST checks every
   byte and the next sync skips the checkpoint.

A sync killed at any moment leaves a copy without its last marker: `list` at DST calls it in progress or
broken, never complete, and the next sync replaces it. One sync per DST at a time (a lock file in DST,
`core.lock`). `keep_local`: after the pass, the local run is pruned with `prune`'s plan, lock and trash under
`RetentionPolicy(keep_last=N)`, and of what that plan deletes only checkpoints whole at DST go.
"""

from __future__ import annotations

import contextlib
import enum
import os
import posixpath
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import blake3

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState
from ckptctl.core.lock import RunLock, RunLocked
from ckptctl.core.retention import RetentionPolicy
from ckptctl.errors import CheckpointNotFound, CkptctlError, StorageError
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import DIGESTS_NAME, MANIFEST_NAME, FileRecord, Manifest, load_manifest, now_iso
from ckptctl.io import trash
from ckptctl.layouts import all_layouts, get_layout, pointed_children, scan_run
from ckptctl.ops.planned import DEFAULT_GRACE, Skipped, apply_planned
from ckptctl.ops.prune import PruneItem, delete_planned, plan_prune
from ckptctl.ops.report import SCHEMA_VERSION, NoProgress, Progress

__all__ = ["SYNC_LOCK", "Action", "RunFile", "SyncItem", "SyncReport", "sync", "watch"]

#: The lock file in DST that keeps a second sync into it out.
SYNC_LOCK = ".ckptctl-sync.lock"
#: The ending of the hidden temporary file a local DST file is written into before its rename.
_PART = ".ckptctl-sync-part"
#: Object stores keep times in whole seconds: a copy is as new as its source within this.
_SLACK = 1.0
#: Files up to this size are hashed before they are sent, in the sending thread (a thread of its own costs more).
_HASH_INLINE = 1 << 20
#: Seconds between two refreshes of the DST lock (it goes stale after `core.lock.STALE_AFTER`, an hour).
_REFRESH_EVERY = 60.0
#: States whose checkpoints are whole at SRC and copied.
_COPIED = frozenset({CheckpointState.COMPLETE, CheckpointState.SUPERSEDED, CheckpointState.SLIM})
_WHY_NOT = {
    CheckpointState.IN_PROGRESS: "in progress at SRC (not copied until it is complete)",
    CheckpointState.ABANDONED: "abandoned at SRC (what a killed save left)",
    CheckpointState.BROKEN: "broken at SRC",
    CheckpointState.UNKNOWN: "unknown at SRC (checkpoint-like files no reader can tell whole)",
}


class Action(enum.StrEnum):
    COPIED = "copied"
    SKIPPED = "skipped"
    DELETED_LOCAL = "deleted_local"


class NothingToResume(CkptctlError):
    """`--latest`: SRC holds nothing a resume would load (exit code 1, as `resume-plan`)."""

    exit_code = 1


class SyncStopped(CkptctlError):
    """A signal asked the sync to stop; it did after the files in flight (exit code 130)."""

    exit_code = 130


@dataclass(frozen=True, slots=True)
class SyncItem:
    """What happened to one checkpoint of SRC.

    Attributes:
        url: the checkpoint at SRC.
        dst: where it is (or would be) at DST.
        step, layout, state: as the scan of SRC found it.
        action: copied, skipped, or (`keep_local`) its local copy deleted.
        reason: why it was skipped (or "" when copied).
        bytes: bytes sent (copied), or the checkpoint's size (skipped, deleted).
        seconds: wall time of its copy.
        problem: skipped because it is broken at SRC (or its bytes differ from its own record there).
    """

    url: str
    dst: str
    step: int | None
    layout: str
    state: str
    action: Action
    reason: str = ""
    bytes: int = 0
    seconds: float = 0.0
    problem: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "dst": self.dst,
            "step": self.step,
            "layout": self.layout,
            "state": self.state,
            "action": self.action.value,
            "reason": self.reason or None,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "problem": self.problem,
        }


@dataclass(frozen=True, slots=True)
class RunFile:
    """One of the run's own files (a pointer, a tracker, a config) that was out of date at DST."""

    path: str
    action: Action
    bytes: int
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "action": self.action.value, "bytes": self.bytes, "reason": self.reason or None}


@dataclass(frozen=True, slots=True)
class SyncReport:
    """One pass of a sync.

    Attributes:
        src, dst: the two run folders.
        dry_run: nothing was written: `copied` and `deleted_local` say what would be.
        checkpoints: every checkpoint of SRC, in scan order, then the local deletions of `keep_local`.
        run_files: the run's own files that were out of date at DST: copied, or held back with why.
        seconds: wall time of the pass.
    """

    src: str
    dst: str
    dry_run: bool
    checkpoints: tuple[SyncItem, ...]
    run_files: tuple[RunFile, ...] = ()
    seconds: float = 0.0

    @property
    def problems(self) -> tuple[SyncItem, ...]:
        return tuple(item for item in self.checkpoints if item.problem)

    @property
    def bytes_copied(self) -> int:
        copied = (i.bytes for i in self.checkpoints if i.action is Action.COPIED)
        return sum(copied) + sum(f.bytes for f in self.run_files if f.action is Action.COPIED)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "src": self.src,
            "dst": self.dst,
            "dry_run": self.dry_run,
            "checkpoints": [item.to_json() for item in self.checkpoints],
            "run_files": [f.to_json() for f in self.run_files],
            "bytes": self.bytes_copied,
            "seconds": round(self.seconds, 3),
        }


# ------------------------------------------------------------------------------------------ planning


@dataclass(slots=True)
class _Unit:
    """A checkpoint of SRC and its own files.

    Attributes:
        ref: as the scan found it.
        base: the folder its files are relative to, relative to SRC ("": SRC itself); a file checkpoint's parent.
        files: its own files, relative to `base`.
        is_file: a one-file checkpoint (its file is its own record).
    """

    ref: CheckpointRef
    base: str
    files: dict[str, io.DirEntry] = field(default_factory=dict)
    is_file: bool = False

    def path(self, rel: str) -> str:
        """`rel` (relative to `base`) relative to the run folder."""
        return f"{self.base}/{rel}" if self.base else rel

    @property
    def key(self) -> str:
        """The checkpoint relative to the run folder, as a pointer names it."""
        return self.path(next(iter(self.files))) if self.is_file else self.base

    @property
    def own_record(self) -> str | None:
        """SRC's own digest record of it (its native manifest, its digests file, or a file checkpoint's file)."""
        if self.is_file:
            return next(iter(self.files))
        return next((name for name in (MANIFEST_NAME, DIGESTS_NAME) if name in self.files), None)

    @property
    def record(self) -> str:
        """The record whose time at DST says when it was copied whole."""
        return self.own_record or DIGESTS_NAME

    @property
    def size(self) -> int:
        return sum(e.size for e in self.files.values())


def _rel(url: str, root: str) -> str:
    rel = io.relative_to(url, root)
    return "" if rel == "." else rel


def _ours(rel: str) -> bool:
    """Files ckptctl keeps in a run for itself (locks, trash, a sync's temporary files): never copied."""
    return rel.endswith(_PART) or any(part.startswith(".ckptctl-") for part in rel.split("/"))


def _assign(
    src: str, refs: Sequence[CheckpointRef], tree: Mapping[str, io.DirEntry]
) -> tuple[list[_Unit], dict[str, io.DirEntry]]:
    """The checkpoints of SRC with their own files, and the run's own files (hidden ones left out)."""
    units: list[_Unit] = []
    folders: dict[str, _Unit] = {}
    files: dict[str, _Unit] = {}
    for ref in refs:
        rel = _rel(ref.url, src)
        if rel in tree:
            unit = _Unit(ref, posixpath.dirname(rel), is_file=True)
            files[rel] = unit
        else:
            unit = _Unit(ref, rel)
            folders[rel] = unit
        units.append(unit)
    loose: dict[str, io.DirEntry] = {}
    for rel, entry in tree.items():
        if _ours(rel):
            continue
        if rel in files:
            files[rel].files[posixpath.basename(rel)] = entry
            continue
        parts = rel.split("/")
        owner = next((folders[p] for i in range(len(parts) - 1, -1, -1) if (p := "/".join(parts[:i])) in folders), None)
        if owner is not None:
            owner.files[rel[len(owner.base) + 1 :] if owner.base else rel] = entry
        elif not any(part.startswith(".") for part in parts):
            loose[rel] = entry
    return units, loose


def _newer(src: io.DirEntry, dst: io.DirEntry | None) -> bool:
    """Whether the copy `dst` of `src` is missing or out of date."""
    return dst is None or dst.size != src.size or src.mtime > dst.mtime + _SLACK


def _whole_at_dst(unit: _Unit, dst_tree: Mapping[str, io.DirEntry]) -> bool:
    """Every file of `unit` at DST with its size, and its record there no older than its files at SRC."""
    if not unit.files:
        return False
    for rel, entry in unit.files.items():
        there = dst_tree.get(unit.path(rel))
        if there is None or there.size != entry.size:
            return False
    record = dst_tree.get(unit.path(unit.record))
    newest = max(entry.mtime for entry in unit.files.values())
    return record is not None and record.mtime + _SLACK >= newest


def _markers(unit: _Unit) -> list[str]:
    """The files of `unit` that go up last, one by one: what any other layout names as a completion marker
    (a torn copy must not pass for a whole checkpoint of another layout either), then its own layout's in
    its order, then SRC's own record."""
    if unit.is_file:
        return []
    sizes = {rel: entry.size for rel, entry in unit.files.items()}
    own = list(get_layout(unit.ref.layout).completion_markers(sizes)) if unit.ref.layout else []
    others = sorted({m for layout in all_layouts() for m in layout.completion_markers(sizes)} - set(own))
    record = unit.own_record
    ordered = [m for m in [*others, *own] if m in unit.files and m != record]
    return [*dict.fromkeys(ordered), *([record] if record else [])]


# ------------------------------------------------------------------------------------------ copying


@dataclass
class _Transfer:
    """Copies files from SRC to DST, hashing them, checking `stop` before each, advancing `progress`."""

    src: str
    dst: str
    progress: Progress
    stop: threading.Event | None
    workers: int | None

    def put(self, rel: str) -> FileRecord:
        """Copy the file `rel` (relative to the run) whole or not at all; its size and blake3 digest."""
        if self.stop is not None and self.stop.is_set():
            raise SyncStopped("stopped by a signal", "run the same sync again to finish what was left")
        source, target = io.join(self.src, rel), io.join(self.dst, rel)
        if io.is_local(target):
            record = self._to_local(source, io.local_path(target))
        elif io.is_local(source) and os.path.getsize(io.local_path(source)) <= _HASH_INLINE:
            record = FileRecord(os.path.getsize(io.local_path(source)), file_digest(source))
            io.upload_file(io.local_path(source), target)
        elif io.is_local(source):
            # Hashed while it is sent (the second read comes from the page cache), not before.
            with ThreadPoolExecutor(max_workers=1) as hashing:
                digest = hashing.submit(file_digest, source)
                io.upload_file(io.local_path(source), target)
                record = FileRecord(os.path.getsize(io.local_path(source)), digest.result())
        else:
            with tempfile.TemporaryDirectory(prefix="ckptctl-sync-") as scratch:
                local = os.path.join(scratch, "file")
                record = self._download(source, local)
                io.upload_file(local, target)
        self.progress.advance(record.size)
        return record

    def _to_local(self, source: str, path: str) -> FileRecord:
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create {folder}: {exc.strerror or exc}") from exc
        part = os.path.join(folder, f".{os.path.basename(path)}{_PART}")
        record = self._download(source, part)
        with io.translate_errors(path):
            fd = os.open(part, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(part, path)
        return record

    def _download(self, source: str, path: str) -> FileRecord:
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        size = io.download_file(source, path, on_block=hasher.update, max_workers=4)
        return FileRecord(size, hasher.hexdigest())

    def parallel(self, rels: Sequence[str]) -> dict[str, FileRecord]:
        return dict(zip(rels, io.parallel_map(self.put, rels, self.workers), strict=True))


class _Mismatch(Exception):
    """The bytes read of a checkpoint differ from its own record at SRC."""


@dataclass(slots=True)
class _Started:
    """A checkpoint whose files other than its markers are on their way up (`_start`)."""

    unit: _Unit
    dst_base: str
    last: list[str]
    sending: dict[str, Future[FileRecord]]
    started: float


def _start(unit: _Unit, transfer: _Transfer, dst_tree: Mapping[str, io.DirEntry], pool: ThreadPoolExecutor) -> _Started:
    """Steps 1 and 2 of the module docstring: what DST holds of it loses its record and markers, then its
    other files are queued on `pool`, the largest first."""
    started = time.monotonic()
    dst_base = io.join(transfer.dst, unit.base) if unit.base else transfer.dst
    last = _markers(unit)
    present = [rel for rel in [*unit.files, DIGESTS_NAME] if unit.path(rel) in dst_tree]
    if present:  # an older or torn copy: never complete-looking while it is replaced
        first = [{DIGESTS_NAME}, *({m} for m in reversed(last))]
        trash.delete_objects(dst_base, [rel for rel in present if rel in {DIGESTS_NAME, *last}], first)
    rest = sorted((rel for rel in unit.files if rel not in last), key=lambda rel: (-unit.files[rel].size, rel))
    sending = {rel: pool.submit(transfer.put, unit.path(rel)) for rel in rest}
    return _Started(unit, dst_base, last, sending, started)


def _finish(job: _Started, transfer: _Transfer) -> SyncItem:
    """Steps 2 to 4: once its other files are up, its markers one by one (checked against SRC's own record
    before the last), then the digest record."""
    unit, dst_base, last = job.unit, job.dst_base, job.last
    records = {rel: future.result() for rel, future in job.sending.items()}
    try:
        for rel in last[:-1]:
            records[rel] = transfer.put(unit.path(rel))
        _check(unit, transfer, records)
        for rel in last[-1:]:
            records[rel] = transfer.put(unit.path(rel))
    except _Mismatch as exc:
        trash.delete_objects(dst_base, list(records))
        return _item(unit, transfer.dst, Action.SKIPPED, f"broken at SRC: {exc}", unit.size, problem=True)
    if unit.own_record is None:
        manifest = Manifest(files=dict(sorted(records.items())), created=now_iso())
        io.write_bytes_atomic(io.join(dst_base, DIGESTS_NAME), manifest.to_json())
    if io.is_local(dst_base):
        for folder in sorted({posixpath.dirname(unit.path(rel)) for rel in records}, reverse=True):
            io.fsync_dir(io.local_path(io.join(transfer.dst, folder) if folder else transfer.dst))
    return _item(
        unit, transfer.dst, Action.COPIED, "", sum(r.size for r in records.values()), time.monotonic() - job.started
    )


def _check(unit: _Unit, transfer: _Transfer, records: Mapping[str, FileRecord]) -> None:
    """Before the last marker: what was read equals SRC's own record of it, where it has one (a native
    manifest, a digests file). That each file is at DST needs no listing: its PUT (or its rename, locally)
    returned, and S3 and the stores like it list an object as soon as its PUT has returned."""
    own = unit.own_record
    if unit.is_file or own is None:
        return
    recorded = load_manifest(io.join(transfer.src, unit.path(own))).files
    absent = sorted(set(recorded) - set(records) - {own})
    if absent:
        raise _Mismatch(f"{absent[0]} is listed in its {own} but missing")
    for rel, record in sorted(records.items()):
        expected = recorded.get(rel)
        if expected is not None and (expected.size, expected.blake3) != (record.size, record.blake3):
            raise _Mismatch(f"{rel} read from SRC differs from its {own} (run `ckptctl verify` on it)")


def _item(
    unit: _Unit, dst: str, action: Action, reason: str, size: int, seconds: float = 0.0, problem: bool = False
) -> SyncItem:
    ref = unit.ref
    return SyncItem(
        ref.url,
        io.join(dst, unit.key) if unit.key else dst,
        ref.step,
        ref.layout,
        ref.state.value,
        action,
        reason,
        size,
        seconds,
        problem,
    )


def _vanished(unit: _Unit) -> bool:
    """Whether the checkpoint is gone from SRC (its framework's rotation deleted it while it was copied)."""
    try:
        return not io.exists(unit.ref.url)
    except CkptctlError:
        return False


def _run_files(
    loose: Mapping[str, io.DirEntry],
    whole: set[str],
    transfer: _Transfer,
    dst_tree: Mapping[str, io.DirEntry],
    dry_run: bool,
) -> list[RunFile]:
    """Copy the run's own files that are out of date at DST, folder by folder; a folder's small files (its
    pointers) only while what its pointers name is whole at DST (`whole`: checkpoints by their path)."""
    out: list[RunFile] = []
    folders: dict[str, list[str]] = {}
    for rel, entry in sorted(loose.items()):
        if _newer(entry, dst_tree.get(rel)):
            folders.setdefault(posixpath.dirname(rel), []).append(rel)
    for folder, rels in sorted(folders.items()):
        small = [rel for rel in rels if loose[rel].size <= io.MAX_MARKER_BYTES]
        large = [rel for rel in rels if rel not in small]
        if dry_run:
            out += [RunFile(rel, Action.COPIED, loose[rel].size) for rel in large]
        else:
            out += [RunFile(rel, Action.COPIED, r.size) for rel, r in transfer.parallel(large).items()]
        if not small:
            continue
        url = io.join(transfer.src, folder) if folder else transfer.src
        # A writer may move its pointer while we read it: what it named before and after must both be whole.
        before = _pointed(url, transfer.src)
        data = {} if dry_run else {rel: io.read_bytes(io.join(transfer.src, rel)) for rel in small}
        missing = sorted((before | _pointed(url, transfer.src)) - whole)
        for rel in small:
            if missing:
                reason = f"held back: a pointer here names {missing[0]}, which is not whole at DST"
                out.append(RunFile(rel, Action.SKIPPED, loose[rel].size, reason))
                continue
            if not dry_run:
                io.write_bytes_atomic(io.join(transfer.dst, rel), data[rel])
            out.append(RunFile(rel, Action.COPIED, loose[rel].size))
    return out


def _pointed(url: str, src: str) -> set[str]:
    """What `latest`-style pointers in the folder `url` name, relative to the run folder `src`."""
    return {_rel(target, src) for target in pointed_children(url, io.list_dir(url))}


# ------------------------------------------------------------------------------------------ the command


def _check_pair(src: str, dst: str, keep_local: int | None) -> None:
    if src == dst or dst.startswith(src.rstrip("/") + "/") or src.startswith(dst.rstrip("/") + "/"):
        raise CkptctlError(f"{src} and {dst} overlap", "sync between two separate folders")
    if keep_local is not None and not (io.is_local(src) and not io.is_local(dst)):
        raise CkptctlError(
            "--keep-local deletes local copies once they are whole in an object store",
            "use it with a local SRC and a remote DST (s3://...)",
        )


def _normal(url: str) -> str:
    if io.is_local(url):
        return os.path.abspath(io.local_path(url))
    return url.rstrip("/")


def _dst_tree(dst: str) -> dict[str, io.DirEntry]:
    try:
        return io.list_tree(dst)
    except CheckpointNotFound:
        return {}


@contextlib.contextmanager
def _dst_lock(dst: str, wait: float, warn: Callable[[str], None] | None) -> Any:
    if io.is_local(dst):
        try:
            os.makedirs(io.local_path(dst), exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create {dst}: {exc.strerror or exc}") from exc
    try:
        lock = RunLock(dst, name=SYNC_LOCK, wait=wait, command="ckptctl sync", warn=warn)
        lock.acquire()
    except RunLocked as exc:
        raise CkptctlError(exc.message, "wait for the other sync into this DST to finish (or pass --wait)") from exc
    try:
        yield lock
    finally:
        lock.release()


def _resume_pick(src: str) -> str:
    from ckptctl.ops.resume_plan import plan_resume

    plan = plan_resume(src, cuda=False)
    if plan.checkpoint is None:
        raise NothingToResume(f"nothing in {src} that a resume would load", "see `ckptctl resume-plan` for why")
    return plan.checkpoint.url


def _pass(
    src: str,
    dst: str,
    *,
    latest: bool,
    dry_run: bool,
    progress: Progress,
    stop: threading.Event | None,
    workers: int | None,
    keeper: _LockKeeper | None,
) -> SyncReport:
    started = time.monotonic()
    if keeper is not None:
        keeper.tick()
    refs = scan_run(src)
    units, loose = _assign(src, refs, io.list_tree(src))
    dst_tree = _dst_tree(dst)
    if io.is_local(dst) and not dry_run:
        for rel in [rel for rel in dst_tree if rel.endswith(_PART)]:
            io.delete_file(io.join(dst, rel))  # a killed sync's temporary file (the DST lock is ours)
    pick = _resume_pick(src) if latest else None
    transfer = _Transfer(src, dst, progress, stop, workers)
    items: list[SyncItem] = []
    whole: set[str] = set()
    todo: list[_Unit] = []
    for unit in units:
        ref = unit.ref
        if pick is not None and ref.url != pick:
            items.append(_item(unit, dst, Action.SKIPPED, "not what a resume loads (--latest)", unit.size))
        elif ref.state not in _COPIED:
            reason = _WHY_NOT.get(ref.state, f"{ref.state.value} at SRC") + (f": {ref.note}" if ref.note else "")
            items.append(
                _item(unit, dst, Action.SKIPPED, reason, unit.size, problem=ref.state is CheckpointState.BROKEN)
            )
        elif _whole_at_dst(unit, dst_tree):
            whole.add(unit.key)
            items.append(_item(unit, dst, Action.SKIPPED, "already whole at DST", unit.size))
        else:
            todo.append(unit)
            items.append(_item(unit, dst, Action.COPIED, "", unit.size))
    progress.start("copying", sum(unit.size for unit in todo) or None)
    try:
        if dry_run:
            whole.update(unit.key for unit in todo)
        else:
            whole.update(_copy_all(todo, transfer, dst_tree, items, keeper))
        run_files = _run_files(loose, whole, transfer, dst_tree, dry_run)
    finally:
        progress.finish()
    return SyncReport(src, dst, dry_run, tuple(items), tuple(run_files), time.monotonic() - started)


def _copy_all(
    todo: Sequence[_Unit],
    transfer: _Transfer,
    dst_tree: Mapping[str, io.DirEntry],
    items: list[SyncItem],
    keeper: _LockKeeper | None,
) -> set[str]:
    """Copy the checkpoints `todo`, replacing their entries in `items`; the keys of those now whole at DST.

    The files of every checkpoint (markers aside) are queued at once on one pool of `workers` threads, in
    checkpoint order, so that the link stays busy across checkpoints; each checkpoint's markers follow as
    soon as its own files are up, from this thread, while the pool sends the next checkpoints' files. On an
    error (or a stop) nothing more is started, and what is running ends before the error is raised.
    """
    whole: set[str] = set()
    with io.ContextThreadPool(max_workers=transfer.workers or io.workers()) as pool:
        jobs = [_start(unit, transfer, dst_tree, pool) for unit in todo]
        try:
            for job in jobs:
                if keeper is not None:
                    keeper.tick()
                unit = job.unit
                try:
                    done = _finish(job, transfer)
                except SyncStopped:
                    raise
                except CkptctlError:
                    if not _vanished(unit):
                        raise
                    done = _item(unit, transfer.dst, Action.SKIPPED, "deleted at SRC while it was copied", unit.size)
                if done.action is Action.COPIED:
                    whole.add(unit.key)
                items[next(i for i, item in enumerate(items) if item.url == unit.ref.url)] = done
        except BaseException:
            for job in jobs:
                for future in job.sending.values():
                    future.cancel()
            raise
    return whole


class _LockKeeper:
    """Refreshes the DST lock (`RunLock.refresh`: a read and a write) at most every `_REFRESH_EVERY` seconds,
    rather than before each checkpoint: far more often than it goes stale (`STALE_AFTER`), few requests."""

    def __init__(self, lock: RunLock) -> None:
        self.lock = lock
        self.refreshed = time.monotonic()

    def tick(self) -> None:
        if time.monotonic() - self.refreshed >= _REFRESH_EVERY:
            self.lock.refresh()
            self.refreshed = time.monotonic()


def _keep_local(
    report: SyncReport, keep: int, *, grace: timedelta, wait: float, warn: Callable[[str], None] | None
) -> SyncReport:
    """Delete the local checkpoints that `prune --keep-last keep` would, of those whole at DST after `report`."""
    whole = {i.url for i in report.checkpoints if i.action is Action.COPIED or i.reason == "already whole at DST"}
    extra: list[SyncItem] = []
    if report.dry_run:
        plan = plan_prune(report.src, RetentionPolicy(keep_last=keep), grace=grace)
        deleted: list[PruneItem] = [item for item in plan.delete if item.url in whole]
        left: list[Skipped[PruneItem]] = []
    else:
        with RunLock(report.src, wait=wait, command=f"ckptctl sync --keep-local {keep}", warn=warn) as lock:
            plan = plan_prune(report.src, RetentionPolicy(keep_last=keep), grace=grace)
            chosen = [item for item in plan.delete if item.url in whole]
            deleted, left = apply_planned(chosen, delete_planned, lock, plan.grace, "deleting")
    for item in deleted:
        ref = item.ref
        extra.append(
            SyncItem(ref.url, "", ref.step, ref.layout, ref.state.value, Action.DELETED_LOCAL, "", item.size_bytes)
        )
    for skipped in left:
        ref = skipped.item.ref
        reason = f"local copy kept: {skipped.reason}"
        extra.append(SyncItem(ref.url, "", ref.step, ref.layout, ref.state.value, Action.SKIPPED, reason, 0))
    return replace(report, checkpoints=report.checkpoints + tuple(extra))


def sync(
    src: str,
    dst: str,
    *,
    latest: bool = False,
    keep_local: int | None = None,
    dry_run: bool = False,
    grace: timedelta = DEFAULT_GRACE,
    wait: float = 0.0,
    workers: int | None = None,
    progress: Progress | None = None,
    stop: threading.Event | None = None,
    warn: Callable[[str], None] | None = None,
) -> SyncReport:
    """Copy every checkpoint complete at `src` and not whole at `dst` (see the module docstring).

    Args:
        src, dst: run folders: local paths or fsspec URLs, either way round.
        latest: copy only the checkpoint a resume of SRC would load (`resume-plan`'s pick), and the pointers.
        keep_local: then keep only this many of the local checkpoints (`prune --keep-last`), deleting only
            those whole at DST (SRC local, DST remote).
        dry_run: plan only: nothing is written, locked or deleted.
        grace: `prune`'s grace for `keep_local`.
        wait: seconds to wait for another sync into DST (or a prune of SRC) to finish.
        workers: parallel transfers (default `io.workers()`).
        progress: where bytes copied are reported.
        stop: set (by a signal handler) to stop after the files in flight (`SyncStopped`).
        warn: where a stale lock's takeover is reported.

    Raises:
        CkptctlError: SRC and DST overlap, another sync holds DST, a store failed (exit code 2);
            `SyncStopped` (130).
    """
    return next(
        iter(
            _passes(
                src,
                dst,
                latest=latest,
                keep_local=keep_local,
                dry_run=dry_run,
                grace=grace,
                wait=wait,
                workers=workers,
                progress=progress,
                stop=stop,
                warn=warn,
                passes=1,
                interval=0.0,
            )
        )
    )


def watch(src: str, dst: str, *, interval: float, passes: int | None = None, **options: Any) -> Iterable[SyncReport]:
    """`sync` again every `interval` seconds, holding DST's lock throughout, until `options["stop"]` is set
    (or after `passes` passes): each checkpoint is copied once it is complete, never while it is written.
    Yields each pass's report."""
    return _passes(src, dst, interval=interval, passes=passes, **options)


def _passes(
    src: str,
    dst: str,
    *,
    interval: float,
    passes: int | None,
    latest: bool = False,
    keep_local: int | None = None,
    dry_run: bool = False,
    grace: timedelta = DEFAULT_GRACE,
    wait: float = 0.0,
    workers: int | None = None,
    progress: Progress | None = None,
    stop: threading.Event | None = None,
    warn: Callable[[str], None] | None = None,
) -> Iterable[SyncReport]:
    src, dst = _normal(src), _normal(dst)
    _check_pair(src, dst, keep_local)
    sink = progress or NoProgress()
    lock_or_none = contextlib.nullcontext(None) if dry_run else _dst_lock(dst, wait, warn)
    with lock_or_none as lock:
        keeper = None if lock is None else _LockKeeper(lock)
        count = 0
        while True:
            report = _pass(
                src, dst, latest=latest, dry_run=dry_run, progress=sink, stop=stop, workers=workers, keeper=keeper
            )
            if keep_local is not None:
                report = _keep_local(report, keep_local, grace=grace, wait=wait, warn=warn)
            yield report
            count += 1
            if (passes is not None and count >= passes) or (stop is not None and stop.wait(interval)):
                return
            if stop is None:
                time.sleep(interval)
