"""`sync SRC DST`: mirror a run between a local folder and an object store, checkpoint by checkpoint (DESIGN §4).

What goes, and when:

- The run is scanned once (`layouts.scan_run`) and each side listed once (`io.list_tree`). Every file belongs
  to the innermost checkpoint whose folder holds it (a file checkpoint is its own file), or else to the run.
- A checkpoint complete at SRC (also `superseded` and `slim`: whole, as far as they go) is copied unless it
  is whole at DST already: each of its files listed at DST with its SRC size, and a digest record at DST (its
  own manifest or digests file as copied, else the `ckptctl-digests.json` sync wrote) no older than its files
  at SRC (with `SLACK`: object stores keep whole seconds). Nothing of such a checkpoint is read again.
- In progress, abandoned, broken and unknown checkpoints are not copied; each is listed with why (a broken
  one is a problem: the command exits 1).
- The run's own files (pointers, trackers, configs; hidden names aside) go after every checkpoint, and a
  folder's small files (pointers are small) only while every checkpoint that a `latest`-style pointer of the
  folder names (`layouts.pointed_children`, asked before and after reading them) is whole at DST: a pointer
  at DST never names a checkpoint that is not whole there.

How one checkpoint goes is `core.mirror`'s (shared with the manager's `mirror` option): what DST holds of it
loses its record and markers first, its other files go up in parallel (the pass's checkpoints share one pool of
`workers` threads, so the next checkpoint's files are sent while this one's markers go; large files as
multipart uploads with parts in parallel), its completion markers one by one after them (checked against SRC's
own record before the last), and last a `ckptctl-digests.json` where SRC has no record of its own.

A sync killed at any moment leaves a copy without its last marker: `list` at DST calls it in progress or
broken, never complete, and the next sync replaces it. One sync per DST at a time (a lock file in DST,
`core.lock`; the manager's mirror takes it for each step it copies). `keep_local`: after the pass, the local
run is pruned with `prune`'s plan, lock and trash under `RetentionPolicy(keep_last=N)`, and of what that plan
deletes only checkpoints whole at DST go.
"""

from __future__ import annotations

import contextlib
import enum
import posixpath
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState
from ckptctl.core.lock import RunLock, RunLocked
from ckptctl.core.mirror import (
    PART,
    SLACK,
    SYNC_LOCK,
    CheckpointFiles,
    Mismatch,
    Started,
    SyncStopped,
    Transfer,
    finish_copy,
    start_copy,
    whole_at,
)
from ckptctl.errors import CheckpointNotFound, CkptctlError
from ckptctl.layouts import pointed_children, scan_run
from ckptctl.ops.planned import DEFAULT_GRACE, Skipped
from ckptctl.ops.report import SCHEMA_VERSION, NoProgress, Progress

if TYPE_CHECKING:  # `prune` is imported by `keep_local` alone (a sync without it does not pay for its import)
    from ckptctl.formats.manifest import FileRecord
    from ckptctl.ops.prune import PruneItem

__all__ = ["SYNC_LOCK", "Action", "RunFile", "SyncItem", "SyncOptions", "SyncReport", "sync", "watch"]

#: Seconds between two refreshes of the DST lock (it goes stale after `core.lock.STALE_AFTER`, an hour).
_REFRESH_EVERY = 60.0
#: Seconds DST's lock may take for the reading of SRC started with it to be used (more: it waited for
#: another sync, and SRC is read again once the lock is ours).
_SOURCE_FRESH = 1.0
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


def _rel(url: str, root: str) -> str:
    rel = io.relative_to(url, root)
    return "" if rel == "." else rel


def _ours(rel: str) -> bool:
    """Files ckptctl keeps in a run for itself (locks, trash, a sync's temporary files): never copied."""
    return rel.endswith(PART) or any(part.startswith(".ckptctl-") for part in rel.split("/"))


def _assign(
    src: str, refs: Sequence[CheckpointRef], tree: Mapping[str, io.DirEntry]
) -> tuple[list[CheckpointFiles], dict[str, io.DirEntry]]:
    """The checkpoints of SRC with their own files, and the run's own files (hidden ones left out)."""
    units: list[CheckpointFiles] = []
    folders: dict[str, CheckpointFiles] = {}
    files: dict[str, CheckpointFiles] = {}
    for ref in refs:
        rel = _rel(ref.url, src)
        if rel in tree:
            unit = CheckpointFiles(ref, posixpath.dirname(rel), is_file=True)
            files[rel] = unit
        else:
            unit = CheckpointFiles(ref, rel)
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
    return dst is None or dst.size != src.size or src.mtime > dst.mtime + SLACK


# ------------------------------------------------------------------------------------------ copying


