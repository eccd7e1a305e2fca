"""All file access of ckptctl: local paths on a fast path (os calls, mmap), anything else through fsspec.

Paths are strings: a local path, `file://...`, or any fsspec URL (`s3://bucket/run`, `memory://x`).
Every read is counted in `READ_STATS` so that commands can report how many bytes they touched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from ckptctl.errors import CheckpointNotFound, StorageError

__all__ = [
    "READ_STATS",
    "DirEntry",
    "delete_file",
    "delete_tree",
    "exists",
    "file_size",
    "fsync_dir",
    "is_dir",
    "is_local",
    "join",
    "list_dir",
    "local_path",
    "name_of",
    "open_read",
    "parent_of",
    "read_bytes",
    "read_text",
    "relative_to",
    "write_bytes_atomic",
]


class ReadStats:
    """Counts bytes read through this module (thread-safe); commands report it in their JSON."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0

    def add(self, n: int) -> None:
        with self._lock:
            self._bytes += n

    @property
    def bytes_read(self) -> int:
        return self._bytes

    def reset(self) -> None:
        with self._lock:
            self._bytes = 0


READ_STATS = ReadStats()


@dataclass(frozen=True, slots=True)
class DirEntry:
    """One entry of a directory listing: enough for layouts to detect and size checkpoints."""

    name: str
    is_dir: bool
    size: int
    mtime: float


def is_local(url: str) -> bool:
    """True for plain paths and `file://` URLs."""
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    """The OS path of a local URL (strips `file://`)."""
    return url[len("file://") :] if url.startswith("file://") else url


def join(url: str, *parts: str) -> str:
    """Join path parts with `/`, keeping the URL scheme."""
    if is_local(url):
        return os.path.join(url, *parts)
    return posixpath.join(url, *parts)


def name_of(url: str) -> str:
    """The last path component (`step-10` of `s3://b/run/step-10/`)."""
    return posixpath.basename(url.rstrip("/")) if not is_local(url) else os.path.basename(os.path.normpath(url))


def parent_of(url: str) -> str:
    """The containing folder."""
    if is_local(url):
        return os.path.dirname(os.path.normpath(local_path(url)))
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{posixpath.dirname(rest.rstrip('/'))}"


def relative_to(url: str, root: str) -> str:
    """`url` relative to `root`, with `/` separators."""
    if is_local(url):
        return os.path.relpath(local_path(url), local_path(root)).replace(os.sep, "/")
    return posixpath.relpath(url.partition("://")[2], root.partition("://")[2])


def _fs(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError as exc:  # pragma: no cover - fsspec is a dependency
        raise StorageError("fsspec is not installed", "pip install fsspec") from exc
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise StorageError(
            f"no filesystem driver for {url.split('://', maxsplit=1)[0]}://",
            "install the extra, e.g. pip install 'ckptctl[s3]'",
        ) from exc
    return fs, path


@contextlib.contextmanager
def _translate_errors(url: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError as exc:
        raise CheckpointNotFound(f"no such file or folder: {url}") from exc
    except PermissionError as exc:
        raise StorageError(f"permission denied: {url}", "check the file permissions or credentials") from exc
    except IsADirectoryError as exc:
        raise StorageError(f"expected a file but found a folder: {url}") from exc
    except NotADirectoryError as exc:
        raise CheckpointNotFound(f"not a folder: {url}") from exc
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StorageError(f"no space left on device while writing {url}", "free some space") from exc
        raise StorageError(f"cannot access {url}: {exc.strerror or exc}") from exc


def list_dir(url: str) -> list[DirEntry]:
    """Entries of a folder, sorted by name; raises `CheckpointNotFound` when it does not exist."""
    with _translate_errors(url):
        if is_local(url):
            entries = []
            with os.scandir(local_path(url)) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=True)
                    except FileNotFoundError:  # a dangling symlink or a file deleted meanwhile
                        continue
                    entries.append(DirEntry(e.name, e.is_dir(), 0 if e.is_dir() else st.st_size, st.st_mtime))
            return sorted(entries, key=lambda d: d.name)
        fs, path = _fs(url)
        out = []
        for info in fs.ls(path, detail=True):
            name = posixpath.basename(info["name"].rstrip("/"))
            mtime = info.get("mtime") or info.get("LastModified") or info.get("created") or 0.0
            if hasattr(mtime, "timestamp"):
                mtime = mtime.timestamp()
            out.append(DirEntry(name, info["type"] == "directory", int(info.get("size") or 0), float(mtime)))
        return sorted(out, key=lambda d: d.name)


def exists(url: str) -> bool:
    if is_local(url):
        return os.path.exists(local_path(url))
    fs, path = _fs(url)
    return bool(fs.exists(path))


def is_dir(url: str) -> bool:
    if is_local(url):
        return os.path.isdir(local_path(url))
    fs, path = _fs(url)
    return bool(fs.isdir(path))


def file_size(url: str) -> int:
    with _translate_errors(url):
        if is_local(url):
            return os.stat(local_path(url)).st_size
        fs, path = _fs(url)
        return int(fs.size(path))


def read_bytes(url: str, start: int = 0, length: int | None = None) -> bytes:
    """Read `length` bytes from `start` (to the end when None); a range read on object stores."""
    with _translate_errors(url):
        if is_local(url):
            with open(local_path(url), "rb") as f:
                if start:
                    f.seek(start)
                data = f.read() if length is None else f.read(length)
        else:
            fs, path = _fs(url)
            end = None if length is None else start + length
            data = fs.cat_file(path, start=start, end=end)
    READ_STATS.add(len(data))
    return data


def read_text(url: str) -> str:
    data = read_bytes(url)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        from ckptctl.errors import CorruptCheckpoint

        raise CorruptCheckpoint(f"{url} is not UTF-8 text") from exc


@contextlib.contextmanager
def open_read(url: str) -> Iterator[IO[bytes]]:
    """A binary file object for sequential reads (bytes are counted by the caller via `READ_STATS`)."""
    with _translate_errors(url):
        if is_local(url):
            with open(local_path(url), "rb") as f:
                yield f
        else:
            fs, path = _fs(url)
            with fs.open(path, "rb") as f:
                yield f


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


def write_bytes_atomic(url: str, data: bytes) -> None:
    """Write a small file so that readers see either the old content or the new, never a mix.

    Locally: temporary file in the same folder, fsync, rename, fsync the folder. On object stores a
    single PUT is already atomic.
    """
    with _translate_errors(url):
        if is_local(url):
            path = local_path(url)
            folder = os.path.dirname(os.path.abspath(path))
            tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}-{threading.get_ident()}")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(folder)
            return
        fs, path = _fs(url)
        fs.pipe_file(path, data)


def delete_file(url: str) -> None:
    """Remove one file (a missing one is not an error)."""
    with _translate_errors(url):
        if is_local(url):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(local_path(url))
            return
        fs, path = _fs(url)
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)


def delete_tree(url: str) -> None:
    """Remove a folder and everything below it (a missing one is not an error). Symbolic links inside
    are removed as links; what they point to is never touched."""
    with _translate_errors(url):
        if is_local(url):
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
            return
        fs, path = _fs(url)
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path, recursive=True)
