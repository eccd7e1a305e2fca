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

Locally, nothing here follows a symbolic link: the trash is opened with `O_NOFOLLOW` below a descriptor of
its parent, renames go from one directory descriptor to another, and deletions run through descriptors
(`shutil.rmtree`'s fd-based walk), so that a link planted in place of the trash (or swapped in while we
work) cannot make a deletion reach outside the run. A link where the trash should be is refused
(`UnsafePath`) before anything is moved; a checkpoint that is itself a link loses the link, never what it
points to.

The completion markers are the caller's (`Markers`, from the layouts' `completion_markers`): given the
files of the folder, tiers of files that are deleted tier by tier (each tier in one batch) before the
rest.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shlex
import shutil
import stat
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptctl import io
from ckptctl.errors import CheckpointNotFound, UnsafePath
from ckptctl.io.local import read_at_most

__all__ = [
    "QUARANTINE_NAME",
    "TRASH_NAME",
    "Markers",
    "Retired",
    "Tiers",
    "check_trash",
    "delete",
    "delete_objects",
    "delete_parts",
    "drop_pointer_record",
    "empty",
    "no_markers",
    "pointer_records",
    "present",
    "purge",
    "quarantine",
    "quarantined",
    "record_pointers",
    "remove_empty_quarantine",
    "remove_entry",
    "retire",
    "trash_of",
    "unquarantine",
    "workspace",
]

#: The folder beside a checkpoint that it is renamed into before it is deleted (every scan skips it).
TRASH_NAME = ".ckptctl-trash"

