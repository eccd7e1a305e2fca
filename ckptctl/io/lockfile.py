"""What a lock file needs of the storage that holds it: create it if absent, read it with its age, keep it
alive, and take a stale one away. `core.lock.RunLock` builds the run's lock on these; what a lock says and
when one is stale is its business, how each storage does the four is this module's.

Locally a lock is written whole and then hard-linked into place (a link never replaces what is there, so
two processes cannot both create it, and a symlink at its name is never followed), kept alive by its mtime,
and taken away by a rename aside, so that of two processes breaking the same stale lock only the one that
moved it wins. An object store has no rename: the lock is written on condition that no object has its name
where the store has such a PUT (S3's `If-None-Match: *`), and read back (elsewhere best effort: two
processes starting within the same instant can both believe they hold it), kept alive by writing it again,
and taken away by deleting it if it is still the one judged stale.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import time
from collections.abc import Callable

from ckptctl import io
from ckptctl.errors import CheckpointNotFound, CkptctlError, CorruptCheckpoint, StorageError

__all__ = ["create", "read", "take_away", "touch"]


def read(url: str, cap: int) -> tuple[bytes, float] | None:
    """The first `cap` bytes of the lock file at `url` and its mtime (POSIX seconds); None when there is
    none, or locally when it cannot be read.

    Raises:
        CorruptCheckpoint: it is not a regular file (a FIFO, a device): reading it could block forever.
        StorageError: the object store holding it could not be reached (which says nothing about whether
            there is a lock).
    """
    try:
        return io.read_stamped(url, cap)  # on an object store one GET, whose answer carries the time
    except CorruptCheckpoint:
        raise
    except StorageError:
        if not io.is_local(url):
            raise
        return None
    except (CkptctlError, OSError):
        return None


def create(url: str, data: bytes) -> bool:
    """Create the lock file `url` holding `data` if there is none; True when it is this caller's.

    Locally `False` also when a link is in its place (never followed: ask `io.is_link`); a lock file whose
    write failed is removed, so that an empty one holds nobody off.

    Raises:
        OSError: the local file cannot be created or written (read-only or full file system, permissions).
        CkptctlError: the object store failed.
    """
    if not io.is_local(url):
        if _file_there(url):
            return False
        # A conditional PUT where the store has one (S3 since 2024): of two writers in the same instant one is
        # refused. The look before it and the read back after it stay, for stores that ignore the condition.
        made = io.create_new(url, data)
        if made is False:
            return False
        if made is None:
            io.write_bytes_atomic(url, data)
        found = read(url, len(data) + 1)
        return found is not None and found[0] == data
    path = io.local_path(url)
    # Written whole first, then linked into place (a link never replaces what is there): a process killed
    # between creating the lock and writing it would leave an empty lock, naming no holder, that holds
    # everyone off until it is stale (an hour). Where the file system can, the file is written unnamed
    # (O_TMPFILE), so that a kill leaves nothing; elsewhere under a temporary name, which a kill can leave
    # behind and a later `create` sweeps away.
    linked = _link_unnamed(path, data)
    if linked is not None:
        return linked
    _sweep_leftovers(path)
    tmp = f"{path}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    _write_new(tmp, data)
    try:
        os.link(tmp, path)
    except (FileExistsError, FileNotFoundError):  # taken; or our temporary file was swept as a leftover
        return False
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        return _create_in_place(path, data)  # a file system without hard links
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return True


def _link_unnamed(path: str, data: bytes) -> bool | None:
    """`create` through an unnamed file (O_TMPFILE) linked into place: whether the lock is ours, or None
    where this file system (or the platform) cannot make one or link it."""
    flag = getattr(os, "O_TMPFILE", 0)
    if not flag or not os.path.isdir("/proc/self/fd"):
        return None
    try:  # O_PATH: a folder one may write and search but not list still takes the lock
        folder = os.open(os.path.dirname(path) or ".", getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY)
    except OSError:
        return None  # the named way says what is wrong with the folder
    try:
        try:
            unnamed = os.open(".", flag | os.O_WRONLY, 0o644, dir_fd=folder)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT, errno.ENOTSUP):
                return None  # no unnamed files here
            raise
        try:
            os.write(unnamed, data)
            os.fsync(unnamed)
            # linkat(AT_SYMLINK_FOLLOW) through /proc's link to the open file; a plain link(2), which os.link
            # makes without a dir_fd, would link the /proc link itself (EXDEV). The target is never followed.
            os.link(f"/proc/self/fd/{unnamed}", os.path.basename(path), dst_dir_fd=folder, follow_symlinks=True)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in _NO_LINKS and exc.errno != errno.ENOENT:
                raise
            return None  # no hard links here (or no /proc): the named way decides
        finally:
            os.close(unnamed)
    finally:
        os.close(folder)
    return True


#: Between a lock's name and the pid and random tag of its temporary file.
_TMP_MARK = ".tmp-"
#: A temporary lock file lives for the moment between its write and its link; one older than this was left by
#: a killed process (the margin covers clocks of hosts sharing a network file system).
_LEFTOVER_AFTER_S = 600.0


def _sweep_leftovers(path: str) -> None:
    """Remove temporary files of the lock `path` that killed processes left (best effort)."""
    folder, prefix = os.path.split(path)
    prefix += _TMP_MARK
    with contextlib.suppress(OSError), os.scandir(folder or ".") as entries:
        for entry in entries:
            if not entry.name.startswith(prefix):
                continue
            with contextlib.suppress(OSError):
                if time.time() - entry.stat(follow_symlinks=False).st_mtime > _LEFTOVER_AFTER_S:
                    os.unlink(entry.path)


#: What `link` says on file systems that have no hard links (some FUSE and SMB mounts, exFAT).
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOSYS}


def _write_new(path: str, data: bytes) -> None:
    """A new file at `path` holding `data`, fsynced; removed again when the write fails."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def _create_in_place(path: str, data: bytes) -> bool:
    """`create` where links cannot be made: the lock created and then written (a kill in between leaves an
    empty lock, stale only by its age)."""
    try:
        _write_new(path, data)
    except FileExistsError:
        return False
    return True


