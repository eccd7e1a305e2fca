"""Where a `CheckpointManager` run lives: the seam between a local folder and a folder of an object store.

The manager's save, restore and retention are written once, against `RunStorage`; what differs between a
local disk and an object store is here, in two implementations:

- `LocalRun`: a save is staged next to its target (the ranks of a multi-rank save share the folder) and
  committed by `io.commit`'s rename; a restore loads the step folder in place.
- `RemoteRun` (`s3://`, any fsspec URL): a save is staged in a local folder (`staging_dir`, one per rank)
  and committed by an upload with the manifest last; a restore downloads the step into a local temporary
  folder, checking every file's size and blake3 digest as it arrives.

The commit itself is written once (`RunStorage.prepare`/`share`/`commit`) over `io.commit.Publish`, which is
a rename or an upload by the storage of the run.

Both delete through `io.trash` (a rename into the trash, or the manifest first).
"""

from __future__ import annotations

import abc
import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta

import blake3

from ckptctl import io
from ckptctl.errors import CorruptCheckpoint, StorageError
from ckptctl.formats.digest import file_digest
from ckptctl.formats.documents import MAX_JSON_BYTES
from ckptctl.formats.manifest import MANIFEST_NAME, FileRecord, Manifest, parse_manifest
from ckptctl.formats.native import (
    SUPERSEDED_NAME,
    WRITER_NAME,
    StepNaming,
    abandoned_staging,
    completion_markers,
    is_rng_file,
    superseded_marker,
)
from ckptctl.formats.slim_marker import SLIM_MARKER
from ckptctl.io import trash
from ckptctl.io.commit import Publish, publisher
from ckptctl.io.process import ProcessRecord
from ckptctl.io.trash import Retired, Tiers

__all__ = ["LocalRun", "RemoteRun", "RunStorage", "markers", "open_run"]


def markers(files: Mapping[str, int]) -> Tiers:
    """What a step's deletion removes first: the native format's completion markers (the manifest), the
    last one written first."""
    return [[name] for name in reversed(completion_markers(files))]


#: `fetch(step)` of `RunStorage.fetcher`: the local folder holding the step's files.
Fetch = Callable[[int], str]


class RunStorage(abc.ABC):
    """The run folder of a manager, on one kind of storage.

    Attributes:
        root: the run folder (an absolute local path, or a URL without a trailing `/`).
        naming: the names of its step folders.
        shared_staging: whether the ranks of a multi-rank save write into one staging folder (rank 0 then
            creates and removes it) or each into its own.
        fetch_may_fail: whether `fetcher`'s `fetch` can fail on one rank alone (a download), so that the ranks
            of a restore must agree on its outcome before loading; a local step is loaded in place.
    """

    shared_staging: bool
    fetch_may_fail: bool

    def __init__(self, root: str, naming: StepNaming) -> None:
        self.root = root
        self.naming = naming

    def step_dir(self, step: int) -> str:
        """The folder of a committed step (whether or not it exists)."""
        return io.join(self.root, self.naming.folder(step))

    @abc.abstractmethod
    def committed(self) -> dict[int, float]:
        """Step -> modification time of its manifest, for every committed step (a `step-{N}` folder
        holding a manifest)."""

    @abc.abstractmethod
    def staging(self, step: int, token: str) -> str:
        """The local folder a save of `step` is written into before it is committed (not created)."""

    def begin(self, staging: str) -> None:
        """Create the staging folder of a save (rank 0's, for a multi-rank save).

        Raises:
            OSError: it cannot be created.
        """
        os.makedirs(staging)

    def prepare(self, step: int) -> None:
        """Called on rank 0 before the ranks of a multi-rank save write anything: where the commit cannot
        replace the old step whole (an upload), the old step goes first, its manifest first."""
        self._publish(step, "").clear()

    def share(self, step: int, staging: str, names: Sequence[str]) -> None:
        """Make one rank's files `names` of a multi-rank save reachable by rank 0's `commit` (an upload puts
        them; a shared local staging folder holds them already). Rank 0 adds DCP's metadata, which names every
        shard, in `commit`."""
        self._publish(step, staging).upload(_upload_batches([n for n in names if not _is_dcp_metadata(n)]))

    def commit(self, step: int, staging: str, manifest: Manifest) -> Retired | None:
        """Commit the staged save of `step` with `manifest` last (not the `latest` pointer); return the
        checkpoint it replaced, retired, for the caller to purge (`io.commit`: a rename, or an upload)."""
        # The writer's record goes before the commit: a committed folder holds what its manifest lists.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(staging, WRITER_NAME))
        publish = self._publish(step, staging)
        if manifest.world_size == 1:
            publish.clear()  # re-saving a step: no file of the old save may survive
            publish.upload(_upload_batches(list(manifest.files)))
        else:  # the ranks have shared their files; DCP's metadata names them all, so it goes after
            publish.upload([[f for f in manifest.files if _is_dcp_metadata(f)]])
        return publish.finish(MANIFEST_NAME, manifest.to_json())

    def _publish(self, step: int, staging: str) -> Publish:
        return publisher(staging, self.step_dir(step), markers)

    @abc.abstractmethod
    def fetcher(self) -> contextlib.AbstractContextManager[Fetch]:
        """A context giving `fetch(step)`: the local folder holding that step's files for a restore.

        Raises (from `fetch`):
            CorruptCheckpoint: a file differs from the manifest (found while fetching).
            StorageError: the transfer failed.
        """

    def check_digests(self, folder: str, manifest: Manifest) -> str | None:
        """Why a step's files do not match their blake3 digests, or None (see `fetcher` for remote steps)."""
        for rel, record in manifest.files.items():
            if file_digest(os.path.join(folder, rel)) != record.blake3:
                return f"{rel} does not match its blake3 digest"
        return None

    def leftovers(self) -> str | None:
        """The folder holding what an interrupted deletion left (for `trash.empty`), or None."""
        return None

    def abandoned(self, grace: timedelta) -> list[tuple[str, str]]:
        """The staging folders in the run that saves left when their writers stopped, with why
        (`abandoned_staging`); none where saves are staged outside the run."""
        return []

    def superseded(self) -> set[int]:
        """The committed steps marked superseded (`SUPERSEDED_NAME`)."""
        return {step for step in self.committed() if io.exists(io.join(self.step_dir(step), SUPERSEDED_NAME))}

    def slimmed(self) -> set[int]:
        """The committed steps `slim` dropped the training-only state of (`SLIM_MARKER`)."""
        return {step for step in self.committed() if io.exists(io.join(self.step_dir(step), SLIM_MARKER))}

    def supersede(self, step: int, by: int) -> None:
        """Mark the committed `step` superseded by a save of `by` (one atomic write, or one PUT)."""
        io.write_bytes_atomic(io.join(self.step_dir(step), SUPERSEDED_NAME), superseded_marker(by))

    def retire(self, step: int) -> Retired:
        """Take a committed step out of sight at once (`io.trash`); its deletion is `trash.purge`."""
        return trash.retire(self.step_dir(step), markers)


