"""Copying a checkpoint to another run folder so that the copy never passes for complete before it is whole,
shared by `ckptctl sync` (`ops.sync`, which scans the run and decides what goes) and the manager's background
mirror (`Mirror`, below: each step it commits).

How one checkpoint goes (`io.commit`'s object-store protocol, used on a local DST too, file by file):

1. What DST holds of it already (an older or torn copy) loses its digest record and completion markers
   first, so that it never passes for complete with mixed content.
2. Every file but the completion markers (of any layout: `markers`) goes up in parallel on a pool of
   `workers` threads (`ops.sync` shares one pool between the checkpoints of a pass, so the next checkpoint's
   files are sent while this one's markers go), the largest first, hashed (blake3) as it is read. Each file
   appears whole or not at all: an object PUT (a multipart upload with parts in parallel for large files,
   `io.remote`), or a hidden temporary file renamed into place on a local DST.
3. The markers go one after another in their layout's order, once every other file of the checkpoint is
   up. Before the last: the digests must equal SRC's own record where it has one.
4. Last, the digest record `ckptctl-digests.json`, where SRC has none, so that `verify` at DST checks every
   byte and the next sync skips the checkpoint.

A copy killed at any moment lacks its last marker: `list` at DST calls it in progress or broken, never
complete, and the next copy replaces it.
"""

from __future__ import annotations

import collections
import logging
import os
import posixpath
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState
from ckptctl.core.deleter import OneBackgroundThread
from ckptctl.core.lock import RunLock, RunLocked
from ckptctl.errors import CkptctlError, StorageError
from ckptctl.formats.digest import copy_hashed, file_digest
from ckptctl.formats.manifest import DIGESTS_NAME, MANIFEST_NAME, FileRecord, Manifest, load_manifest, now_iso
from ckptctl.io import trash
from ckptctl.layouts import all_layouts, get_layout

__all__ = [
    "LOCK_WAIT",
    "PART",
    "SLACK",
    "SYNC_LOCK",
    "CheckpointFiles",
    "Mirror",
    "Mismatch",
    "Started",
    "SyncStopped",
    "Transfer",
    "finish_copy",
    "markers",
    "start_copy",
    "whole_at",
]

log = logging.getLogger("ckptctl.core")

#: The lock file in DST that keeps its writers apart: `ckptctl sync` holds it for its passes, the manager's
#: mirror for each step it copies (and the `latest` it writes after it). Without it, one's clearing of a
#: checkpoint it re-copies could follow the other's finding it whole: a `latest` at DST naming a checkpoint
#: not whole there, or `sync --keep-local` deleting the local copy of a checkpoint the mirror had just cleared.
SYNC_LOCK = ".ckptctl-sync.lock"
#: Seconds the mirror waits for another writer of DST (a `sync`; a `sync --watch` holds DST throughout) before
#: it looks whether that writer has copied the step whole, and otherwise gives the step up until the next save.
LOCK_WAIT = 60.0
#: Seconds between two refreshes of the mirror's DST lock while it copies a step (written into the lock, which
#: is stale after `core.lock.MISSED_REFRESHES` of them: a trainer killed mid-copy does not hold DST for an hour).
_REFRESH_EVERY = 60.0
#: The ending of the hidden temporary file a local DST file is written into before its rename.
PART = ".ckptctl-sync-part"
#: Object stores keep times in whole seconds: a copy is as new as its source within this.
SLACK = 1.0
#: Files up to this size are hashed before they are sent, in the sending thread (a thread of its own costs more).
_HASH_INLINE = 1 << 20


class SyncStopped(CkptctlError):
    """A signal asked the sync to stop; it did after the files in flight (exit code 130)."""

    exit_code = 130


class Mismatch(Exception):
    """The bytes read of a checkpoint differ from its own record at SRC."""