def _item(
    unit: CheckpointFiles, dst: str, action: Action, reason: str, size: int, seconds: float = 0.0, problem: bool = False
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


def _vanished(unit: CheckpointFiles) -> bool:
    """Whether the checkpoint is gone from SRC (its framework's rotation deleted it while it was copied)."""
    try:
        return not io.exists(unit.ref.url)
    except CkptctlError:
        return False


def _run_files(
    loose: Mapping[str, io.DirEntry],
    whole: set[str],
    transfer: Transfer,
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
    # `--keep-local` means "local copies" of a remote run: which side is local is what the option is about.
    if keep_local is not None and not (io.is_local(src) and not io.is_local(dst)):
        raise CkptctlError(
            "--keep-local deletes local copies once they are whole in an object store",
            "use it with a local SRC and a remote DST (s3://...)",
        )


def _dst_tree(dst: str) -> dict[str, io.DirEntry]:
    try:
        return io.list_tree(dst)
    except CheckpointNotFound:
        return {}


@contextlib.contextmanager
def _dst_lock(dst: str, wait: float, warn: Callable[[str], None] | None) -> Any:
    io.make_folder(dst)
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


@dataclass(frozen=True, slots=True)
class _Source:
    """What a pass reads of SRC before it copies: its checkpoints, its files, and (`--latest`) what a resume
    would load."""

    refs: Sequence[CheckpointRef]
    tree: Mapping[str, io.DirEntry]
    pick: str | None

    @classmethod
    def read(cls, src: str, latest: bool, cancel: threading.Event | None = None) -> _Source:
        """`cancel`: set when the answer is no longer wanted: the scan stops at its next folder (and what
        follows it is not started), rather than reading on behind the pass that replaced it."""
        refs = scan_run(src, cancel=cancel)
        io.stop_if_cancelled(cancel, f"the reading of {src}")
        tree = io.list_tree(src)
        io.stop_if_cancelled(cancel, f"the reading of {src}")
        return cls(refs, tree, _resume_pick(src) if latest else None)


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
    source: _Source | None = None,
) -> SyncReport:
    """One pass; `source`: SRC as read while DST's lock was taken (read now when None)."""
    started = time.monotonic()
    if keeper is not None:
        keeper.tick()
    if source is None:
        source = _Source.read(src, latest)
    units, loose = _assign(src, source.refs, source.tree)
    dst_tree = _dst_tree(dst)
    # Only a download into a local DST goes through a temporary file (`PART`); an object store's PUT is atomic.
    if io.is_local(dst) and not dry_run:
        for rel in [rel for rel in dst_tree if rel.endswith(PART)]:
            io.delete_file(io.join(dst, rel))  # a killed sync's temporary file (the DST lock is ours)
    pick = source.pick
    transfer = Transfer(src, dst, progress.advance, stop, workers)
    items: list[SyncItem] = []
    whole: set[str] = set()
    todo: list[CheckpointFiles] = []
    for unit in units:
        ref = unit.ref
        if pick is not None and ref.url != pick:
            items.append(_item(unit, dst, Action.SKIPPED, "not what a resume loads (--latest)", unit.size))
        elif ref.state not in _COPIED:
            reason = _WHY_NOT.get(ref.state, f"{ref.state.value} at SRC") + (f": {ref.note}" if ref.note else "")
            items.append(
                _item(unit, dst, Action.SKIPPED, reason, unit.size, problem=ref.state is CheckpointState.BROKEN)
            )
        elif whole_at(unit, dst_tree):
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
    todo: Sequence[CheckpointFiles],
    transfer: Transfer,
    dst_tree: Mapping[str, io.DirEntry],
    items: list[SyncItem],
    keeper: _LockKeeper | None,
) -> set[str]:
    """Copy the checkpoints `todo`, replacing their entries in `items`; the keys of those now whole at DST.

    The files of every checkpoint (markers aside) are queued at once on one pool of `workers` threads, in
    checkpoint order, so that the link stays busy across checkpoints; each checkpoint's markers follow, one
    by one, as soon as its own files are up, on a second pool of `workers` threads (one checkpoint's
    markers on one of them): a marker can be most of a checkpoint (another layout's weights file, such as a
    native checkpoint's `model.safetensors`), and one thread sending every checkpoint's markers one
    checkpoint after another sent those files one at a time (a full sync of 5 native checkpoints took 1.85x
    rclone's time). So up to `workers` files and the markers of up to `workers` checkpoints are in flight
    (botocore's pool holds connections for them all, `io.s3`). On an error (or a stop) nothing more is
    started, and what is running ends before the error is raised.
    """
    whole: set[str] = set()
    limit = transfer.workers or io.workers()
    with (
        io.ContextThreadPool(max_workers=limit) as pool,
        io.ContextThreadPool(max_workers=limit, thread_name_prefix="ckptctl-markers") as finishers,
    ):
        jobs: list[Started] = []
        finishing: list[Future[dict[str, FileRecord]]] = []
        try:
            for unit in todo:  # inside the try: a failed start cancels what the ones before it queued
                job = start_copy(unit, transfer, dst_tree, pool)
                jobs.append(job)
                finishing.append(finishers.submit(finish_copy, job, transfer))
            for job, finished in zip(jobs, finishing, strict=True):
                unit = job.unit
                try:
                    records = _result(finished, keeper)
                    seconds = time.monotonic() - job.started
                    done = _item(unit, transfer.dst, Action.COPIED, "", sum(r.size for r in records.values()), seconds)
                except Mismatch as exc:
                    reason = f"broken at SRC: {exc}"
                    done = _item(unit, transfer.dst, Action.SKIPPED, reason, unit.size, problem=True)
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
            transfer.halted.set()
            for job in jobs:
                for future in job.sending.values():
                    future.cancel()
            for finisher in finishing:
                finisher.cancel()
            raise
    return whole