#: The folder of the trash that `repair` moves torn checkpoints into, to be moved back by `repair --undo`: what
#: it holds is never deleted here (`empty` leaves it), only by a purge the user asks for.
QUARANTINE_NAME = "quarantine"
#: Beside each quarantined entry, `<name>` + this: a small JSON record of where it came from.
RECORD_SUFFIX = ".origin.json"
#: In the quarantine, `<repair id>` + this: a JSON record of the pointers one repair rewrote and what they held,
#: which `repair --undo` puts back (a repair that only rewrites pointers quarantines nothing else).
POINTERS_SUFFIX = ".pointers.json"
#: What is read of a pointer record: a few pointers of at most 4 KiB each, in base64 and as escaped text.
_MAX_POINTER_RECORD_BYTES = 1 << 20

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

    `trash` must be on the filesystem of `path`. A link at `path` is moved itself, never what it names.

    Raises:
        UnsafePath: `trash` is a symbolic link or not a folder (nothing was moved).
        OSError: the rename failed.
    """
    parent, entry = os.path.split(path)
    for attempt in range(_RENAME_TRIES):
        target = f"{name}.{secrets.token_hex(4)}"
        with _opened_dir(parent, follow=True) as parent_fd, _opened_trash(trash, create=True) as trash_fd:
            assert trash_fd is not None  # created
            try:
                os.rename(entry, target, src_dir_fd=parent_fd, dst_dir_fd=trash_fd)
                break
            except FileNotFoundError:
                # The trash was removed (empty) by another deletion between opening and renaming: again.
                if not os.path.lexists(path) or attempt == _RENAME_TRIES - 1:
                    raise
    io.fsync_dir(parent)
    return Retired(os.path.join(trash, target), trash)


def check_trash(trash: str) -> None:
    """Refuse (`UnsafePath`) when the local trash folder `trash` exists and is a link or not a folder: for
    callers that must know before they change anything (a swap that would otherwise stop halfway)."""
    with _opened_trash(trash, create=False):
        pass


def present(trash: str) -> bool:
    """Whether the trash folder `trash` (a URL) is there, refusing (`UnsafePath`) a local one that is a link or
    not a folder, before anything is deleted through it."""
    if not io.is_local(trash):
        return io.is_dir(trash)
    if not os.path.lexists(io.local_path(trash)):
        return False
    check_trash(io.local_path(trash))
    return True


def workspace(trash: str, name: str) -> str:
    """A new empty folder `name.<random>` inside the local trash folder `trash` (made if missing), where a
    replacement of a checkpoint is built before `commit.install` swaps it in: every scan skips the trash, so
    what a killed build leaves there is never read as a checkpoint, and the next deletion empties it.

    Raises:
        UnsafePath: `trash` is a symbolic link or not a folder (nothing was made).
    """
    with _opened_trash(trash, create=True) as trash_fd:
        target = f"{name}.{secrets.token_hex(4)}"
        os.mkdir(target, dir_fd=trash_fd)
    return os.path.join(trash, target)


def purge(retired: Retired) -> None:
    """Delete what `retire` left (step 2 of the module docstring), then the trash folder if it is empty.

    Raises:
        UnsafePath: the trash was replaced by a link meanwhile (nothing is deleted through it).
        CkptctlError: the deletion failed; what is left stays out of sight.
    """
    if retired.trash is None or not io.is_local(retired.url):
        # A checkpoint may be one file (a Lightning `.ckpt`): what was retired is then a file.
        (io.delete_tree if io.is_dir(retired.url) else io.delete_file)(retired.url)
        return
    with _opened_trash(retired.trash, create=False) as trash_fd:
        if trash_fd is not None:
            remove_entry(trash_fd, os.path.basename(retired.url))
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
    folder = f"{os.path.basename(path)}.{secrets.token_hex(4)}"
    with _opened_trash(bin_, create=True) as trash_fd, _opened_dir(path, follow=True) as source_fd:
        assert trash_fd is not None  # created
        os.mkdir(folder, dir_fd=trash_fd)
        with _opened_dir(folder, dir_fd=trash_fd, what=os.path.join(bin_, folder)) as folder_fd:
            for entry in parts:
                os.rename(entry.name, entry.name, src_dir_fd=source_fd, dst_dir_fd=folder_fd)
        os.fsync(source_fd)
    purge(Retired(os.path.join(bin_, folder), bin_))


def empty(trash: str) -> int:
    """Delete what a trash folder holds (left by an interrupted deletion), then the folder itself; returns
    the bytes freed. A missing trash folder is empty.

    Raises:
        UnsafePath: the local `trash` is a symbolic link or not a folder (nothing is deleted).
        CkptctlError: a deletion failed.
    """
    if io.is_local(trash):
        freed = 0
        with _opened_trash(trash, create=False) as trash_fd:
            if trash_fd is None:
                return 0
            for name in os.listdir(trash_fd):
                if name == QUARANTINE_NAME:  # `repair`'s, kept until `repair --undo` moves it back
                    continue
                freed += _entry_size(trash_fd, name)
                remove_entry(trash_fd, name)
        remove_if_empty(trash)
        return freed
    try:
        entries = io.list_dir(trash)
    except CheckpointNotFound:
        return 0
    freed = 0
    for entry in entries:
        if entry.name == QUARANTINE_NAME:
            continue
        child = io.join(trash, entry.name)
        if entry.is_dir:
            freed += _tree_size(child)
            io.delete_tree(child)
        else:
            freed += entry.size
            io.delete_file(child)
    return freed


def quarantine(path: str, run: str, record: bytes) -> str:
    """Move the local entry `path` (a folder or file inside the run folder `run`) into the run's quarantine,
    `run/.ckptctl-trash/quarantine/<name>` (a free name), and return where it went.

    Its record (`<name>.origin.json`: where it came from) is written and fsynced first, so that a kill at any
    moment leaves the entry where it was or quarantined with its record; then one rename moves it (a link
    is moved itself, never what it names), and both folders are fsynced. Nothing is opened through a link.

    Raises:
        UnsafePath: the trash or the quarantine folder is a link or not a folder (nothing was moved).
        OSError: writing the record or the rename failed.
    """
    parent, entry = os.path.split(os.path.abspath(path))
    with _opened_quarantine(run, create=True) as opened:
        assert opened is not None  # created
        _, box_fd, where = opened
        name = _free_name(box_fd, entry)
        _write_file(box_fd, name + RECORD_SUFFIX, record)
        with _opened_dir(parent, follow=True) as parent_fd:
            os.rename(entry, name, src_dir_fd=parent_fd, dst_dir_fd=box_fd)
            os.fsync(parent_fd)
        os.fsync(box_fd)
    return os.path.join(where, name)


def quarantined(run: str) -> list[tuple[str, bytes]]:
    """Each entry of the run's quarantine that has its record, with the record, by name; a record whose entry
    is missing (a quarantine killed before its rename) is left out. None on an object store.

    Raises:
        UnsafePath: the trash or the quarantine folder is a link or not a folder.
    """
    if not io.is_local(run):
        return []  # nothing is quarantined on an object store (`quarantine` is a rename)
    found = []
    with _opened_quarantine(run, create=False) as opened:
        if opened is None:
            return []
        _, box_fd, _ = opened
        names = set(os.listdir(box_fd))
        for name in sorted(names):
            if name.endswith(RECORD_SUFFIX) or name + RECORD_SUFFIX not in names:
                continue
            found.append((name, _read_record(name + RECORD_SUFFIX, box_fd)))
    return found


def _read_record(name: str, dir_fd: int) -> bytes:
    """A quarantine record (at most `io.MAX_MARKER_BYTES` of it); b"" for anything but a regular file (a FIFO
    would block the read, a device never end it): no record `unquarantine` can use."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return b""
        return read_at_most(f, io.MAX_MARKER_BYTES, st.st_size)