@dataclass(slots=True)
class CheckpointFiles:
    """A checkpoint of SRC and its own files (what `ops.sync` found by scanning the run, or a step the manager
    committed).

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


def whole_at(unit: CheckpointFiles, dst_tree: Mapping[str, io.DirEntry]) -> bool:
    """Every file of `unit` at DST with its size, and its record there no older than its files at SRC."""
    if not unit.files:
        return False
    for rel, entry in unit.files.items():
        there = dst_tree.get(unit.path(rel))
        if there is None or there.size != entry.size:
            return False
    record = dst_tree.get(unit.path(unit.record))
    newest = max(entry.mtime for entry in unit.files.values())
    return record is not None and record.mtime + SLACK >= newest


def markers(unit: CheckpointFiles) -> list[str]:
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


@dataclass
class Transfer:
    """Copies files from SRC to DST, hashing them, checking `stop` (and `halted`) before each, reporting bytes
    to `on_bytes`."""

    src: str
    dst: str
    on_bytes: Callable[[int], None] | None = None
    stop: threading.Event | None = None
    workers: int | None = None
    #: Set when the pass failed: no file starts after it (what is in flight ends).
    halted: threading.Event = field(default_factory=threading.Event)

    def put(self, rel: str, before: Callable[[], None] | None = None) -> FileRecord:
        """Copy the file `rel` (relative to the run) whole or not at all; its size and blake3 digest. `before`
        runs first, unless `stop` or `halted` is set (then nothing runs: `SyncStopped`)."""
        if self.stop is not None and self.stop.is_set():
            raise SyncStopped("stopped by a signal", "run the same sync again to finish what was left")
        if self.halted.is_set():
            raise SyncStopped("stopped after another file failed", "run the same sync again to finish what was left")
        if before is not None:
            before()
        source, target = io.join(self.src, rel), io.join(self.dst, rel)
        # Which side is local decides how a file travels (a download beside its target, an upload hashed as
        # it is sent, or a local scratch copy between two stores): the direction is the command's own.
        if io.is_local(target):
            record = self._to_local(source, io.local_path(target))
        elif io.is_local(source):
            with io.translate_errors(source):  # a file deleted at SRC meanwhile: a StorageError, not a crash
                size = os.path.getsize(io.local_path(source))
            if size <= _HASH_INLINE:
                record = FileRecord(size, file_digest(source))
                io.upload_file(io.local_path(source), target)
            else:
                # Hashed while it is sent (the second read comes from the page cache), not before; a pool that
                # runs the hash inline once the interpreter exits (the manager's mirror copies at exit too).
                with io.ContextThreadPool(max_workers=1) as hashing:
                    digest = hashing.submit(file_digest, source)
                    io.upload_file(io.local_path(source), target)
                    record = FileRecord(size, digest.result())
        else:
            with tempfile.TemporaryDirectory(prefix="ckptctl-sync-") as scratch:
                local = os.path.join(scratch, "file")
                record = self._download(source, local)
                io.upload_file(local, target)
        if self.on_bytes is not None:
            self.on_bytes(record.size)
        return record

    def _to_local(self, source: str, path: str) -> FileRecord:
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create {folder}: {exc.strerror or exc}") from exc
        part = os.path.join(folder, f".{os.path.basename(path)}{PART}")
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
        return copy_hashed(source, path, max_workers=4)

    def parallel(self, rels: Sequence[str]) -> dict[str, FileRecord]:
        return dict(zip(rels, io.parallel_map(self.put, rels, self.workers), strict=True))


@dataclass(slots=True)
class Started:
    """A checkpoint whose files other than its markers are on their way up (`start_copy`)."""

    unit: CheckpointFiles
    dst_base: str
    last: list[str]
    sending: dict[str, Future[FileRecord]]
    started: float
    clear: _Clear


class _Clear:
    """Step 1 of the module docstring, run once, by whichever of the checkpoint's transfers starts first: what
    DST holds of it loses its record and markers only when its copy is really under way, so that a pass
    stopped (or killed) before it reaches a checkpoint leaves that checkpoint's older copy as it was."""

    def __init__(self, dst_base: str, stale: list[str], tiers: list[set[str]]) -> None:
        self.dst_base, self.stale, self.tiers = dst_base, stale, tiers
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            if self.stale:
                trash.delete_objects(self.dst_base, self.stale, self.tiers)
                self.stale = []


def start_copy(
    unit: CheckpointFiles, transfer: Transfer, dst_tree: Mapping[str, io.DirEntry], pool: ThreadPoolExecutor
) -> Started:
    """Steps 1 and 2 of the module docstring: its files other than its markers are queued on `pool`, the
    largest first, and the first of them to start takes the record and markers away from what DST holds of
    it. `dst_tree`: DST's listing (relative to its root)."""
    started = time.monotonic()
    dst_base = io.join(transfer.dst, unit.base) if unit.base else transfer.dst
    last = markers(unit)
    present = [rel for rel in [*unit.files, DIGESTS_NAME] if unit.path(rel) in dst_tree]
    # an older or torn copy: never complete-looking while it is replaced
    stale = [rel for rel in present if rel in {DIGESTS_NAME, *last}]
    clear = _Clear(dst_base, stale, [{DIGESTS_NAME}, *({m} for m in reversed(last))])
    rest = sorted((rel for rel in unit.files if rel not in last), key=lambda rel: (-unit.files[rel].size, rel))

    sending = {rel: pool.submit(transfer.put, unit.path(rel), clear) for rel in rest}
    return Started(unit, dst_base, last, sending, started, clear)


