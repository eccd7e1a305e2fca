"""A lock file that lets one process at a time act on a run folder: `prune`, `slim` and `repair` hold it for
their whole work, `CheckpointManager` for each update of `latest`, each retention and each slim of a step. It
lives in the core because the manager takes it and the core imports nothing above it; `ops` imports it from here.

The lock is a small JSON file (`host`, `pid`, process start time, a random token) created with `O_EXCL`,
so that two processes cannot both create it. Its holder refreshes its mtime as it works. A lock is stale,
and taken over with a warning, when its process is gone (same host: the pid is dead, or now belongs to a
process started at another time) or when nobody has refreshed it for `STALE_AFTER` (sooner for a holder that
refreshes on a timer and says so: `LockInfo.refresh_every`). Taking over renames the
stale file away and checks that what was renamed is the stale lock (its token), so that two processes
breaking the same stale lock cannot both win. A holder checks that the lock is still its own before each
destructive step (`check`), so that a holder which was presumed dead and overtaken stops.

On object stores there is no create-if-absent: the lock is written and read back (best effort; two
processes starting within the same instant can both believe they hold it).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shlex
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from types import TracebackType

from ckptctl import io
from ckptctl.errors import CkptctlError, CorruptCheckpoint, StorageError
from ckptctl.formats.documents import as_whole, parse_json
from ckptctl.io import lockfile
from ckptctl.io.process import alive, process_start

__all__ = [
    "LOCK_NAME",
    "MIN_STALE_AFTER",
    "MISSED_REFRESHES",
    "STALE_AFTER",
    "LockInfo",
    "LockUnusable",
    "RunLock",
    "RunLocked",
    "read_lock",
    "stale_reason",
]

LOCK_NAME = ".ckptctl-prune.lock"
#: A lock whose holder has not refreshed it for this long is stale, whatever its pid.
STALE_AFTER = timedelta(hours=1)
#: A lock whose holder refreshes it on a timer (`LockInfo.refresh_every`) is stale once this many refreshes
#: are missed: a trainer killed while its mirror held a DST lock then blocks other hosts' syncs for minutes,
#: not for `STALE_AFTER`.
MISSED_REFRESHES = 10
#: ...but never sooner than this: the lock's mtime is the store's clock and `now` the reader's, and hosts'
#: clocks may differ by a few minutes.
MIN_STALE_AFTER = timedelta(minutes=5)
#: A lock file is a few hundred bytes; what is read of one.
_MAX_LOCK_BYTES = 64 * 1024
#: pids are at most 2**22 on Linux; a larger one in a lock file is not a process id.
_MAX_PID = 2**31 - 1


class RunLocked(CkptctlError):
    """Another process holds the run's lock (exit code 1: the command could not do its work now)."""

    exit_code = 1


class LockUnusable(StorageError):
    """The lock file cannot be created or read: a read-only or full file system, a folder we may not
    write, or something other than a file in its place (exit code 2)."""


@dataclass(frozen=True, slots=True)
class LockInfo:
    """Who holds a lock.

    Attributes:
        host: the holder's host name.
        pid: the holder's process id on that host.
        token: random, unique to one acquisition.
        started: when it was taken (ISO 8601).
        pid_start: the holder's process start time (Linux), which tells a reused pid from the holder.
        command: what the holder is doing, for people reading the lock.
        refresh_every: seconds between the holder's refreshes where a timer refreshes it whatever the work
            does (the manager's mirror), else None; see `MISSED_REFRESHES`.
    """

    host: str
    pid: int
    token: str
    started: str
    pid_start: str | None = None
    command: str = ""
    refresh_every: float | None = None

    def describe(self) -> str:
        what = f" ({self.command})" if self.command else ""
        return f"pid {self.pid} on {self.host} since {self.started}{what}"

    @classmethod
    def parse(cls, data: bytes) -> LockInfo | None:
        """The lock's content, or None when it is not a lock this module wrote (or is half-written)."""
        try:
            doc = parse_json(data, "lock")
            pid = as_whole(doc["pid"], maximum=_MAX_PID)
            if pid is None:
                return None
            return cls(
                host=str(doc["host"]),
                pid=pid,
                token=str(doc["token"]),
                started=str(doc["started"]),
                pid_start=None if doc.get("pid_start") is None else str(doc["pid_start"]),
                command=str(doc.get("command", "")),
                refresh_every=_positive_seconds(doc.get("refresh_every")),
            )
        except (CorruptCheckpoint, KeyError, TypeError):
            return None