def unquarantine(run: str, name: str, origin: str) -> None:
    """Move the quarantined entry `name` of the run back to `origin` (a path that must not exist), then delete
    its record: a kill in between leaves a record without an entry, which `quarantined` ignores.

    Raises:
        FileExistsError: something is at `origin` now (nothing was moved).
        UnsafePath: the trash or the quarantine folder is a link or not a folder.
    """
    bin_ = os.path.join(os.path.abspath(io.local_path(run)), TRASH_NAME)
    parent, entry = os.path.split(os.path.abspath(origin))
    with _opened_trash(bin_, create=False) as trash_fd:
        if trash_fd is None:
            raise FileNotFoundError(errno.ENOENT, "no quarantine", bin_)
        with (
            _opened_dir(QUARANTINE_NAME, dir_fd=trash_fd, what=os.path.join(bin_, QUARANTINE_NAME)) as box_fd,
            _opened_dir(parent, follow=True) as parent_fd,
        ):
            if os.path.lexists(origin):
                raise FileExistsError(errno.EEXIST, "in the way", origin)
            os.rename(name, entry, src_dir_fd=box_fd, dst_dir_fd=parent_fd)
            os.fsync(parent_fd)
            os.unlink(name + RECORD_SUFFIX, dir_fd=box_fd)
            os.fsync(box_fd)


def record_pointers(run: str, name: str, record: bytes) -> str:
    """Write the pointer record `name` + `POINTERS_SUFFIX` into the run's quarantine (made if missing) and fsync
    it and the folder, before the repair changes any pointer; return its path. Locally nothing is opened through
    a link; on an object store it is one PUT.

    Raises:
        UnsafePath: the trash or the quarantine folder is a link or not a folder (nothing was written).
        FileExistsError: a record of that name exists (names are unique per repair).
        OSError: writing failed.
    """
    if not io.is_local(run):
        url = io.join(run, TRASH_NAME, QUARANTINE_NAME, name + POINTERS_SUFFIX)
        io.write_bytes_atomic(url, record)
        return url
    with _opened_quarantine(run, create=True) as opened:
        assert opened is not None  # created
        trash_fd, box_fd, where = opened
        _write_file(box_fd, name + POINTERS_SUFFIX, record)
        os.fsync(box_fd)
        os.fsync(trash_fd)
    return os.path.join(where, name + POINTERS_SUFFIX)


