"""A listing snapshot: the answers of one recursive listing of a remote folder, for the walks that ask
about many of its folders (`list` of a run: one request in all instead of a few per checkpoint).

`listing_snapshot(url)` makes one for a block; while it runs, the `io` functions answer `list_dir`,
`list_tree`, `is_dir`, `exists` and `file_size` of `url` and of everything below it from the snapshot, and
read small files once. It is a context variable: the threads of `io.parallel_map` see it too.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import posixpath
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from ckptctl.errors import CheckpointNotFound
from ckptctl.io.backend import Backend
from ckptctl.io.failures import translate_errors
from ckptctl.io.paths import DirEntry, is_local
from ckptctl.io.remote import FSSPEC, entry_of

__all__ = ["Snapshot", "covering", "listing_snapshot"]

#: Files up to this size are read once per snapshot.
_SMALL_FILE = 64 << 10


class Snapshot(Backend):
    """Every file and folder below a remote folder, from one recursive listing.

    Object stores have no folders: a per-folder listing is one request per folder, while one listing of
    the whole prefix returns every key below it, 1,000 per page. A scan of a run (`layouts.scan_run`)
    asks about every folder of the run, so it takes one snapshot and answers from it. What a listing cannot
    answer (reads, writes, deletes) goes to `store`; whole reads of small files are made once.
    """

    def __init__(self, root: str, found: dict[str, dict[str, Any]], prefix: str, store: Backend) -> None:
        self.root = root.rstrip("/")
        self.store = store
        self.files: dict[str, DirEntry] = {}
        folders: dict[str, dict[str, DirEntry]] = {"": {}}

        def add(rel: str, entry: DirEntry) -> None:
            parent = rel.rpartition("/")[0]
            if parent not in folders:
                add(parent, DirEntry(posixpath.basename(parent), True, 0, 0.0))
            folders[parent][entry.name] = entry
            if entry.is_dir:
                folders.setdefault(rel, {})

        for name, info in sorted(found.items()):  # sorted: a folder's own entry comes before its content
            rel = name[len(prefix) :].strip("/") if name.startswith(prefix) else ""
            if not rel:
                continue
            entry = entry_of(info)
            if name.endswith("/") and not entry.is_dir:  # a placeholder object some tools create for a folder
                entry = DirEntry(entry.name, True, 0, entry.mtime)
            if not entry.is_dir:
                self.files[rel] = entry
            add(rel, entry)
        self.folders = {rel: sorted(entries.values(), key=lambda d: d.name) for rel, entries in folders.items()}
        self._paths = sorted(self.files)
        self._small: dict[str, bytes] = {}
        self._lock = threading.Lock()

    # ---- answered from the listing

    def list_dir(self, url: str) -> list[DirEntry]:
        rel = self._rel(url)
        if rel in self.files:  # the store says what listing a file is
            return self.store.list_dir(url)
        listing = self.folders.get(rel)
        if listing is None:
            raise CheckpointNotFound(f"no such file or folder: {url}")
        return list(listing)

    def list_tree(self, url: str) -> dict[str, DirEntry]:
        return self.tree(self._rel(url))

    def exists(self, url: str) -> bool:
        rel = self._rel(url)
        return rel in self.folders or rel in self.files

    def is_dir(self, url: str) -> bool:
        return self._rel(url) in self.folders

    def file_size(self, url: str) -> int:
        entry = self.files.get(self._rel(url))
        return entry.size if entry is not None else self.store.file_size(url)

    def read(self, url: str, start: int, length: int | None, cap: int | None) -> bytes:
        """Whole reads of small files (markers and pointers that several layouts read while identifying a
        folder) go to the store once; the rest every time."""
        if start or length is not None:
            return self.store.read(url, start, length, cap)
        rel = self._rel(url)
        entry = self.files.get(rel)
        if entry is None or entry.size > _SMALL_FILE:
            return self.store.read(url, start, length, cap)
        with self._lock:
            data = self._small.get(rel)
        if data is None:
            data = self.store.read(url, start, length, cap)
            with self._lock:
                self._small[rel] = data
        return data

    # ---- to the store

    def read_stamped(self, url: str, length: int) -> tuple[bytes, float]:
        return self.store.read_stamped(url, length)

    def open_read(self, url: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return self.store.open_read(url)

    def write_atomic(self, url: str, data: bytes) -> None:
        self.store.write_atomic(url, data)

    def create_new(self, url: str, data: bytes) -> bool | None:
        return self.store.create_new(url, data)

    def delete_if_unchanged(self, url: str, judge: Callable[[], bool]) -> bool:
        return self.store.delete_if_unchanged(url, judge)

    def upload(self, path: str, url: str) -> None:
        self.store.upload(path, url)

    def delete_file(self, url: str) -> None:
        self.store.delete_file(url)

    def delete_files(self, urls: Sequence[str]) -> None:
        self.store.delete_files(urls)

    def delete_tree(self, url: str) -> None:
        self.store.delete_tree(url)

    # ---- the listing

    def _rel(self, url: str) -> str:
        rel = self.relative(url)
        assert rel is not None, f"{url} is not below {self.root}"  # `covering` chose this snapshot for it
        return rel

    def relative(self, url: str) -> str | None:
        """`url` relative to the root ("" for the root), or None when it is not at or below it."""
        if url.startswith("file://") or "://" not in url:
            return None
        path = url.rstrip("/")
        if path == self.root:
            return ""
        if path.startswith(self.root + "/"):
            rel = path[len(self.root) + 1 :]
            return None if "//" in rel or any(part in (".", "..") for part in rel.split("/")) else rel
        return None

    def tree(self, rel: str) -> dict[str, DirEntry]:
        """The files below the folder `rel`, keyed by their path relative to it."""
        if not rel:
            return dict(self.files)
        start = rel + "/"
        first = bisect.bisect_left(self._paths, start)
        last = bisect.bisect_left(self._paths, rel + "0")  # "0" follows "/": the end of the keys below rel/
        return {path[len(start) :]: self.files[path] for path in self._paths[first:last]}


_SNAPSHOT: contextvars.ContextVar[Snapshot | None] = contextvars.ContextVar("ckptctl_io_snapshot", default=None)


def covering(url: str) -> Snapshot | None:
    """The snapshot the caller is inside of, when it covers `url`."""
    snapshot = _SNAPSHOT.get()
    if snapshot is None or snapshot.relative(url) is None:
        return None
    return snapshot


@contextlib.contextmanager
def listing_snapshot(url: str) -> Iterator[None]:
    """While the block runs, answer `list_dir`, `list_tree`, `is_dir`, `exists` and `file_size` of `url`
    and of everything below it from one recursive listing taken on entry (paginated by the store).

    For walks that ask about many folders of one tree (`list` of a run: one request in all instead of a
    few per checkpoint). Whole reads of small files (up to 64 KiB: markers and pointers that several
    layouts read) are made once in the block. What changes below `url` during the block is not seen.
    A no-op for local paths (the os calls are cheap), for a `url` that an enclosing snapshot already
    covers, and when nothing is found (the calls then go to the store, which says what is missing).
    The snapshot is visible to the threads of `parallel_map` started inside the block.
    """
    if is_local(url) or covering(url) is not None:
        yield
        return
    with translate_errors(url):
        found, prefix = FSSPEC.find(url, withdirs=True)
    snapshot = Snapshot(url, found, prefix, FSSPEC)
    if not snapshot.files and len(snapshot.folders) == 1:
        yield
        return
    token = _SNAPSHOT.set(snapshot)
    try:
        yield
    finally:
        _SNAPSHOT.reset(token)