def _positive_seconds(value: object) -> float | None:
    """A refresh interval read from a lock: a positive, finite number of seconds, else None (no promise)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0 < value < STALE_AFTER.total_seconds() else None


def read_lock(url: str) -> tuple[LockInfo | None, float] | None:
    """The lock at `url` and its mtime (POSIX seconds), or None when there is none.

    The info is None for a file that is not (yet) a readable lock of ours: a lock being written, or
    another tool's lock file.

    Raises:
        LockUnusable: the path is not a regular file (a FIFO, a device): it can be no lock, and reading it
            could block forever.
        StorageError: the object store holding it could not be reached.
    """
    try:
        found = lockfile.read(url, _MAX_LOCK_BYTES)
    except CorruptCheckpoint as exc:  # what io says of a file that is not a regular one
        raise LockUnusable(exc.message, f"remove {url} if no prune of the run is running") from exc
    if found is None:
        return None
    data, mtime = found
    return LockInfo.parse(data), mtime


def stale_reason(
    info: LockInfo | None, mtime: float, *, now: float | None = None, stale_after: timedelta = STALE_AFTER
) -> str | None:
    """Why a lock is stale, or None when its holder may still be alive."""
    now = time.time() if now is None else now
    if info is not None and info.host == socket.gethostname() and not alive(info.pid, info.pid_start):
        return f"its process {info.pid} on {info.host} is gone"
    idle = now - mtime
    limit = stale_after.total_seconds()
    if info is not None and info.refresh_every is not None:
        limit = min(limit, max(MISSED_REFRESHES * info.refresh_every, MIN_STALE_AFTER.total_seconds()))
    if idle > limit:
        return f"nobody has refreshed it for {timedelta(seconds=round(idle))}"
    return None


class RunLock:
    """An exclusive lock on a run folder, as a context manager.

    Args:
        folder: the run folder (local path or fsspec URL); the lock file is created inside it.
        name: the lock file's name.
        wait: seconds to wait for a live lock to be released before giving up with `RunLocked`.
        stale_after: see `STALE_AFTER`.
        command: what the holder does, written into the lock for people who find it.
        warn: where the takeover of a stale lock is reported (default: `warnings.warn`).
        refresh_every: the seconds between refreshes the holder promises (a timer of its own), written into
            the lock so that others take it over after `MISSED_REFRESHES` of them; None promises nothing.
    """

    def __init__(
        self,
        folder: str,
        *,
        name: str = LOCK_NAME,
        wait: float = 0.0,
        stale_after: timedelta = STALE_AFTER,
        command: str = "",
        warn: Callable[[str], None] | None = None,
        refresh_every: float | None = None,
    ) -> None:
        self.url = io.join(folder, name)
        self.wait = wait
        self.stale_after = stale_after
        self.info = LockInfo(
            host=socket.gethostname(),
            pid=os.getpid(),
            token=secrets.token_hex(8),
            started=datetime.now(UTC).isoformat(timespec="seconds"),
            pid_start=process_start(os.getpid()),
            command=command,
            refresh_every=refresh_every,
        )
        self._warn = warn or (lambda message: warnings.warn(message, RuntimeWarning, stacklevel=3))
        self._held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock, waiting up to `wait` seconds for a live holder; take over a stale one.

        Raises:
            RunLocked: a live holder kept it for longer than `wait`.
        """
        deadline = time.monotonic() + self.wait
        delay = 0.05
        kept: tuple[LockInfo | None, float] | None = None  # a stale lock that was not taken away
        while True:
            if self._create():
                self._held = True
                return
            found = read_lock(self.url)
            if found is None:
                if not io.exists(self.url):
                    continue  # released between our attempt and our look: try again
                if time.monotonic() >= deadline:
                    raise RunLocked(f"{self.url} exists but cannot be read", "check its permissions")
                time.sleep(delay)
                continue
            holder, mtime = found
            why = stale_reason(holder, mtime, stale_after=self.stale_after)
            if why is not None:
                if self._break(holder, mtime):
                    who = holder.describe() if holder else "an unreadable lock"
                    self._warn(f"took over a stale lock of {self.url} held by {who}: {why}")
                    continue
                if kept != (holder, mtime):  # most likely another process took it first: look again at once
                    kept = (holder, mtime)
                    continue
                # The same stale lock stayed twice: the storage will not remove it (credentials that may not
                # delete, a store refusing the conditional DELETE). Waited for as a live one, not asked again
                # and again at once for ever.
                who = holder.describe() if holder else "an unreadable lock"
                held = RunLocked(
                    f"{self.url} is stale ({why}, held by {who}) but could not be removed",
                    f"check that the credentials may delete {self.url}, or remove it by hand",
                )
            else:
                who = holder.describe() if holder else "another process"
                held = RunLocked(
                    f"{io.parent_of(self.url)} is locked by {who}",
                    f"wait for it to finish (or pass a longer wait); a dead holder's lock is taken over automatically, and {self.url} can be removed by hand if it is left from another host",
                )
            if time.monotonic() >= deadline:
                raise held
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def check(self) -> None:
        """Make sure the lock is still ours (it may have been taken over when we looked dead).

        Raises:
            RunLocked: another process holds it now.
        """
        found = read_lock(self.url)
        holder = found[0] if found else None
        if holder is None or holder.token != self.info.token:
            self._held = False
            who = holder.describe() if holder else "nobody"
            raise RunLocked(f"lost the lock of {io.parent_of(self.url)} (now held by {who})", "run the command again")

    def refresh(self) -> None:
        """Check that the lock is ours and mark it alive (its mtime), so that nobody takes it over."""
        self.check()
        lockfile.touch(self.url, self._payload())

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        if not self._held:
            return
        self._held = False
        try:
            found = read_lock(self.url)
        except CkptctlError:  # the store is unreachable, or something replaced our lock: nothing to remove
            return
        if found is None or found[0] is None or found[0].token != self.info.token:
            return
        with contextlib.suppress(CkptctlError, OSError):
            io.delete_file(self.url)

    def _payload(self) -> bytes:
        return json.dumps(asdict(self.info), indent=1).encode()

    def _create(self) -> bool:
        """Create the lock file if there is none; True when it is ours."""
        try:
            if lockfile.create(self.url, self._payload()):
                return True
        except OSError as exc:
            raise self._unusable(exc) from exc
        if io.is_link(self.url):
            read_lock(self.url)  # a link to a FIFO or a device is refused as what it names is
            # Whoever planted it could have a takeover rename or remove what it names: touch nothing.
            path = io.local_path(self.url)
            raise LockUnusable(
                f"the lock file {self.url} is a symbolic link (to {os.readlink(path)}): refusing to use it; nothing was changed",
                f"remove the link (rm {shlex.quote(path)}) after checking who put it there",
            )
        return False

    def _unusable(self, exc: OSError) -> LockUnusable:
        """A clear error for an OS error while creating the lock file."""
        why = {
            errno.EROFS: (
                "the file system is read-only",
                "prune deletes nothing on a read-only mount; remount it read-write",
            ),
            errno.EACCES: ("permission denied", "run as a user who may write to the run folder"),
            errno.EPERM: ("permission denied", "run as a user who may write to the run folder"),
            errno.ENOSPC: (
                "no space left on the device",
                "free a little space by other means (the lock needs a few hundred bytes), then prune again",
            ),
        }.get(exc.errno or 0, (exc.strerror or str(exc), "check the run folder"))
        return LockUnusable(f"cannot create the lock file {self.url}: {why[0]}", why[1])

    def _break(self, stale: LockInfo | None, mtime: float) -> bool:
        """Remove the stale lock we judged, and only that one; True when it is gone."""

        def same(aside: str) -> bool:
            moved = read_lock(aside)
            return moved is not None and (
                moved[0].token == stale.token if (moved[0] is not None and stale is not None) else moved[1] == mtime
            )

        return lockfile.take_away(self.url, same)