def finish_copy(job: Started, transfer: Transfer) -> dict[str, FileRecord]:
    """Steps 2 to 4: once its other files are up, its markers one by one (checked against SRC's own record
    before the last), then the digest record; the records of what was sent.

    Raises:
        Mismatch: what was read differs from SRC's own record (what was sent of it is deleted again).
    """
    unit, dst_base, last = job.unit, job.dst_base, job.last
    records = {rel: future.result() for rel, future in job.sending.items()}
    job.clear()  # done by its first file's transfer, unless it has none but its markers
    try:
        for rel in last[:-1]:
            records[rel] = transfer.put(unit.path(rel))
        _check(unit, transfer, records)
        # The folders' entries of everything sent are durable before the marker that makes the copy complete.
        _fsync_folders(transfer.dst, unit, records)
        for rel in last[-1:]:
            records[rel] = transfer.put(unit.path(rel))
    except Mismatch:
        trash.delete_objects(dst_base, list(records))
        raise
    if unit.own_record is None:
        manifest = Manifest(files=dict(sorted(records.items())), created=now_iso())
        io.write_bytes_atomic(io.join(dst_base, DIGESTS_NAME), manifest.to_json())
    _fsync_folders(transfer.dst, unit, records)
    return records


def _fsync_folders(dst: str, unit: CheckpointFiles, sent: Mapping[str, FileRecord]) -> None:
    """fsync the DST folders holding the files `sent` (deepest first; nothing on object stores)."""
    for folder in sorted({posixpath.dirname(unit.path(rel)) for rel in sent}, reverse=True):
        io.fsync_dir(io.join(dst, folder) if folder else dst)


def _check(unit: CheckpointFiles, transfer: Transfer, records: Mapping[str, FileRecord]) -> None:
    """Before the last marker: what was read equals SRC's own record of it, where it has one (a native
    manifest, a digests file). That each file is at DST needs no listing: its PUT (or its rename, locally)
    returned, and S3 and the stores like it list an object as soon as its PUT has returned."""
    own = unit.own_record
    if unit.is_file or own is None:
        return
    recorded = load_manifest(io.join(transfer.src, unit.path(own))).files
    absent = sorted(set(recorded) - set(records) - {own})
    if absent:
        raise Mismatch(f"{absent[0]} is listed in its {own} but missing")
    for rel, record in sorted(records.items()):
        expected = recorded.get(rel)
        if expected is not None and (expected.size, expected.blake3) != (record.size, record.blake3):
            raise Mismatch(f"{rel} read from SRC differs from its {own} (run `ckptctl verify` on it)")


