"""Digests, staging, commit: how the output of `convert` and `reshard` reaches DST whole or not at all.

Safety: everything is written into a hidden staging folder next to DST (`.<name>.ckptctl-convert-<pid>/`,
holding the output one level down so that no layout reader mistakes it for a checkpoint), checked against
the plan (headers read back: names, dtypes, shapes; `reread` also reads every byte back against the
digest computed while writing), digested into `ckptctl-digests.json` (so that `ckptctl verify DST` checks
every byte later), fsynced and renamed into place. An interrupted conversion never leaves anything at
DST; the next conversion into the same DST removes the leftover staging folder.

DST on an object store (`s3://bucket/out`, any fsspec URL): the output is staged the same way in the local
temporary folder (`TMPDIR`; its free space is checked against the output's size first), then uploaded on
`io`'s bounded pool of parallel transfers in an order that no interrupted upload can pass for a complete
checkpoint (`_upload_order`): every other file, then the files the output's layout names as its
completion markers (`Layout.completion_markers`: DCP's `.metadata`; the index and the smallest shard of a
sharded HF model), one after another, then, once a listing shows every object with its size,
`ckptctl-digests.json`. Each object appears whole or not at all (a PUT is atomic). A failed upload removes
what it uploaded; a killed one leaves a prefix that `list` reports broken or in progress, and that the
next conversion refuses without `force`. `force` deletes the old objects before uploading, the markers
of any layout first (`_markers`), so that a half-deleted old output does not pass for complete either.
Both commits are `io.commit`'s protocol; the old output a `force` replaces goes through `io.trash`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import posixpath
import shutil
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence

from ckptctl import io
from ckptctl.errors import CkptctlError, StorageError
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import DIGESTS_NAME, FileRecord, Manifest, now_iso
from ckptctl.io import trash
from ckptctl.io.commit import ObjectStoreUpload, install
from ckptctl.io.trash import Tiers
from ckptctl.layouts import Layout, all_layouts
from ckptctl.ops.distributed_work import Ranks
from ckptctl.ops.report import Progress

_STAGING_TAG = ".ckptctl-convert-"
_LOCK_NAME = "lock"
_OUT_NAME = "out"


def write_small(path: str, data: bytes) -> None:
    """Write a small output file (an index, a config, the digests) and fsync it."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from exc


def write_digests(out: str, known: dict[str, FileRecord]) -> None:
    """Record size and blake3 of every output file, as `ckptctl verify --write-manifest` would.

    `known` holds the digests computed while writing the tensor files: they are not hashed again, and
    they are recorded too where they are not in `out` (written by the other ranks of a job, into their
    own staging folders). Every file in `out` is synced.
    """
    files = {}
    for root, _dirs, names in os.walk(out):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, out).replace(os.sep, "/")] = path
    records = dict(known)
    for rel, path in files.items():
        if rel not in records:
            records[rel] = FileRecord(os.path.getsize(path), file_digest(path))
        # Writers that do not sync what they write (copied files, torch.save archives, files hashed while
        # written) are made durable here, before the commit's rename makes the output visible: a power cut
        # after it must not leave a complete-looking DST holding short files. A file its writer synced
        # costs one call.
        _fsync_file(path)
    for root, _dirs, _names in os.walk(out, topdown=False):
        io.fsync_dir(root)
    write_small(
        os.path.join(out, DIGESTS_NAME), Manifest(files=dict(sorted(records.items())), created=now_iso()).to_json()
    )
    io.fsync_dir(out)