def _file_there(url: str) -> bool:
    """Whether an object store holds a file at `url`: one HEAD (what only lists below that name, a "folder",
    is no lock file, and a missing bucket is for the write that follows to report)."""
    try:
        io.file_size(url)
    except CheckpointNotFound:
        return False
    return True


def touch(url: str, data: bytes) -> None:
    """Mark the lock file alive: its mtime locally (a failure is ignored: the next touch tries again), a new
    write of `data` on an object store (whose objects cannot be touched)."""
    if io.is_local(url):
        with contextlib.suppress(OSError):
            os.utime(io.local_path(url))
    else:
        io.write_bytes_atomic(url, data)


def take_away(url: str, same: Callable[[str], bool]) -> bool:
    """Remove the stale lock file at `url`, and only the one judged stale; True when it is gone.

    Locally it is renamed aside first and `same(aside)` asked whether what moved is the lock that was
    judged; if not (another process took the lock meanwhile) it is linked back. On an object store
    `same(url)` is asked first, and the lock deleted only if it is the one judged and unchanged since
    (`io.delete_if_unchanged`: a conditional DELETE where the store has one): of two processes that judged
    the same stale lock, the second must not delete the lock the first has taken since.
    """
    if not io.is_local(url):
        try:
            return io.delete_if_unchanged(url, lambda: same(url))
        except CkptctlError:
            return False
    path = io.local_path(url)
    aside = f"{path}.stale-{secrets.token_hex(4)}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # somebody else took it away first
        return False
    moved = same(aside)
    if not moved:
        # We moved a lock taken meanwhile by someone else: give it back. If a third process has created one
        # since, its holder and the one we moved both find out at their next check.
        with contextlib.suppress(OSError):
            os.link(aside, path)
    with contextlib.suppress(OSError):
        os.unlink(aside)
    return moved
