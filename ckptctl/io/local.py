"""Local paths: the fast path, straight os calls (and `mmap` in the format readers).

Also what only a local filesystem can do and the commit protocol relies on: fsync of a folder, and an
atomic exchange of two paths (Linux `renameat2`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import mmap
import os
import shutil
import stat
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.io.backend import Backend
from ckptctl.io.counting import count_read
from ckptctl.io.failures import check_size
from ckptctl.io.paths import DirEntry, local_path

__all__ = [
    "LOCAL",
    "LocalBackend",
    "exchange",
    "fsync_dir",
    "maps_safely",
    "read_at_most",
    "refuse_to_replace_precious",
    "start_writeback",
]


class LocalBackend(Backend):
    """Local paths and `file://` URLs, through os calls."""

    def list_dir(self, url: str) -> list[DirEntry]:
        entries = []
        with os.scandir(local_path(url)) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=True)
                except FileNotFoundError:  # a dangling symlink or a file deleted meanwhile
                    continue
                entries.append(DirEntry(e.name, e.is_dir(), 0 if e.is_dir() else st.st_size, st.st_mtime))
        return sorted(entries, key=lambda d: d.name)

    def list_tree(self, url: str) -> dict[str, DirEntry]:
        base = local_path(url)
        files: dict[str, DirEntry] = {}
        for root, _dirs, names in os.walk(base):
            for n in names:
                full = os.path.join(root, n)
                try:
                    st = os.stat(full)
                except FileNotFoundError:
                    continue
                rel = os.path.relpath(full, base).replace(os.sep, "/")
                files[rel] = DirEntry(n, False, st.st_size, st.st_mtime)
        return files

    def exists(self, url: str) -> bool:
        return os.path.exists(local_path(url))

    def is_dir(self, url: str) -> bool:
        return os.path.isdir(local_path(url))

    def file_size(self, url: str) -> int:
        return os.stat(local_path(url)).st_size

    def read(self, url: str, start: int, length: int | None, cap: int | None) -> bytes:
        want = length if length is not None else (None if cap is None else cap + 1)  # one byte over: too large
        with _open_regular(url) as f:
            present = os.fstat(f.fileno()).st_size - start
            if cap is not None:
                check_size(url, present, cap)
            if start:
                f.seek(start)
            data = f.read() if want is None else read_at_most(f, want, present)
        count_read(len(data))
        return data

    def read_stamped(self, url: str, length: int) -> tuple[bytes, float]:
        data = self.read(url, 0, length, None)
        return data, os.stat(local_path(url)).st_mtime

    def open_read(self, url: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return _open_regular(url)

    def write_atomic(self, url: str, data: bytes) -> None:
        """A temporary file in the same folder, fsync, rename, fsync the folder."""
        path = local_path(url)
        folder = os.path.dirname(os.path.abspath(path))
        tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}-{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(folder)

    def upload(self, path: str, url: str) -> None:
        dest = local_path(url)
        os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
        shutil.copyfile(path, dest)

    def delete_file(self, url: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(local_path(url))

    def delete_tree(self, url: str) -> None:
        path = local_path(url)
        if os.path.islink(path):
            os.unlink(path)
            return

        def gone_is_fine(function: Any, target: str, excinfo: Any) -> None:
            # Another process (a concurrent prune, the manager's retention) may delete the same files.
            if not isinstance(excinfo[1], FileNotFoundError):
                raise excinfo[1]

        if os.path.lexists(path):
            shutil.rmtree(path, onerror=gone_is_fine)


#: The one local backend.
LOCAL = LocalBackend()


#: What `stat` calls the kinds of file ckptctl refuses to read.
_FILE_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def tree_usage(path: str) -> tuple[int, float | None]:
    """Bytes of the regular files below `path` and the newest mtime of anything there (folders too: a
    deletion inside one is a change); links below it are not followed. A regular file is its own size and
    mtime; any other file (a link to one, a FIFO) counts no bytes; nothing there counts nothing."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0, None
    if stat.S_ISREG(st.st_mode):
        return st.st_size, st.st_mtime
    if not stat.S_ISDIR(st.st_mode) and not os.path.isdir(path):
        return 0, st.st_mtime
    size, newest = 0, None
    for root, _dirs, files in os.walk(path):
        for name in (root, *(os.path.join(root, n) for n in files)):
            try:
                st = os.lstat(name)
            except FileNotFoundError:
                continue
            newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
    return size, newest