def _fsync_file(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise StorageError(f"cannot sync {path}: {exc.strerror or exc}") from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        raise StorageError(f"cannot sync {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def check_destination(src: str, dst: str, force: bool) -> str:
    """The absolute local DST (or the object store URL without a trailing `/`), refused when it would
    overwrite something it must not."""
    # What may be replaced differs: a local folder is swapped out whole (so never a precious one), an object
    # store's prefix is emptied object by object.
    if not io.is_local(dst):
        return _check_remote_destination(src, dst, force)
    path = os.path.abspath(io.local_path(dst))
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CkptctlError(f"{path} exists and is not a folder", "choose a folder path for the output")
    if os.path.isdir(path) and os.listdir(path) and not force:
        raise CkptctlError(f"{path} is not empty", "pass --force to replace it, or choose another folder")
    if io.inside(src, path):
        raise CkptctlError(f"{path} contains the source {src}; the output would replace it", "choose another folder")
    if force and os.path.isdir(path) and os.listdir(path):
        # --force swaps the whole folder out: never one a typo could name (`~`, `.`), and never one holding
        # sub-folders unless an earlier conversion wrote it (an export is flat; a run folder is not).
        io.refuse_to_replace_precious(path, "choose another output folder")
        earlier_export = os.path.isfile(os.path.join(path, DIGESTS_NAME))
        if not earlier_export and any(entry.is_dir() for entry in os.scandir(path)):
            raise CkptctlError(
                f"refusing to replace {path}: it holds sub-folders and no {DIGESTS_NAME}, so it is not an earlier export",
                "choose another output folder, or delete this one yourself if you are sure",
            )
    return path


def _check_remote_destination(src: str, dst: str, force: bool) -> str:
    """`dst` without a trailing `/`, refused when objects are below it (without `force`), when it is an
    object itself, or when it holds the source."""
    url = dst.rstrip("/")
    scheme, _, path = url.partition("://")
    if not path.strip("/"):
        raise CkptctlError(f"{dst} names no bucket or folder", f"write into a prefix, e.g. {scheme}://BUCKET/export")
    if io.inside(src, url):
        raise CkptctlError(f"{url} contains the source {src}; the output would replace it", "choose another prefix")
    existing = io.list_tree(url)
    if existing and not force:
        raise CkptctlError(
            f"{url} is not empty ({len(existing)} object(s) below it)",
            "pass --force to replace them, or choose another prefix; an upload that was killed also leaves "
            "objects behind, which --force removes",
        )
    if not existing and io.exists(url):
        raise CkptctlError(f"{url} is an object, not a folder", "choose a folder path for the output")
    return url


class Staging:
    """The hidden folder a conversion writes into, its lock, and the final rename.

    `.<name>.ckptctl-convert-<pid>/` next to DST holds `lock` (flock'ed while the conversion runs) and
    `out/` (the future DST). A staging folder whose lock nobody holds is left over from a killed
    conversion and is removed by the next conversion into the same DST.
    """

    def __init__(self, dst: str, parent: str | None = None, stem: str | None = None) -> None:
        """`parent` and `stem`: the folder that holds the staging folder and the start of its name (next to
        DST, `.<name of DST>`, unless given)."""
        self.dst = dst
        self.parent = os.path.dirname(dst) if parent is None else parent
        self.stem = f".{os.path.basename(dst)}" if stem is None else stem
        self.root = os.path.join(self.parent, f"{self.stem}{_STAGING_TAG}{os.getpid()}")
        self.out = os.path.join(self.root, _OUT_NAME)
        self._lock_fd: int | None = None

    def __enter__(self) -> Staging:
        try:
            os.makedirs(self.parent, exist_ok=True)
            self._clean_stale()
            os.mkdir(self.root)
            self._lock_fd = os.open(os.path.join(self.root, _LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            os.mkdir(self.out)
        except OSError as exc:
            self._remove()
            raise StorageError(f"cannot create a staging folder in {self.parent}: {exc.strerror or exc}") from exc
        return self

    def check_space(self, tensor_bytes: int) -> None:
        """Nothing to check next to DST: the output is written where the user asked for it."""

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _remove(self) -> None:
        # The lock goes last: a removal cut short (the launcher's SIGKILL after its SIGTERM, seen on a loaded
        # machine) leaves a folder whose lock nobody holds, which the next conversion removes; a folder
        # without its lock would be judged still being created, and stay.
        # Through descriptors, never following a link: one swapped in for the folder is removed, not emptied.
        with contextlib.suppress(OSError):
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                for name in os.listdir(root_fd):
                    if name != _LOCK_NAME:
                        trash.remove_entry(root_fd, name)
            finally:
                os.close(root_fd)
        with contextlib.suppress(OSError):
            parent_fd = os.open(self.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                trash.remove_entry(parent_fd, os.path.basename(self.root))
            finally:
                os.close(parent_fd)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _clean_stale(self) -> None:
        prefix = f"{self.stem}{_STAGING_TAG}"
        for name in os.listdir(self.parent):
            if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
                continue
            folder = os.path.join(self.parent, name)
            try:
                fd = os.open(os.path.join(folder, _LOCK_NAME), os.O_RDWR)
            except OSError:  # no lock (yet): being created, or not ours to judge
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CkptctlError(
                    f"another conversion into {self.dst} is running ({folder})",
                    "wait for it to finish, or stop it; its staging folder is removed by the next run",
                ) from None
            else:
                shutil.rmtree(folder, ignore_errors=True)
            finally:
                os.close(fd)

    def commit(self, force: bool, progress: Progress, last: Sequence[str] | None = None) -> int:
        """Move `out/` to DST (`io.commit.install`: a plain rename, or an atomic exchange with a non-empty DST
        under `force`, whose old content is then deleted). Returns the bytes uploaded: none. (`last` is for
        an upload: one rename publishes every file at once.)"""
        io.fsync_dir(self.out)
        dst = self.dst
        if os.path.isdir(dst) and os.listdir(dst) and not force:
            raise CkptctlError(f"{dst} was filled while the output was being written", "pass --force to replace it")
        try:
            replaced = install(self.out, dst)
        except OSError as exc:
            raise StorageError(f"cannot move the output into {dst}: {exc.strerror or exc}") from exc
        if replaced is not None:
            trash.purge(replaced)
        return 0


def staging_for(dst: str, layout: Layout | None = None) -> Staging:
    """Where an output for `dst` (as `check_destination` returned it) is written and how it is committed: a
    local DST is staged beside it and renamed into place, any other is staged in `TMPDIR` and uploaded
    (`layout`: see `UploadStaging`). The one place a command's output path branches on the storage."""
    return Staging(dst) if io.is_local(dst) else UploadStaging(dst, layout)  # rename, or upload in order


class UploadStaging(Staging):
    """The local folder an output for an object store is written into, and its upload.

    `.ckptctl-upload-<hash of DST>.ckptctl-convert-<pid>/` in the temporary folder (`TMPDIR`), locked like
    a staging folder next to a local DST: a conversion into the same DST that runs on this machine is
    refused, and one that was killed has its staging folder removed by the next.
    """

    def __init__(self, dst: str, layout: Layout | None = None, rank: int = 0) -> None:
        """`layout`: what the output is, whose completion markers go up last (None: the output says at the
        commit, `last`); `rank`: the rank of a job that stages its share of the output here (the other
        ranks' folders are not its competitors, even on the same host)."""
        digest = hashlib.sha256(dst.encode()).hexdigest()[:16]
        suffix = f"-rank{rank}" if rank else ""
        super().__init__(dst, tempfile.gettempdir(), f".ckptctl-upload-{digest}{suffix}")
        self.layout = layout

    def check_space(self, tensor_bytes: int) -> None:
        """Raise `StorageError` when the temporary folder's disk cannot hold an output of `tensor_bytes`
        (before converting, rather than on a full disk halfway)."""
        try:
            usage = shutil.disk_usage(self.root)
        except OSError:
            return
        need = tensor_bytes + (1 << 20)  # headers, index, config
        if usage.total and usage.free < need:
            raise StorageError(
                f"staging the output for {self.dst} needs {need} bytes in {self.parent}, which has {usage.free} free",
                "point TMPDIR at a folder on a disk with room for the output (it is uploaded from there)",
            )

    def commit(
        self, force: bool, progress: Progress, last: Sequence[str] | None = None, ranks: Ranks | None = None
    ) -> int:
        """Upload `out/` to DST in `_upload_order`, then, once a listing shows every object with its size,
        the digests; returns the bytes uploaded. What goes up last, one file after another, is `last` when
        given (`published_last`), else the completion markers of the output's layout.

        Objects that appeared below DST while the output was written are refused without `force` and deleted first
        with it. A failed upload deletes what it uploaded (the old objects, under `force`, are gone).

        Over a job's `ranks` (all of them call this), each rank holds its share of the output in its own
        staging folder (rank 0: the index, side files and digests too), and the order is one process's,
        batch by batch, each rank putting its own files of a batch and every rank waiting for the others
        before the next: rank 0 clears DST, the ranks upload every file but the completion markers, each
        marker goes up from the rank that wrote it, and last rank 0 checks the listing and puts the
        digests. A rank that fails or dies makes every rank delete what it put (a killed rank's objects
        stay, and nothing lists complete without the markers that come after them).
        """
        shares = [self._sizes()] if ranks is None else ranks.each(self._sizes)
        rank = 0 if ranks is None else ranks.rank
        sizes = {rel: size for share in shares for rel, size in share.items()}
        owner = {rel: holder for holder, share in enumerate(shares) for rel in share}
        upload = ObjectStoreUpload(self.out, self.dst, _markers, lambda rel: progress.advance(sizes[rel]))

        def finish() -> None:
            self._check_uploaded({rel: size for rel, size in sizes.items() if rel != DIGESTS_NAME})
            upload.finish(DIGESTS_NAME)

        _everyone(ranks, lambda: None, lambda: self._clear(upload, force))
        progress.start("uploading", sum(shares[rank].values()))
        try:
            if last is None:
                last = self.layout.completion_markers(sizes) if self.layout is not None else ()
            last = [rel for rel in last if rel in sizes]  # a listed file no rank staged has nothing to upload
            for batch in _upload_order(sizes, last):
                mine = [rel for rel in batch if owner[rel] == rank]
                _everyone(ranks, functools.partial(upload.upload, [mine]))
            _everyone(ranks, lambda: None, finish)
        except BaseException:
            with contextlib.suppress(Exception):
                upload.undo()
            raise
        finally:
            progress.finish()
        return sum(sizes.values())

    def _sizes(self) -> dict[str, int]:
        """The staged files, relative path -> size."""
        return {
            os.path.relpath(os.path.join(root, name), self.out).replace(os.sep, "/"): os.path.getsize(
                os.path.join(root, name)
            )
            for root, _dirs, names in os.walk(self.out)
            for name in names
        }

    def _clear(self, upload: ObjectStoreUpload, force: bool) -> None:
        """Refuse objects that appeared below DST while the output was written, or delete them under `force`."""
        existing = io.list_tree(self.dst)
        if existing:
            if not force:
                raise CkptctlError(
                    f"{self.dst} was filled while the output was being written", "pass --force to replace it"
                )
            upload.clear({rel: entry.size for rel, entry in existing.items()})

    def _check_uploaded(self, sizes: Mapping[str, int]) -> None:
        """Every uploaded object is listed with the size of its local file (before the digests go up)."""
        listed = {rel: entry.size for rel, entry in io.list_tree(self.dst).items()}
        wrong = sorted(rel for rel, size in sizes.items() if listed.get(rel) != size)
        if wrong:
            raise StorageError(
                f"the object store lists {wrong[0]} below {self.dst} "
                + ("as missing" if wrong[0] not in listed else f"with {listed[wrong[0]]} bytes, not {sizes[wrong[0]]}"),
                "another writer may be using the same prefix; run again with --force",
            )


def _everyone(ranks: Ranks | None, work: Callable[[], object], leader: Callable[[], object] | None = None) -> None:
    """`work()` on every rank (`leader()` instead on rank 0, when given), every rank waiting for all of
    them and failing when one fails; in this process alone without `ranks`."""
    if ranks is None:
        (leader or work)()
    else:
        ranks.each(leader if leader is not None and ranks.leader else work)


def _upload_order(sizes: Mapping[str, int], markers: Sequence[str]) -> list[list[str]]:
    """Batches of an output's files (the digests aside, which go up last) to upload one after another,
    each batch in parallel: every file but the completion markers of its layout (the largest first, so
    that the long transfers start first), then each marker in its layout's order. Until the last is up,
    the prefix lists as broken or in progress, or holds no checkpoint at all."""
    rest = sorted(
        (rel for rel in sizes if rel not in markers and rel != DIGESTS_NAME), key=lambda rel: (-sizes[rel], rel)
    )
    return [batch for batch in (rest, *([marker] for marker in markers)) if batch]


def published_last(files: Sequence[str]) -> tuple[str, ...]:
    """What of an output whose writer lists its `files` in an order a commit may publish them (markers, trackers
    and pointers last: `contract.capabilities.WrittenState.files`) goes up last, one after another, in that
    order: every completion marker that a layout names among them (of any folder, `_any_markers`: an output may
    hold several checkpoints, a run folder's steps or a save folder's tag) and every file after the last of
    those (the pointers and trackers). Everything before goes up first, in parallel."""
    markers = _any_markers(files)
    after = max((i for i, rel in enumerate(files) if rel in markers), default=-1) + 1
    return (*(rel for rel in files[:after] if rel in markers), *files[after:])


def _markers(files: Mapping[str, int]) -> Tiers:
    """What to delete first of the objects `files` below a DST (`io.trash.Markers`), so that no moment of it
    passes for a complete checkpoint: the digests, then what any layout names as a completion marker of
    any folder among them; the rest after."""
    first = {rel for rel in files if posixpath.basename(rel) == DIGESTS_NAME}
    return [first, _any_markers(files) - first]


def _any_markers(rels: Collection[str]) -> set[str]:
    """The completion markers every layout names for each folder among `rels` (an old output or a killed
    upload may be of any layout). Which one of several equal markers (shards) goes first does not matter
    here, so sizes are not asked for: every file counts as empty."""
    folders = {""}
    for rel in rels:
        parts = rel.split("/")[:-1]
        folders.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    found: set[str] = set()
    for folder in folders:
        prefix = f"{folder}/" if folder else ""
        files = dict.fromkeys((rel[len(prefix) :] for rel in rels if rel.startswith(prefix)), 0)
        for layout in all_layouts():
            found.update(prefix + marker for marker in layout.completion_markers(files))
    return found