class Mirror(OneBackgroundThread):
    """The background mirror of a `CheckpointManager` run (its `mirror` option): each step the manager commits
    is copied to the same folder name below `url` as `ckptctl sync` copies a checkpoint (`start_copy`,
    `finish_copy`: its manifest last), then the run's `latest` pointer, when it names a step whole there.

    Copies run one step after another on a thread of their own, started by `submit` and ending when nothing
    is queued, so that `save` never waits for an upload. It is not a daemon thread: the interpreter waits for
    the queued copies at exit. A step that failed to copy is tried again with the next
    submitted step. The manager's retention keeps the steps not yet copied (`pending`); a step deleted
    locally otherwise is left out (what was sent of it has no manifest, so it lists as in progress there, and
    the next sync of the run replaces it). Failures are kept for the manager to report on its own thread
    (`take_errors`).

    Args:
        root: the manager's run folder.
        url: the mirror's run folder (any fsspec URL or a local path).
        pointer: the run's pointer file name (`latest`).
        workers: parallel transfers per step (default `io.workers()`).
    """

    def __init__(self, root: str, url: str, pointer: str, workers: int | None = None) -> None:
        super().__init__()
        self.root, self.url, self.pointer = root, url.rstrip("/"), pointer
        self.workers = workers
        self._queue: collections.deque[str] = collections.deque()
        self._failed: list[str] = []
        self._whole: set[str] = set()
        self._current: str | None = None
        #: A step of this save waited `LOCK_WAIT` for DST in vain: the others do not wait again (at exit, the
        #: interpreter waits for the mirror thread: a minute a failed step while a `sync --watch` holds DST).
        self._waited = False

    def submit(self, folder: str) -> None:
        """Queue the committed step `folder` (its name in the run), after the steps that failed to copy."""
        with self._lock:
            self._waited = False
            for name in [*self._failed, folder]:
                if name not in self._queue:
                    self._queue.append(name)
            self._failed = []
            self._wake(f"ckptctl-mirror-{folder}")

    def pending(self) -> set[str]:
        """The steps not yet copied: queued, being copied, or failed."""
        with self._lock:
            return {*self._queue, *self._failed, *([self._current] if self._current else [])}

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                folder = self._current = self._queue.popleft()
            try:
                self._copy(folder)
            except BaseException as exc:  # handed to the manager's thread by take_errors
                log.warning("mirroring %s failed: %s", folder, exc)
                with self._lock:
                    self._errors.append(exc)
                    self._failed.append(folder)
            finally:
                with self._lock:
                    self._current = None

    def _copy(self, folder: str) -> None:
        with self._lock:  # a re-saved step is whole at the mirror again only once this copy of it is
            self._whole.discard(folder)
        io.make_folder(self.url)
        with self._lock:
            wait = 0.0 if self._waited else LOCK_WAIT
        lock = RunLock(
            self.url,
            name=SYNC_LOCK,
            wait=wait,
            command="CheckpointManager mirror",
            warn=log.warning,
            refresh_every=_REFRESH_EVERY,  # a trainer killed mid-copy holds DST for minutes, not an hour
        )
        try:
            lock.acquire()
        except RunLocked as exc:
            with self._lock:
                self._waited = True
            # Another writer holds DST (a `sync --watch` holds it throughout): a step it has copied whole is done.
            if self._whole_there(folder):
                log.info("%s was copied whole to %s by another writer", folder, self.url)
                return
            raise CkptctlError(exc.message, "the step is copied after the next save, once DST is free") from exc
        done, lost = threading.Event(), threading.Event()
        keeper = threading.Thread(target=_keep_alive, args=(lock, done, lost), name="ckptctl-mirror-lock", daemon=True)
        keeper.start()
        try:
            self._send(folder, lost)
        finally:
            done.set()
            keeper.join()
            lock.release()

    def _whole_there(self, folder: str) -> bool:
        """Whether the step `folder` is whole at the mirror (as another writer of DST left it)."""
        step = self._step(folder)
        return step is not None and whole_at(*step)

    def _step(self, folder: str) -> tuple[CheckpointFiles, dict[str, io.DirEntry]] | None:
        """The committed step `folder`'s files here and what DST has of them (nothing where it cannot be
        listed); None when the step is gone from here or holds no manifest (deleted meanwhile)."""
        source = io.join(self.root, folder)
        try:
            files = io.list_tree(source)
        except CkptctlError:
            return None
        if MANIFEST_NAME not in files:
            return None
        try:
            there = {f"{folder}/{rel}": entry for rel, entry in io.list_tree(io.join(self.url, folder)).items()}
        except CkptctlError:
            there = {}
        ref = CheckpointRef(source, "native", None, None, None, CheckpointState.COMPLETE, 0)
        return CheckpointFiles(ref, folder, dict(files)), there

    def _send(self, folder: str, lost: threading.Event) -> None:
        """Copy the step `folder` unless it is whole at DST already, then `latest` if it names a whole step.
        Once DST's lock is `lost` (another writer took it over) no file starts, and neither the step's
        markers nor `latest` are written: that writer may be clearing or judging the same step."""
        step = self._step(folder)
        if step is None:
            log.info("%s is gone from %s before it was mirrored", folder, self.root)
            return
        unit, there = step
        source = unit.ref.url
        if not whole_at(unit, there):
            transfer = Transfer(self.root, self.url, workers=self.workers, halted=lost)
            with io.ContextThreadPool(max_workers=self.workers or io.workers()) as pool:
                job = start_copy(unit, transfer, there, pool)
                try:
                    finish_copy(job, transfer)
                except CkptctlError:
                    _unless_lost(lost, self.url)
                    if io.exists(io.join(source, MANIFEST_NAME)):
                        raise
                    log.info("%s was deleted from %s while it was mirrored", folder, self.root)
                    return
        _unless_lost(lost, self.url)
        self._whole.add(folder)
        try:
            named = io.read_bytes(io.join(self.root, self.pointer), 0, 4096)
        except CkptctlError:
            return
        if named.decode(errors="replace").strip() in self._whole:
            io.write_bytes_atomic(io.join(self.url, self.pointer), named)


def _keep_alive(lock: RunLock, done: threading.Event, lost: threading.Event) -> None:
    """Refresh `lock` every `_REFRESH_EVERY` seconds until `done`; set `lost` when it cannot be (taken over,
    or the store did not answer): the copy then stops before its markers (`Mirror._send`)."""
    while not done.wait(_REFRESH_EVERY):
        try:
            lock.refresh()
        except CkptctlError as exc:
            log.warning("the lock of %s was lost while mirroring: %s", lock.url, exc)
            lost.set()
            return


def _unless_lost(lost: threading.Event, url: str) -> None:
    """Raise when the mirror's lock of DST `url` was lost during a step's copy."""
    if lost.is_set():
        raise CkptctlError(
            f"lost the lock of {url} while copying a step there (another writer took it over)",
            "the step stays local and is copied after the next save",
        )