def _require_regular(url: str, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", local_path(url))
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "a special file")
    raise CorruptCheckpoint(
        f"{url} is {kind}, not a regular file: ckptctl reads only regular files",
        "replace it with the real file (reading it could block forever or never end)",
    )


@contextlib.contextmanager
def _open_regular(url: str) -> Iterator[IO[bytes]]:
    """Open a local file for reading, refusing anything but a regular file (symbolic links are followed).

    Checked with `stat` before opening (opening some devices has effects), and again on the open file: it is
    opened with O_NONBLOCK, so that a FIFO swapped in between the two does not block the open, and then
    refused by the second check. O_NONBLOCK does nothing to reads of regular files.
    """
    path = local_path(url)
    _require_regular(url, os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _require_regular(url, os.fstat(fd).st_mode)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


#: What each read after the first asks for in `read_at_most`.
_PIECE = 1 << 20


def read_at_most(f: IO[bytes], limit: int, present: int) -> bytes:
    """Up to `limit` bytes of `f` from where it stands, allocating about what is there rather than `limit`.

    `f.read(n)` allocates n bytes before it reads (CPython's buffered reader), so that a read bounded by a
    1 GiB cap took 1 GiB of address space for a 100-byte file: a MemoryError under `ulimit -v` (issue 33).
    The first read asks for what the file's size says is there (`present`: a bound the caller trusts, from
    `fstat`); the rest, if any (a file that grew since, or one whose size says nothing, as procfs files), comes
    in pieces of `_PIECE` until `limit` or the end.
    """
    first = f.read(min(limit, max(present, 0)))
    pieces = [first]
    got = len(first)
    while got < limit:
        piece = f.read(min(_PIECE, limit - got))
        if not piece:
            break
        pieces.append(piece)
        got += len(piece)
    return first if len(pieces) == 1 else b"".join(pieces)


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in a local folder durable (no-op where the OS cannot)."""
    try:
        fd = os.open(local_path(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def refuse_to_replace_precious(path: str, what: str) -> None:
    """Refuse a `--force` that would replace the root, the home folder, or the working folder or a parent.

    Args:
        path: local folder about to be replaced.
        what: the command's phrase for the hint ("choose a new folder for the demo").

    Raises:
        CkptctlError: `path` is one of those folders, whatever it holds.
    """
    real = os.path.realpath(local_path(path))
    cwd = os.path.realpath(os.getcwd())
    guarded = {os.path.realpath(os.sep), os.path.realpath(os.path.expanduser("~"))}
    if real in guarded or os.path.commonpath([real, cwd]) == real:
        raise CkptctlError(
            f"refusing to replace {path}: it is the root, home or working folder or one of its parents", what
        )


def _linux_libc(name: str, argtypes: list[Any]) -> Any:
    """A function of the C library returning an int, or None off Linux or where the library lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _renameat2() -> Any:
    import ctypes  # where a C function is called, not at every command's start (DESIGN §5)

    return _linux_libc("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])


@functools.cache
def _sync_file_range() -> Any:
    import ctypes

    return _linux_libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing bytes `offset:offset + length` of a file to the disk, without
    waiting (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`; no-op elsewhere or where it fails).

    A hint, not a durability step: the fsync that follows still makes the file durable, but finds most of
    its pages written already, so a large file's disk writes overlap the CPU work of writing the rest
    (hashing, copying) instead of all waiting for the final fsync.
    """
    fn = _sync_file_range()
    if fn is not None and length > 0:
        fn(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; an error only means no head start


#: `statfs` `f_type`s of file systems whose pages come from this machine's own disks or memory
#: (`linux/magic.h`; ZFS's from OpenZFS, which is not in the kernel's header): ext2/3/4, XFS, Btrfs, F2FS,
#: ZFS, tmpfs, ramfs.
_LOCAL_FS_TYPES = frozenset({0xEF53, 0x58465342, 0x9123683E, 0xF2F52010, 0x2FC12FC1, 0x01021994, 0x858458F6})


@functools.cache
def _fstatfs() -> Any:
    import ctypes

    return _linux_libc("fstatfs", [ctypes.c_int, ctypes.c_void_p])


def fs_type(fd: int) -> int | None:
    """The `statfs` `f_type` (magic number) of the file system holding the open file `fd`; None off Linux or
    where it cannot be told."""
    fn = _fstatfs()
    if fn is None:
        return None
    import ctypes

    # `struct statfs` starts with `f_type`, a C long on the 64-bit ABIs and i386 (an int on s390x, whose
    # misread value then matches no local type: read, the safe side). 256 bytes hold the whole struct (120).
    buf = ctypes.create_string_buffer(256)
    if fn(fd, buf) != 0:
        return None
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def maps_safely(fd: int) -> bool:
    """Whether the open file `fd` may be memory-mapped and its pages read without risk of a SIGBUS from the
    storage: True only on Linux file systems known to be local (`_LOCAL_FS_TYPES`).

    A page that cannot be brought in under a map (a server that went away, an expired lease or credential,
    a FUSE daemon that died, an RDMA timeout) is a SIGBUS, which kills the process with no message where a
    read raises an error ckptctl reports: so NFS, Lustre, GPFS, CIFS/SMB, CephFS, FUSE and anything not known
    are read. So is overlayfs: its `f_type` names neither its layers nor the file system a page comes from,
    which may be a network one. On a local disk a map still dies of an unreadable sector or of the file cut
    short by another process while mapped; both are taken as the price of the copies a map saves.
    """
    # Readers ask once a block (diff maps each block of each file on its own): an answer is kept a few seconds
    # for the file's device. Not longer: the anonymous device number of a tmpfs or btrfs unmounted meanwhile
    # may be given to an NFS or FUSE mount.
    device, now = os.fstat(fd).st_dev, time.monotonic()
    known = _MAPS_SAFELY.get(device)
    if known is None or now - known[1] > _MAPS_SAFELY_FOR_S:
        known = _MAPS_SAFELY[device] = (fs_type(fd) in _LOCAL_FS_TYPES, now)
    return known[0]


#: `maps_safely`'s answers by the file's device (`st_dev`), with when each was found.
_MAPS_SAFELY: dict[int, tuple[bool, float]] = {}
_MAPS_SAFELY_FOR_S = 5.0


def map_block(fd: int, offset: int, length: int, *, populate: bool) -> memoryview | None:
    """`length` bytes at `offset` of the open local file `fd` (all within its size), mapped read-only; None
    where the file will not map or is shorter now: the caller reads the block instead. Only where
    `maps_safely(fd)`.

    `populate` brings the pages in first (Linux 5.14's MADV_POPULATE_READ): a page the disk cannot read, or
    one cut off by a truncation meanwhile, then makes this None (and the caller's read says what is wrong)
    rather than a SIGBUS under a later read, which kills the command with no message; None too where the
    kernel cannot populate. It costs 5-12% of a call on cached files: verify's sweep pays it, being where a
    damaged disk must be reported rather than die; diff and the writer do without it.
    """
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        mapped = mmap.mmap(fd, offset + length - start, access=mmap.ACCESS_READ, offset=start)
    except (OSError, ValueError):  # ValueError: the file is shorter than the range now
        return None
    if populate:
        try:
            mapped.madvise(MADV_POPULATE_READ)
        except OSError:
            mapped.close()
            return None
    return memoryview(mapped)[offset - start :]  # the map lives as long as a view of it


#: madvise(2)'s MADV_POPULATE_READ (Linux 5.14; Python 3.11's mmap has no name for it).
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def exchange(a: str, b: str) -> bool:
    """Atomically swap two local paths (Linux `renameat2(RENAME_EXCHANGE)`).

    Returns False where the OS or filesystem cannot (then the caller falls back to two renames); raises
    OSError for real failures.
    """
    fn = _renameat2()
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(local_path(a)), at_fdcwd, os.fsencode(local_path(b)), rename_exchange) == 0:
        return True
    import ctypes

    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), a)
