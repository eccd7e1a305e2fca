"""The one delete routine of ckptctl: a checkpoint stops reading as complete first, then its bytes go.

Deleting a checkpoint folder of GBs takes time, and a process killed halfway must not leave a folder that
still lists (or restores) as complete with files missing. Every deletion of the library (the manager's
retention and re-saves, `prune`, `convert --force`) therefore runs in two steps:

1. `retire`: take the checkpoint out of sight at once. Locally, rename it into the `.ckptctl-trash` folder
   beside it (same filesystem: atomic) and fsync the parent. On an object store (no rename), or where the
   checkpoint is another filesystem's mount point, delete its completion markers first, so that what is
   left reads as broken or in progress.
2. `purge`: delete what is left, then the trash folder itself once it is empty.

`delete` does both; the manager runs `purge` on a background thread. A crash between the two leaves a
folder in the trash (or a prefix without markers), which every reader skips and the next deletion in the
same folder (`empty`, run by `prune` and by the manager's retention) removes. `delete_parts` deletes some
entries of a folder the same way (a checkpoint whose folder also holds other checkpoints).

The completion markers are the caller's (`Markers`, from the layouts' `completion_markers`): given the
files of the folder, tiers of files that are deleted tier by tier (each tier in one batch) before the
rest.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from ckptctl import io
from ckptctl.errors import CheckpointNotFound

__all__ = [
    "TRASH_NAME",
    "Markers",
    "Retired",
    "Tiers",
    "delete",
    "delete_objects",
    "delete_parts",
    "empty",
    "no_markers",
    "purge",
    "retire",
    "trash_of",
]

#: The folder beside a checkpoint that it is renamed into before it is deleted (every scan skips it).
TRASH_NAME = ".ckptctl-trash"

#: Files deleted before the others, tier by tier (relative paths with `/`; each tier in one batch).
Tiers = Sequence[Collection[str]]
#: The tiers of a folder to delete first, given its files (relative path -> size in bytes).
Markers = Callable[[Mapping[str, int]], Tiers]


def no_markers(files: Mapping[str, int]) -> Tiers:
    """`Markers` of a folder with nothing to delete first."""
    return ()


#: How often a rename into the trash is tried again when the trash vanished under it (another process
#: removed it, empty, between our `makedirs` and our `rename`).
_RENAME_TRIES = 5


@dataclass(frozen=True, slots=True)
class Retired:
    """A checkpoint taken out of sight and not yet deleted.

    Attributes:
        url: what is left to delete: the folder inside the trash, or the folder itself where it could not
            be renamed (its markers are gone).
        trash: the local trash folder it lies in, removed by `purge` once empty; None when not in one.
    """

    url: str
    trash: str | None = None


def trash_of(url: str) -> str:
    """The trash folder beside `url` (for local folders)."""
    return os.path.join(os.path.dirname(os.path.abspath(io.local_path(url))), TRASH_NAME)


def retire(url: str, markers: Markers = no_markers) -> Retired:
    """Take the checkpoint folder `url` out of sight at once (step 1 of the module docstring).

    Args:
        url: a local path or an object store URL.
        markers: completion markers deleted first where the folder cannot be renamed away.

    Raises:
        OSError: a local rename failed (other than by a mount point in the way).
        CkptctlError: a remote deletion failed.
    """
    if not io.is_local(url):
        _delete_markers(url, markers)
        return Retired(url)
    path = os.path.abspath(io.local_path(url))
    bin_ = trash_of(path)
    try:
        return move_to_trash(path, bin_, os.path.basename(path))
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EBUSY):
            raise
    remove_if_empty(bin_)
    _delete_markers(path, markers)  # another filesystem mounted at the checkpoint: no atomic move
    return Retired(path)


def move_to_trash(path: str, trash: str, name: str) -> Retired:
    """Rename the local `path` into `trash` (created if missing) as `name.<random>`, and fsync its parent.

    `trash` must be on the filesystem of `path`.
    """
    for attempt in range(_RENAME_TRIES):
        os.makedirs(trash, exist_ok=True)
        target = os.path.join(trash, f"{name}.{secrets.token_hex(4)}")
        try:
            os.rename(path, target)
            break
        except FileNotFoundError:
            # The trash was removed (empty) by another deletion between makedirs and rename: make it again.
            if not os.path.lexists(path) or attempt == _RENAME_TRIES - 1:
                raise
    io.fsync_dir(os.path.dirname(path))
    return Retired(target, trash)


def purge(retired: Retired) -> None:
    """Delete what `retire` left (step 2 of the module docstring), then the trash folder if it is empty.

    Raises:
        CkptctlError: the deletion failed; what is left stays out of sight.
    """
    # A checkpoint may be one file (a Lightning `.ckpt`): what was retired is then a file.
    (io.delete_tree if io.is_dir(retired.url) else io.delete_file)(retired.url)
    if retired.trash is not None:
        remove_if_empty(retired.trash)


def delete(url: str, markers: Markers = no_markers) -> None:
    """Delete the checkpoint folder `url` so that no moment shows it half-deleted and complete."""
    purge(retire(url, markers))


def delete_objects(url: str, rels: Collection[str], tiers: Tiers = ()) -> None:
    """Delete the files `rels` (paths relative to the folder `url`; missing ones are not an error): those of
    each tier first, tier by tier, then the rest; batched deletes on object stores."""
    left = list(rels)
    for tier in tiers:
        hit = [rel for rel in left if rel in tier]
        if hit:
            io.delete_files([io.join(url, rel) for rel in hit])
            left = [rel for rel in left if rel not in tier]
    if left:
        io.delete_files([io.join(url, rel) for rel in left])


def delete_parts(url: str, parts: Sequence[io.DirEntry]) -> None:
    """Delete the entries `parts` of the folder `url`, in the order given, and leave its other entries.

    No single rename takes them away together, so the caller orders them so that no moment passes for a
    complete checkpoint (its markers first). Locally each is renamed, in that order, into one folder in the
    trash beside `url`, which is then deleted; on an object store each is deleted in that order.

    Raises:
        OSError: a local rename failed.
        CkptctlError: a deletion failed.
    """
    if not io.is_local(url):
        for entry in parts:
            (io.delete_tree if entry.is_dir else io.delete_file)(io.join(url, entry.name))
        return
    path = os.path.abspath(io.local_path(url))
    bin_ = trash_of(path)
    folder = os.path.join(bin_, f"{os.path.basename(path)}.{secrets.token_hex(4)}")
    os.makedirs(folder)
    for entry in parts:
        os.rename(os.path.join(path, entry.name), os.path.join(folder, entry.name))
    io.fsync_dir(path)
    purge(Retired(folder, bin_))


def empty(trash: str) -> int:
    """Delete what a trash folder holds (left by an interrupted deletion), then the folder itself; returns
    the bytes freed. A missing trash folder is empty.

    Raises:
        CkptctlError: a deletion failed.
    """
    try:
        entries = io.list_dir(trash)
    except CheckpointNotFound:
        return 0
    freed = 0
    for entry in entries:
        child = io.join(trash, entry.name)
        if entry.is_dir:
            freed += _tree_size(child)
            io.delete_tree(child)
        else:
            freed += entry.size
            io.delete_file(child)
    if io.is_local(trash):
        remove_if_empty(trash)
    return freed


def remove_if_empty(folder: str) -> None:
    """Remove a local folder if it is empty; one that holds something (another deletion's leftovers, or a
    folder moved in meanwhile) or is gone already stays as it is."""
    with contextlib.suppress(OSError):
        os.rmdir(io.local_path(folder))


def _delete_markers(url: str, markers: Markers) -> None:
    files = {rel: entry.size for rel, entry in io.list_tree(url).items()}
    tiers = markers(files)
    delete_objects(url, [rel for rel in files if any(rel in tier for tier in tiers)], tiers)


def _tree_size(url: str) -> int:
    """Bytes of the regular files below a folder; symbolic links are not followed."""
    if not io.is_local(url):
        return sum(entry.size for entry in io.list_tree(url).values())
    size = 0
    for root, _dirs, files in os.walk(io.local_path(url)):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(os.path.join(root, name))
                if stat.S_ISREG(st.st_mode):
                    size += st.st_size
    return size
