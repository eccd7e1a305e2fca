"""The protocol every kind of storage implements; the `ckptctl.io` functions pick one per URL.

Three implementations: `local.LocalBackend` (os calls: the fast path for local paths), `remote.FsspecBackend`
(any fsspec URL, with retries and deadlines) and `snapshot.Snapshot` (the answers of one recursive listing
of a remote folder, for the walks that ask about many of its folders; everything else goes to the store).

Methods take the URL the caller gave. A backend raises what its storage raises (`OSError`s, a driver's
exceptions); the `io` function that called it turns those into typed ckptctl errors in one place
(`failures.translate_errors`). Reads count their bytes (`counting.count_read`) where they cross the
storage's boundary, so that an answer from a cache counts nothing.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import IO

from ckptctl.io.paths import DirEntry, name_of, parent_of

__all__ = ["Backend"]


class Backend(abc.ABC):
    """Queries, reads, writes and deletes on one kind of storage."""

    # ---- queries

    @abc.abstractmethod
    def list_dir(self, url: str) -> list[DirEntry]:
        """Entries of a folder, sorted by name."""

    @abc.abstractmethod
    def list_tree(self, url: str) -> dict[str, DirEntry]:
        """Every file below a folder, keyed by its path relative to it (with `/`); empty when there is none."""

    @abc.abstractmethod
    def exists(self, url: str) -> bool:
        """Whether a file or folder is there."""

    @abc.abstractmethod
    def is_dir(self, url: str) -> bool:
        """Whether a folder is there."""

    @abc.abstractmethod
    def file_size(self, url: str) -> int:
        """The size of a file in bytes."""

    # ---- reads

    @abc.abstractmethod
    def read(self, url: str, start: int, length: int | None, cap: int | None) -> bytes:
        """`length` bytes from `start` (to the end when None) of a regular file. With `cap` (a whole-file
        read of a file that may be at most that large), at most `cap + 1` bytes are read, and a file known
        to be larger may be refused before reading (`failures.check_size`)."""

    def read_stamped(self, url: str, length: int) -> tuple[bytes, float]:
        """The first `length` bytes of a regular file and its mtime (POSIX seconds; now where the storage keeps
        none): a read and a listing of its folder, unless the storage answers both at once (an object store's
        GET carries the object's time)."""
        data = self.read(url, 0, length, None)
        entry = next((e for e in self.list_dir(parent_of(url)) if e.name == name_of(url)), None)
        return data, entry.mtime if entry is not None and entry.mtime else time.time()

    @abc.abstractmethod
    def open_read(self, url: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A binary file object for sequential reads (not counted: the caller counts what it reads)."""

    # ---- writes and deletes

    @abc.abstractmethod
    def write_atomic(self, url: str, data: bytes) -> None:
        """Write a small file so that readers see either the old content or the new, never a mix."""

    def create_new(self, url: str, data: bytes) -> bool | None:
        """Write the small file `url` only if none is there, in one step no other writer can split: True when
        this call created it, False when a file was there; None where the storage has no such write (the
        caller makes do with a check, a write and a read back)."""
        return None

    def delete_if_unchanged(self, url: str, judge: Callable[[], bool]) -> bool:
        """Delete the small file `url` if `judge()` (which reads it) says it is the one the caller means, and
        only that one: True when it was deleted. Here a file replaced between the judgment and the delete is
        deleted all the same (best effort); an object store with a conditional DELETE refuses it."""
        if not judge():
            return False
        self.delete_file(url)
        return True

    @abc.abstractmethod
    def upload(self, path: str, url: str) -> None:
        """Copy the local file `path` to `url`; the file appears only once it is complete."""

    @abc.abstractmethod
    def delete_file(self, url: str) -> None:
        """Remove one file (a missing one is not an error)."""

    def delete_files(self, urls: Sequence[str]) -> None:
        """Remove many files of this storage (missing ones are not an error): one by one, unless the storage
        deletes in batches."""
        for url in urls:
            self.delete_file(url)

    @abc.abstractmethod
    def delete_tree(self, url: str) -> None:
        """Remove a folder and everything below it (a missing one is not an error); symbolic links inside
        are removed as links, what they point to is never touched."""