def _result(finished: Future[dict[str, FileRecord]], keeper: _LockKeeper | None) -> dict[str, FileRecord]:
    """The records of a checkpoint's copy once it is done, DST's lock refreshed meanwhile (`keeper`)."""
    # Waited on with wait(), not result(timeout=): since Python 3.11 the timeout result() raises is the builtin
    # TimeoutError, which a copy that failed of a timeout of its own (an NFS soft mount's ETIMEDOUT) raises
    # too; taken for the wait's, it would be waited on again forever, the lock refreshed all along.
    while True:
        if keeper is not None:
            keeper.tick()
        if wait([finished], timeout=_REFRESH_EVERY).done:
            return finished.result()


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
    from ckptctl.core.retention import RetentionPolicy
    from ckptctl.ops.planned import apply_planned
    from ckptctl.ops.prune import delete_planned, plan_prune

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


class SyncOptions(TypedDict, total=False):
    """What `sync` and `watch` take besides SRC and DST, each optional (its default is `_passes`'s).

    Attributes:
        latest: copy only the checkpoint a resume of SRC would load (`resume-plan`'s pick), and the pointers.
        keep_local: then keep only this many of the local checkpoints (`prune --keep-last`), deleting only
            those whole at DST (SRC local, DST remote).
        dry_run: plan only: nothing is written, locked or deleted.
        grace: `prune`'s grace for `keep_local` (default `ops.planned.DEFAULT_GRACE`).
        wait: seconds to wait for another sync into DST (or a prune of SRC) to finish (default 0).
        workers: parallel transfers (default `io.workers()`).
        progress: where bytes copied are reported.
        stop: set (by a signal handler) to stop after the files in flight (`SyncStopped`).
        warn: where a stale lock's takeover is reported.
    """

    latest: bool
    keep_local: int | None
    dry_run: bool
    grace: timedelta
    wait: float
    workers: int | None
    progress: Progress | None
    stop: threading.Event | None
    warn: Callable[[str], None] | None


def sync(src: str, dst: str, **options: Unpack[SyncOptions]) -> SyncReport:
    """Copy every checkpoint complete at `src` and not whole at `dst` (see the module docstring).

    Args:
        src, dst: run folders: local paths or fsspec URLs, either way round.
        options: see `SyncOptions`.

    Raises:
        CkptctlError: SRC and DST overlap, another sync holds DST, a store failed (exit code 2);
            `SyncStopped` (130).
    """
    return next(iter(_passes(src, dst, passes=1, interval=0.0, **options)))


def watch(
    src: str, dst: str, *, interval: float, passes: int | None = None, **options: Unpack[SyncOptions]
) -> Iterable[SyncReport]:
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
    src, dst = io.absolute(src), io.absolute(dst)
    _check_pair(src, dst, keep_local)
    sink = progress or NoProgress()
    # SRC is read while DST's lock is taken (the scan is local work, the lock round trips to the store); what
    # was read is used only if the lock came at once, not after waiting for another sync to finish.
    # Cancelled when it is not used (the lock came late, or not at all), so that it does not go on reading
    # SRC behind the pass that reads it again.
    unwanted = threading.Event()
    reading = io.in_background(_Source.read, src, latest, unwanted)
    asked = time.monotonic()
    lock_or_none = contextlib.nullcontext(None) if dry_run else _dst_lock(dst, wait, warn)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(unwanted.set)
        lock = cleanup.enter_context(lock_or_none)
        source = reading.result() if time.monotonic() - asked < _SOURCE_FRESH else None
        unwanted.set()
        keeper = None if lock is None else _LockKeeper(lock)
        count = 0
        while True:
            report = _pass(
                src,
                dst,
                latest=latest,
                dry_run=dry_run,
                progress=sink,
                stop=stop,
                workers=workers,
                keeper=keeper,
                source=source,
            )
            source = None
            if keep_local is not None:
                report = _keep_local(report, keep_local, grace=grace, wait=wait, warn=warn)
            yield report
            count += 1
            if (passes is not None and count >= passes) or (stop is not None and stop.wait(interval)):
                return
            if stop is None:
                time.sleep(interval)
