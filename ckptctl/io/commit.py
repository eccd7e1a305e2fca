"""The one commit protocol of ckptctl: a folder of files becomes a checkpoint that readers see whole or not
at all, and the checkpoint it replaces goes the same way. The manager's saves and `convert` use it.

On a local filesystem:

1. the writer puts every file into a staging folder on the target's filesystem (hidden or named as in
   progress, so that no reader takes it for a checkpoint) and fsyncs each;
2. `write_marker` writes the file whose presence completes the checkpoint (a manifest, digests) last, and
   fsyncs it and the folder;
3. `install` renames the staging folder into place and fsyncs the parent. A checkpoint already there is
   swapped out atomically (`io.exchange`, renameat2) and retired into the trash (`trash.retire`), for the
   caller to purge now or later.

On an object store there is no folder rename, but each object appears whole or not at all, so the order of
the uploads is the protocol (`ObjectStoreUpload`):

1. what the target already holds is deleted first, its completion markers first (`trash.delete_objects`);
2. the staged files go up in the batches the caller orders (each batch in parallel, on `io`'s pool): the
   first batch makes a partial prefix recognisably the caller's, the last completes the checkpoint for
   its layout;
3. the marker goes up last;
4. a failed upload is undone by deleting what it put, markers first.

Both are one protocol, `Publish` (`clear` what the target holds, `upload` the staged files in batches, `finish`
with the marker, `undo`), with a local implementation (`RenameInstall`: only `finish` has work, the rest is done
by the rename) and an object store's (`ObjectStoreUpload`); `publisher` picks the one of a target, so that a
caller writes its commit once.
"""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

from ckptctl import io
from ckptctl.io import trash
from ckptctl.io.trash import Markers, Retired

__all__ = ["ObjectStoreUpload", "Publish", "RenameInstall", "install", "publisher", "write_marker"]


def write_marker(folder: str, name: str, data: bytes) -> None:
    """Write the completion marker `name` into the local staging `folder`, after everything else: the
    file, then fsync it and the folder.

    Raises:
        OSError: writing failed.
    """
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    io.fsync_dir(folder)


def install(staging: str, final: str) -> Retired | None:
    """Rename the committed local `staging` folder to `final` and fsync the parent.

    A missing or empty `final` is replaced by a plain rename (atomic). Any other `final` is swapped out
    atomically where the OS can (renameat2); elsewhere it is retired first and, for a moment, absent. The
    replaced folder is returned retired into the trash beside `final`, for the caller to `trash.purge`.

    Raises:
        UnsafePath: the trash beside `final` is a link (checked before anything moves).
        OSError: a rename failed (`staging` is left as it was, or holds the replaced folder).
    """
    parent = os.path.dirname(os.path.abspath(final))
    if not os.path.lexists(final) or (os.path.isdir(final) and not os.listdir(final)):
        os.rename(staging, final)
        io.fsync_dir(parent)
        return None
    name, bin_ = os.path.basename(final), trash.trash_of(final)
    trash.check_trash(bin_)  # before the swap: a refusal after it would leave the old folder at the staging name
    if io.exchange(staging, final):
        # The swap is atomic: `final` is the new folder; the old one now has the staging name.
        retired = trash.move_to_trash(staging, bin_, name)
    else:
        # No atomic swap here: for a moment `final` is absent (readers find the previous checkpoint); the
        # old one waits in the trash until the new one is in place.
        retired = trash.move_to_trash(final, bin_, name)
        os.rename(staging, final)
    io.fsync_dir(parent)
    return retired