def pointer_records(run: str) -> list[tuple[str, bytes]]:
    """Each pointer record of the run's quarantine (`record_pointers`), by name (without the suffix), with its
    content, oldest first (names start with the repair's UTC time).

    Raises:
        UnsafePath: the trash or the quarantine folder is a link or not a folder.
    """
    if not io.is_local(run):
        box = io.join(run, TRASH_NAME, QUARANTINE_NAME)
        try:
            entries = io.list_dir(box)
        except CheckpointNotFound:
            return []
        names = sorted(e.name for e in entries if not e.is_dir and e.name.endswith(POINTERS_SUFFIX))
        return [
            (n.removesuffix(POINTERS_SUFFIX), io.read_bytes(io.join(box, n), max_size=_MAX_POINTER_RECORD_BYTES))
            for n in names
        ]
    found = []
    with _opened_quarantine(run, create=False) as opened:
        if opened is None:
            return []
        _, box_fd, _ = opened
        for name in sorted(n for n in os.listdir(box_fd) if n.endswith(POINTERS_SUFFIX)):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=box_fd)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    continue
                found.append((name.removesuffix(POINTERS_SUFFIX), f.read(_MAX_POINTER_RECORD_BYTES)))
    return found


def drop_pointer_record(run: str, name: str) -> None:
    """Delete the pointer record `name` once `repair --undo` has put its pointers back (gone already is fine)."""
    if not io.is_local(run):
        io.delete_file(io.join(run, TRASH_NAME, QUARANTINE_NAME, name + POINTERS_SUFFIX))
        return
    bin_ = os.path.join(os.path.abspath(io.local_path(run)), TRASH_NAME)
    with _opened_trash(bin_, create=False) as trash_fd:
        if trash_fd is None:
            return
        with _opened_dir(QUARANTINE_NAME, dir_fd=trash_fd, what=os.path.join(bin_, QUARANTINE_NAME)) as box_fd:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name + POINTERS_SUFFIX, dir_fd=box_fd)
            os.fsync(box_fd)


def remove_empty_quarantine(run: str) -> None:
    """Remove the run's quarantine folder, then its trash folder, where each is empty (`repair --undo` leaves
    nothing of ckptctl's behind); one that holds something, or a link, stays."""
    if not io.is_local(run):
        return
    bin_ = os.path.join(os.path.abspath(io.local_path(run)), TRASH_NAME)
    with _opened_trash(bin_, create=False) as trash_fd:
        if trash_fd is None:
            return
        with contextlib.suppress(OSError):  # not empty, or not a folder: kept
            if stat.S_ISDIR(os.lstat(QUARANTINE_NAME, dir_fd=trash_fd).st_mode):
                os.rmdir(QUARANTINE_NAME, dir_fd=trash_fd)
                os.fsync(trash_fd)
    remove_if_empty(bin_)


def _free_name(dir_fd: int, name: str) -> str:
    """`name`, or `name.N` with the lowest N, for an entry and its record that the folder does not hold."""
    candidate, n = name, 1
    while any(_exists_at(dir_fd, c) for c in (candidate, candidate + RECORD_SUFFIX)):
        candidate, n = f"{name}.{n}", n + 1
    return candidate


def _exists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _write_file(dir_fd: int, name: str, data: bytes) -> None:
    """Create the file `name` in the folder open as `dir_fd` (not through a link), write and fsync it."""
    fd = os.open(
        name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644, dir_fd=dir_fd
    )
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


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
    """Bytes of the files below a folder of an object store."""
    return sum(entry.size for entry in io.list_tree(url).values())