class LocalRun(RunStorage):
    """A run folder on a local (or network-mounted) filesystem."""

    shared_staging = True
    fetch_may_fail = False  # `fetch` is `step_dir`

    def __init__(self, root: str, naming: StepNaming) -> None:
        super().__init__(os.path.abspath(io.local_path(root)), naming)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the run folder {self.root}: {exc.strerror or exc}") from exc

    def leftovers(self) -> str | None:
        folder = os.path.join(self.root, trash.TRASH_NAME)
        if not os.path.lexists(folder):
            return None
        trash.check_trash(folder)  # a link in its place: refused here, before retention moves anything
        return folder

    def committed(self) -> dict[int, float]:
        found = {}
        try:
            with os.scandir(self.root) as it:
                for entry in it:
                    step = self.naming.step_of(entry.name)
                    if step is None or not entry.is_dir():
                        continue
                    with contextlib.suppress(OSError):
                        found[step] = os.stat(os.path.join(entry.path, MANIFEST_NAME)).st_mtime
        except FileNotFoundError:  # the run folder was removed under us: it holds nothing
            return {}
        return found

    def staging(self, step: int, token: str) -> str:
        return os.path.join(self.root, self.naming.staging(step, token))

    def begin(self, staging: str) -> None:
        # Who writes it: its name says so from the start (`staging_token`, pid and machine); the record adds
        # the host name and the process start time (a pid reused since the kill).
        os.makedirs(staging)
        io.write_bytes_atomic(os.path.join(staging, WRITER_NAME), ProcessRecord.current().to_json())

    def abandoned(self, grace: timedelta) -> list[tuple[str, str]]:
        found = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as it:
            for entry in it:
                if self.naming.staging_step(entry.name) is not None and entry.is_dir(follow_symlinks=False):
                    why = abandoned_staging(entry.path, grace)
                    if why:
                        found.append((entry.path, why))
        return found

    def superseded(self) -> set[int]:
        return {step for step in self.committed() if os.path.exists(os.path.join(self.step_dir(step), SUPERSEDED_NAME))}

    @contextlib.contextmanager
    def fetcher(self) -> Iterator[Fetch]:
        yield self.step_dir


