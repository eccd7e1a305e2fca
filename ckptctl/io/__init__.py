"""All file access of ckptctl: local paths on a fast path (os calls, mmap), anything else through fsspec.

Paths are strings: a local path, `file://...`, or any fsspec URL (`s3://bucket/run`, `memory://x`).
Every read is counted (`counting`: a counter per operation) so that commands can report how many bytes
they touched.

The functions here are the one way in. Each picks the backend of its URL (`backend.Backend`, the protocol)
and turns what that storage raises into typed ckptctl errors with a hint (`failures`):

- `local`: local paths, straight os calls; also fsync of folders and an atomic exchange of two paths;
- `remote`: any fsspec URL (`s3://` through s3fs and botocore, so the standard AWS settings apply), each
  call retried with backoff on transient failures and bounded in time (`failures.RETRY`, which tests and
  embedding applications may replace);
- `s3`: `s3://` URLs that s3fs would reach with botocore's defaults: listings, small reads, uploads and
  deletes through botocore's own blocking client (threads stay parallel; a fraction of s3fs's import);
- `snapshot`: inside `listing_snapshot(url)`, the answers of one recursive listing of a remote folder.

Transfers of many files or ranges run on a bounded pool of `workers()` threads (`parallel`). The commit
protocol (`io.commit`) and the delete routine (`io.trash`) are built on these functions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import IO

from ckptctl.errors import CkptctlError, CorruptCheckpoint, StorageError
from ckptctl.io import local
from ckptctl.io.backend import Backend
from ckptctl.io.counting import READ_STATS, ByteCounter, ReadStats, count_read, count_read_elsewhere, counting
from ckptctl.io.failures import RetryPolicy, check_size, translate_errors
from ckptctl.io.local import LOCAL, exchange, map_block, maps_safely, refuse_to_replace_precious, start_writeback
from ckptctl.io.parallel import ContextThreadPool, in_background, parallel_map, stop_if_cancelled, workers
from ckptctl.io.paths import (
    DirEntry,
    absolute,
    inside,
    is_local,
    join,
    local_path,
    name_of,
    parent_of,
    relative_to,
)
from ckptctl.io.remote import FSSPEC
from ckptctl.io.s3 import S3, serves
from ckptctl.io.snapshot import covering, listing_snapshot

__all__ = [
    "MAX_MARKER_BYTES",
    "READ_STATS",
    "REMOTE_BLOCK",
    "ByteCounter",
    "ContextThreadPool",
    "DirEntry",
    "ReadStats",
    "RetryPolicy",
    "absolute",
    "count_read",
    "count_read_elsewhere",
    "counting",
    "create_new",
    "delete_file",
    "delete_files",
    "delete_if_unchanged",
    "delete_tree",
    "download_file",
    "exchange",
    "exists",
    "file_size",
    "fsync_dir",
    "in_background",
    "inside",
    "is_dir",
    "is_link",
    "is_local",
    "join",
    "lexists",
    "list_dir",
    "list_tree",
    "listing_snapshot",
    "local_path",
    "make_folder",
    "map_block",
    "maps_safely",
    "name_of",
    "open_read",
    "parallel_map",
    "parent_of",
    "read_bytes",
    "read_ranges",
    "read_stamped",
    "read_text",
    "refuse_to_replace_precious",
    "relative_to",
    "same_file",
    "start_writeback",
    "stop_if_cancelled",
    "tree_usage",
    "upload_file",
    "workers",
    "writable",
    "write_bytes_atomic",
]

#: Block size of streamed remote reads (downloads, digests): large enough to amortise a request.
REMOTE_BLOCK = 8 << 20
#: The largest marker or pointer file read (a `latest` naming a folder, a tracker holding a step number).
MAX_MARKER_BYTES = 64 << 10


def _backend(url: str) -> Backend:
    if is_local(url):
        return LOCAL
    return covering(url) or (S3 if serves(url) else FSSPEC)


# ------------------------------------------------------------------------------------ queries


def list_dir(url: str) -> list[DirEntry]:
    """Entries of a folder, sorted by name; raises `CheckpointNotFound` when it does not exist."""
    with translate_errors(url):
        return _backend(url).list_dir(url)


def list_tree(url: str) -> dict[str, DirEntry]:
    """Every file below a folder, keyed by its path relative to it (with `/`); empty when there is none.

    On object stores this is one paginated listing of the whole prefix rather than one per folder.
    """
    with translate_errors(url):
        return _backend(url).list_tree(url)


def exists(url: str) -> bool:
    with translate_errors(url):
        return _backend(url).exists(url)


def is_dir(url: str) -> bool:
    with translate_errors(url):
        return _backend(url).is_dir(url)


def is_link(url: str) -> bool:
    """Whether `url` is a symbolic link (on object stores nothing is: they have none)."""
    return is_local(url) and os.path.islink(local_path(url))


def lexists(url: str) -> bool:
    """Whether anything is at `url`, a link (even a dangling one) included."""
    return is_link(url) or exists(url)


def writable(url: str) -> bool:
    """Whether entries of the folder `url` may be created, renamed and removed by this process, as far as can
    be told without trying: locally its permission bits; on an object store only a write would tell, so yes."""
    return not is_local(url) or os.access(local_path(url), os.W_OK | os.X_OK)


def same_file(url_a: str, url_b: str) -> bool:
    """Whether two URLs name one file: locally also a hard link, a link or another spelling of it; on object
    stores only the same URL.

    Raises:
        CkptctlError: a local file cannot be looked at (gone, permissions).
    """
    if url_a == url_b:
        return True
    if not (is_local(url_a) and is_local(url_b)):
        return False
    with translate_errors(url_a):
        return os.path.samefile(local_path(url_a), local_path(url_b))


def file_size(url: str) -> int:
    with translate_errors(url):
        return _backend(url).file_size(url)


# ------------------------------------------------------------------------------------ reads


def read_bytes(url: str, start: int = 0, length: int | None = None, *, max_size: int | None = None) -> bytes:
    """Read `length` bytes from `start` (to the end when None); a range read on object stores.

    Only regular files are read: a FIFO, a device or a socket in a checkpoint would block or never end, so
    it is refused before a byte is read.

    Args:
        url: the file.
        start: the first byte to read.
        length: how many bytes, or None for the rest of the file.
        max_size: refuse a whole-file read (`length` None) of a file larger than this many bytes: metadata
            (markers, pointers, JSON documents) is small, and a huge or endless file in its place must not
            be loaded into memory.

    Raises:
        CorruptCheckpoint: not a regular file, or larger than `max_size`.
    """
    cap = None if length is not None else max_size
    with translate_errors(url):
        data = _backend(url).read(url, start, length, cap)
    if cap is not None:
        check_size(url, len(data), cap)  # a file that grew after it was sized, or a remote one
    return data


def read_stamped(url: str, length: int) -> tuple[bytes, float]:
    """The first `length` bytes of a regular file and its mtime (POSIX seconds), in one request where the
    storage answers both at once (an object store's GET): what a lock file's reader needs of it."""
    with translate_errors(url):
        return _backend(url).read_stamped(url, length)


def read_ranges(requests: Sequence[tuple[str, int, int]], max_workers: int | None = None) -> list[bytes]:
    """Read many `(url, start, length)` ranges, in parallel on object stores; results in request order."""
    return parallel_map(lambda r: read_bytes(r[0], r[1], r[2]), requests, max_workers)


def read_text(url: str, *, max_size: int | None = None) -> str:
    """A whole file as UTF-8 text (`max_size` as in `read_bytes`).

    Raises:
        CorruptCheckpoint: not UTF-8, not a regular file, or larger than `max_size`.
    """
    data = read_bytes(url, max_size=max_size)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpoint(f"{url} is not UTF-8 text") from exc


def tree_usage(url: str) -> tuple[int, float | None]:
    """Bytes of the files below `url` and the newest modification time there (a file: its own); links are
    not followed, and a folder that cannot be listed counts nothing (what a size or an "is it still being
    written" answer can do without)."""
    if is_local(url):
        return local.tree_usage(local_path(url))
    size, newest = 0, None
    with contextlib.suppress(CkptctlError):
        for entry in list_dir(url):
            part_size, part_newest = tree_usage(join(url, entry.name)) if entry.is_dir else (entry.size, entry.mtime)
            size += part_size
            if part_newest:
                newest = part_newest if newest is None else max(newest, part_newest)
    return size, newest


@contextlib.contextmanager
def open_read(url: str) -> Iterator[IO[bytes]]:
    """A binary file object for sequential reads (bytes are counted by the caller, with `count_read`).

    Remote files are opened without a read-ahead cache: every `read(n)` is one range request of `n`
    bytes, so that what the caller counts is what crossed the network.
    """
    with translate_errors(url), _backend(url).open_read(url) as f:
        yield f


def download_file(url: str, path: str, on_block: Callable[[bytes], object] | None = None, max_workers: int = 1) -> int:
    """Copy a file (remote or local) to the local `path` in blocks of `REMOTE_BLOCK`, with up to
    `max_workers` range reads in flight; blocks are written, and passed to `on_block` (a hasher's
    `update`), in order. Returns the size; bytes are counted (`counting`)."""
    total = file_size(url)
    window = max(1, max_workers)
    offset = 0
    with translate_errors(path), open(path, "wb") as out:
        while offset < total:
            ranges = [
                (url, start, min(REMOTE_BLOCK, total - start))
                for start in range(offset, min(total, offset + window * REMOTE_BLOCK), REMOTE_BLOCK)
            ]
            for (_, start, length), block in zip(ranges, read_ranges(ranges, window), strict=True):
                if len(block) != length:
                    raise StorageError(f"{url} changed while it was downloaded (byte {start} of {total})", "try again")
                out.write(block)
                if on_block is not None:
                    on_block(block)
            offset = ranges[-1][1] + ranges[-1][2]
    return total


# ------------------------------------------------------------------------------------ writes


def write_bytes_atomic(url: str, data: bytes) -> None:
    """Write a small file so that readers see either the old content or the new, never a mix.

    Locally: temporary file in the same folder, fsync, rename, fsync the folder. On object stores a
    single PUT is already atomic.
    """
    with translate_errors(url):
        _backend(url).write_atomic(url, data)


def create_new(url: str, data: bytes) -> bool | None:
    """Write the small file `url` only if none is there, in one step no other writer can split (an object
    store's conditional PUT): True when this call created it, False when a file was there, None where the
    storage has no such write."""
    with translate_errors(url):
        return _backend(url).create_new(url, data)


def delete_if_unchanged(url: str, judge: Callable[[], bool]) -> bool:
    """Delete the small file `url` if `judge()` (which reads it) says it is the one meant, and only that one
    where the storage can make sure (an object store's conditional DELETE): True when it was deleted."""
    with translate_errors(url):
        return _backend(url).delete_if_unchanged(url, judge)


def fsync_dir(url: str) -> None:
    """Make the renames and new entries of a local folder durable (a no-op where the OS cannot); nothing on
    an object store, where each PUT is durable once it returns and there are no folders."""
    if is_local(url):
        local.fsync_dir(url)


def make_folder(url: str) -> None:
    """Create a folder and its parents where missing; nothing on an object store, where a folder is only a
    prefix of the objects below it.

    Raises:
        StorageError: a local folder cannot be created.
    """
    if not is_local(url):
        return
    try:
        os.makedirs(local_path(url), exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create {url}: {exc.strerror or exc}") from exc


def upload_file(path: str, url: str) -> None:
    """Copy the local file `path` to `url` (an object store PUT, multipart for large files; a plain copy
    for a local destination). An object appears only once its upload has completed."""
    with translate_errors(url):
        _backend(url).upload(path, url)


def delete_file(url: str) -> None:
    """Remove one file (a missing one is not an error)."""
    with translate_errors(url):
        _backend(url).delete_file(url)


def delete_files(urls: Sequence[str]) -> None:
    """Remove many files (missing ones are not an error): batched deletes on object stores (S3 takes
    1,000 keys a request), one by one locally. Every URL must be on the same store as the first."""
    if len(urls) <= 1:
        for url in urls:
            delete_file(url)
        return
    with translate_errors(urls[0]):
        _backend(urls[0]).delete_files(urls)


def delete_tree(url: str) -> None:
    """Remove a folder and everything below it (a missing one is not an error). Symbolic links inside
    are removed as links; what they point to is never touched."""
    with translate_errors(url):
        _backend(url).delete_tree(url)