class Publish(abc.ABC):
    """The commit of the local staging folder `staging` as the folder `url` (see the module docstring).

    Args:
        staging: the local folder holding the files, by the paths they get below `url`.
        url: the target folder.
        markers: the completion markers of what `url` holds or will hold, deleted first by `clear`/`undo`
            (none by default).
        on_file: called with each file's relative path once it is uploaded (progress).
    """

    def __init__(
        self,
        staging: str,
        url: str,
        markers: Markers = trash.no_markers,
        on_file: Callable[[str], object] | None = None,
    ) -> None:
        self.staging = staging
        self.url = url
        self.markers = markers
        self._on_file = on_file
        self._uploaded: list[str] = []
        self._lock = threading.Lock()

    @property
    def uploaded(self) -> tuple[str, ...]:
        """The files this commit has put so far, one by one (none for a rename, which moves them all at once)."""
        with self._lock:
            return tuple(self._uploaded)

    @abc.abstractmethod
    def clear(self, files: Mapping[str, int] | None = None) -> None:
        """Make room for the new folder: delete what the target holds (the objects `files` below it, relative
        path -> size, or everything), markers first, where the commit cannot replace it whole."""

    @abc.abstractmethod
    def upload(self, batches: Iterable[Sequence[str]]) -> None:
        """Put the staged files (relative paths), batch after batch, where the commit does not move them all
        at once."""

    @abc.abstractmethod
    def finish(self, marker: str, data: bytes | None = None) -> Retired | None:
        """Complete the commit with the marker, last: the staged file `marker`, or `data` as `marker`. Returns
        the folder it replaced, retired into the trash for the caller to `trash.purge`, where one was."""

    @abc.abstractmethod
    def undo(self) -> None:
        """Take back what this commit published (after a failure)."""


class RenameInstall(Publish):
    """The commit into a local folder: the files stay where they were staged (each fsynced by its writer), and
    `finish` writes the marker into the staging folder and renames it into place (`install`)."""

    def clear(self, files: Mapping[str, int] | None = None) -> None:
        pass  # the rename swaps the old folder out whole

    def upload(self, batches: Iterable[Sequence[str]]) -> None:
        pass  # the rename publishes every file at once

    def finish(self, marker: str, data: bytes | None = None) -> Retired | None:
        if data is None:
            io.fsync_dir(self.staging)
        else:
            write_marker(self.staging, marker, data)
        return install(self.staging, self.url)

    def undo(self) -> None:
        pass  # nothing was published before `finish`, which renames at once or not at all


class ObjectStoreUpload(Publish):
    """The commit of a local staging folder into a folder of an object store (see the module docstring)."""

    def clear(self, files: Mapping[str, int] | None = None) -> None:
        if files is None:
            trash.delete(self.url, self.markers)
        else:
            trash.delete_objects(self.url, files, self.markers(files))

    def upload(self, batches: Iterable[Sequence[str]]) -> None:
        """Upload staged files batch after batch; a batch in parallel, its largest files first."""
        for batch in batches:
            ordered = sorted(batch, key=lambda rel: -os.path.getsize(os.path.join(self.staging, rel)))
            io.parallel_map(self._put, ordered)

    def finish(self, marker: str, data: bytes | None = None) -> Retired | None:
        """Put the completion marker, last: the staged file `marker`, or `data` as `marker` (one atomic PUT)."""
        if data is None:
            self._put(marker)
        else:
            io.write_bytes_atomic(io.join(self.url, marker), data)
            with self._lock:
                self._uploaded.append(marker)
        return None

    def undo(self) -> None:
        """Delete what this upload put, markers first."""
        files = {rel: _size(os.path.join(self.staging, rel)) for rel in self.uploaded}
        trash.delete_objects(self.url, files, self.markers(files))

    def _put(self, rel: str) -> None:
        io.upload_file(os.path.join(self.staging, rel), io.join(self.url, rel))
        with self._lock:
            self._uploaded.append(rel)
        if self._on_file is not None:
            self._on_file(rel)


def publisher(
    staging: str, url: str, markers: Markers = trash.no_markers, on_file: Callable[[str], object] | None = None
) -> Publish:
    """The commit of `staging` as `url` on the storage of `url` (arguments as `Publish`'s)."""
    return (RenameInstall if io.is_local(url) else ObjectStoreUpload)(staging, url, markers, on_file)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # the marker, uploaded from memory
        return 0