class RemoteRun(RunStorage):
    """A run folder on an object store: no folders, no rename; a PUT is atomic."""

    shared_staging = False
    fetch_may_fail = True  # a download, checked as it arrives

    def __init__(self, root: str, naming: StepNaming, staging_dir: str | None = None) -> None:
        super().__init__(root.rstrip("/"), naming)
        self.staging_dir = staging_dir
        # Fail here, not at the first save an hour into training: credentials, bucket, endpoint.
        io.is_dir(self.root)

    def committed(self) -> dict[int, float]:
        found = {}
        for rel, entry in io.list_tree(self.root).items():  # one listing of the run
            folder, _, name = rel.partition("/")
            step = self.naming.step_of(folder)
            if step is not None and name == MANIFEST_NAME:
                found[step] = entry.mtime
        return found

    def superseded(self) -> set[int]:
        listed = io.list_tree(self.root)  # one listing of the run, not a request per step
        return {
            step
            for rel in listed
            if rel.endswith(f"/{SUPERSEDED_NAME}")
            and (step := self.naming.step_of(rel.partition("/")[0])) is not None
            and f"{self.naming.folder(step)}/{MANIFEST_NAME}" in listed
        }

    def staging(self, step: int, token: str) -> str:
        # The same name on every rank: ranks on one node share the folder (their files differ).
        base = self.staging_dir or tempfile.gettempdir()
        return os.path.join(base, f"ckptctl-upload-{self.naming.staging(step, token).lstrip('.')}")

    @contextlib.contextmanager
    def fetcher(self) -> Iterator[Fetch]:
        folder = tempfile.mkdtemp(prefix="ckptctl-restore-", dir=self.staging_dir)

        def fetch(step: int) -> str:
            shutil.rmtree(folder, ignore_errors=True)  # what an earlier, failed try left
            os.makedirs(folder)
            self._download(step, folder)
            return folder

        try:
            yield fetch
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def check_digests(self, folder: str, manifest: Manifest) -> str | None:
        return None  # checked by `fetch`, as the files arrive

    def _download(self, step: int, folder: str) -> None:
        """Download a remote step's files into `folder` in parallel, hashing each as it arrives.

        Raises:
            CorruptCheckpoint: a file's size or blake3 digest differs from the manifest.
        """
        source = self.step_dir(step)
        data = io.read_bytes(io.join(source, MANIFEST_NAME), max_size=MAX_JSON_BYTES)
        manifest = parse_manifest(data, io.join(source, MANIFEST_NAME))
        for rel in manifest.files:
            os.makedirs(os.path.dirname(os.path.join(folder, rel)), exist_ok=True)

        # Range reads of one file in flight at once: all of the pool for one big file, one each for many.
        per_file = max(1, io.workers() // max(1, len(manifest.files)))

        def fetch(item: tuple[str, FileRecord]) -> str | None:
            rel, record = item
            hasher = blake3.blake3()
            size = io.download_file(io.join(source, rel), os.path.join(folder, rel), hasher.update, per_file)
            if size != record.size:
                return f"{rel} has {size} bytes, the manifest says {record.size}"
            if hasher.hexdigest() != record.blake3:
                return f"{rel} does not match its blake3 digest"
            return None

        items = sorted(manifest.files.items(), key=lambda item: -item[1].size)
        with storage_errors(f"downloading step {step} from {self.root}"):
            problems = [p for p in io.parallel_map(fetch, items) if p]
            with open(os.path.join(folder, MANIFEST_NAME), "wb") as f:
                f.write(data)
        if problems:
            raise CorruptCheckpoint(f"{source}: {'; '.join(problems)}", "restore another step")


def open_run(root: str, naming: StepNaming, staging_dir: str | None = None) -> RunStorage:
    """The storage of the run folder `root`: a local path (created if missing) or an fsspec URL.

    Raises:
        StorageError: the folder cannot be created, or the object store cannot be reached.
        CheckpointNotFound: the bucket does not exist.
    """
    if io.is_local(root):  # the one choice of the run's protocol: staged beside and renamed, or uploaded
        return LocalRun(root, naming)
    return RemoteRun(root, naming, staging_dir)


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Turn OS errors into a `StorageError` that says what was being done."""
    try:
        yield
    except OSError as exc:
        hint = "free some space" if exc.errno == errno.ENOSPC else "check the folder's permissions and free space"
        raise StorageError(f"{what} failed: {exc.strerror or exc}", hint) from exc


def _upload_batches(names: list[str]) -> list[list[str]]:
    """The order a save's files go up in: RNG files first (they make a partial upload read as ours and in
    progress), then the rest."""
    return [[n for n in names if is_rng_file(n)], [n for n in names if not is_rng_file(n)]]


def _is_dcp_metadata(rel: str) -> bool:
    """DCP's `.metadata` (and any other non-shard file of `dcp/`): it names every shard, so it is uploaded last."""
    return rel.startswith("dcp/") and not rel.endswith(".distcp")