def remove_entry(dir_fd: int, name: str) -> None:
    """Delete the entry `name` of the folder open as `dir_fd`: a folder with everything below it, walked
    through descriptors (links inside are removed, never followed); a file or a link itself. Gone already
    is fine (another deletion may remove the same files)."""

    def gone_is_fine(function: Any, target: str, excinfo: Any) -> None:
        if not isinstance(excinfo[1], FileNotFoundError):
            raise excinfo[1]

    try:
        mode = os.lstat(name, dir_fd=dir_fd).st_mode
        if stat.S_ISDIR(mode):
            shutil.rmtree(name, dir_fd=dir_fd, onerror=gone_is_fine)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _entry_size(dir_fd: int, name: str) -> int:
    """Bytes of the regular files at or below the entry `name` of the folder open as `dir_fd`; links are not
    followed."""
    size = 0
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(name, dir_fd=dir_fd)
        if stat.S_ISREG(st.st_mode):
            return st.st_size
        if not stat.S_ISDIR(st.st_mode):
            return 0
        for _root, _dirs, files, root_fd in os.fwalk(name, dir_fd=dir_fd):
            for file in files:
                with contextlib.suppress(FileNotFoundError):
                    st = os.lstat(file, dir_fd=root_fd)
                    if stat.S_ISREG(st.st_mode):
                        size += st.st_size
    return size


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)


@contextlib.contextmanager
def _opened_dir(
    path: str, *, dir_fd: int | None = None, what: str | None = None, follow: bool = False
) -> Iterator[int]:
    """A descriptor of the folder `path` (relative to `dir_fd` when given), opened without following a link
    in its last component: a link or a file there is refused with `UnsafePath` naming `what` (or `path`).
    With `follow`, for a folder the user named (a run folder reached through a link is theirs to choose),
    a link is followed."""
    fd = os.open(path, _DIR_FLAGS, dir_fd=dir_fd) if follow else _open_dir_nofollow(path, dir_fd, what or path)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _opened_quarantine(run: str, *, create: bool) -> Iterator[tuple[int, int, str] | None]:
    """Descriptors of the local run's trash and of the quarantine in it, and the quarantine's path, each
    opened without following a link (made first when `create`); None when either is missing and not made.

    Raises:
        UnsafePath: a link (or anything but a folder) is in the place of either.
    """
    bin_ = os.path.join(os.path.abspath(io.local_path(run)), TRASH_NAME)
    where = os.path.join(bin_, QUARANTINE_NAME)
    with _opened_trash(bin_, create=create) as trash_fd:
        if trash_fd is None or not (create or os.path.lexists(where)):
            yield None
            return
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(QUARANTINE_NAME, dir_fd=trash_fd)
        with _opened_dir(QUARANTINE_NAME, dir_fd=trash_fd, what=where) as box_fd:
            yield trash_fd, box_fd, where


@contextlib.contextmanager
def _opened_trash(trash: str, *, create: bool) -> Iterator[int | None]:
    """A descriptor of the local trash folder, opened below a descriptor of its parent (the run folder as the
    user named it) without following a link; made first when `create`, None when missing and not made.

    Raises:
        UnsafePath: a link (or anything but a folder) is in its place.
    """
    parent, name = os.path.split(trash)
    try:
        parent_fd = os.open(parent, _DIR_FLAGS)
    except FileNotFoundError:
        if create:
            raise
        yield None  # the folder that would hold it is gone (removed under us): no trash either
        return
    try:
        fd = None
        for attempt in range(_RENAME_TRIES):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, dir_fd=parent_fd)
            try:
                fd = _open_dir_nofollow(name, parent_fd, trash)
                break
            except FileNotFoundError:
                # Missing; or, when making it, removed (empty) by another deletion since our mkdir: again.
                if not create:
                    break
                if attempt == _RENAME_TRIES - 1:
                    raise
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)
    finally:
        os.close(parent_fd)


def _open_dir_nofollow(path: str, dir_fd: int | None, what: str) -> int:
    try:
        return os.open(path, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
    try:
        target = os.readlink(path, dir_fd=dir_fd)
        why = f"is a symbolic link (to {target}), not a folder of ckptctl's"
    except OSError:
        why = "is not a folder"
    raise UnsafePath(
        f"{what} {why}: refusing to move or delete anything through it; nothing was changed",
        f"remove it (rm {shlex.quote(what)}) after checking who put it there, then run the command again",
    )
