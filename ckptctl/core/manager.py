"""`CheckpointManager`: save and restore the training state of a run in the native format.

The on-disk format is docs/native-format.md. The commit protocol makes a crash at any moment harmless:

1. write every file into `.step-{N}.staging-{token}/` next to the target (hashing while writing, fsync);
2. write `ckptctl-manifest.json` last (its presence is the commit), fsync it and the folder;
3. rename the folder to `step-{N}` (atomically swapping with an existing `step-{N}` when re-saving), fsync root;
4. replace the `latest` pointer atomically; then apply retention.

A crash before 3 leaves a staging folder (recognisably in progress) and the previous checkpoint and pointer
untouched; a crash between 3 and 4 leaves a committed checkpoint the pointer does not name yet, which
`latest_step()` still finds because it walks the committed folders, newest first.

On an object store (`s3://bucket/run`, any fsspec URL) there is no atomic folder rename, so the manifest is
the commit marker on its own:

1. write every file into a local staging folder (as above; `staging_dir`, default the system temp folder);
2. when re-saving a step, delete the old `step-{N}/` manifest first, then the rest of it;
3. upload into the final `step-{N}/` prefix: the RNG files first (so that a partial prefix is recognisably
   ours), then the data files in parallel, DCP's `.metadata` after every rank's shards;
4. upload `ckptctl-manifest.json` last (a single PUT is atomic), then the `latest` pointer; then retention
   (which deletes a step's manifest before the rest of it).

A crash before 4 leaves a `step-{N}/` without a manifest, which `all_steps()` ignores and `ckptctl list`
shows as in progress (then broken, once it is old); the previous checkpoint and pointer stay untouched.
Restoring downloads the chosen step into a local temporary folder, checking every file's size and blake3
digest as it arrives, and loads from there.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import platform
import secrets
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import blake3
import numpy as np
import torch

import ckptctl
from ckptctl import io
from ckptctl.core import distributed as dist_
from ckptctl.core import rng
from ckptctl.core.entries import CheckpointWarning, check_name, kind_of, load_into, state_of
from ckptctl.core.retention import Candidate, RetentionPolicy
from ckptctl.errors import CheckpointNotFound, CkptctlError, CorruptCheckpoint, SerializationError, StorageError
from ckptctl.formats import state_tree
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import MANIFEST_NAME, ComponentRecord, FileRecord, Manifest, now_iso, parse_manifest
from ckptctl.formats.state_tree import EncodedTree
from ckptctl.frameworks.native.layout import POINTER_NAME, StepNaming, is_rng_file
from ckptctl.io import commit, trash
from ckptctl.io.trash import TRASH_NAME
from ckptctl.layouts.base import folder_size

__all__ = ["POINTER_NAME", "TRASH_NAME", "CheckpointManager", "StepNaming"]

log = logging.getLogger("ckptctl.core")

#: The file whose presence commits a step: deleted first, uploaded last.
_MARKERS = ((MANIFEST_NAME,),)
#: Entry kinds that a multi-rank save stores through torch DCP.
_SHARDED_KINDS = ("module", "optimizer")


@dataclass(frozen=True, slots=True)
class _EntrySnapshot:
    name: str
    kind: str
    encoded: EncodedTree
    extra: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """Everything a save writes, taken from the live state: tensors on CPU, the rest as JSON-ready trees."""

    entries: tuple[_EntrySnapshot, ...]
    rng: EncodedTree
    sharded: Mapping[str, tuple[str, Any]]
    modules: Mapping[str, torch.nn.Module]


class _Stager:
    """Copies tensors into CPU buffers kept from one async save to the next.

    Reusing the buffers means the training loop pays for a memory copy only, not for allocating (and
    page-faulting) a fresh copy of the whole state on every save. The next save starts only after the
    previous one has finished writing, so a buffer is never overwritten while it is being written out.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()
        self._pin = torch.cuda.is_available()
        self._cuda_copies = False

    def for_entry(self, entry: str) -> state_tree.Stage:
        def stage(key: str, tensor: torch.Tensor) -> torch.Tensor:
            slot = f"{entry}/{key}"
            buf = self._buffers.get(slot)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
                self._buffers[slot] = buf
            self._cuda_copies |= tensor.is_cuda
            buf.copy_(tensor, non_blocking=tensor.is_cuda)
            self._used.add(slot)
            return buf

        return stage

    def finish(self) -> None:
        """Wait for device copies and release the buffers of tensors the state no longer has."""
        if self._cuda_copies:
            torch.cuda.synchronize()
        for slot in set(self._buffers) - self._used:
            del self._buffers[slot]
        self._used.clear()
        self._cuda_copies = False


class CheckpointManager:
    """Saves and restores a training state as native checkpoints under one run folder.

    The state is a dict of modules, optimizers, LR schedulers, objects with `state_dict()`/
    `load_state_dict()` (a resumable sampler) and plain values. Random generator states are saved and
    restored with every checkpoint without being asked.

    When `torch.distributed` is initialised with more than one rank, module and optimizer entries are
    saved through torch DCP (sharded, reshardable) and rank 0 commits; every rank must call `save` and
    `restore`. Multi-rank saves are synchronous even with `async_save=True`.

    Args:
        root: the run folder: a local path (created if missing) or an fsspec URL such as
            `s3://bucket/runs/exp1` (credentials and endpoint from the standard AWS settings).
        policy: retention applied after each commit; None keeps everything.
        async_save: return from `save` once the state is copied to CPU memory and write in a background
            thread. The copy buffers are kept for the next save (one CPU copy of the state stays allocated).
        staging_dir: for a remote `root`, the local folder where a save is written before it is uploaded
            and a restore is downloaded before it is loaded (default: the system temp folder); it needs
            room for one checkpoint.

    Example:
        >>> manager = CheckpointManager("runs/exp1", policy=RetentionPolicy(keep_last=3))
        >>> state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
        >>> start = manager.restore(state) + 1 if manager.latest_step() is not None else 0
        >>> for step in range(start, total):
        ...     train_step()
        ...     if step % 100 == 0:
        ...         manager.save(step, state, metrics={"loss": loss})
        >>> manager.wait()
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        policy: RetentionPolicy | None = None,
        async_save: bool = False,
        *,
        staging_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        url = os.fspath(root)
        self.policy = policy
        self.async_save = async_save
        self.naming = StepNaming()
        self.staging_dir = None if staging_dir is None else os.fspath(staging_dir)
        self._remote = not io.is_local(url)
        if self._remote:
            self.root = url.rstrip("/")
            # Fail here, not at the first save an hour into training: credentials, bucket, endpoint.
            io.is_dir(self.root)
        else:
            self.root = os.path.abspath(io.local_path(url))
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as exc:
                raise StorageError(f"cannot create the run folder {self.root}: {exc.strerror or exc}") from exc
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stager = _Stager()

    # ------------------------------------------------------------------ queries

    def step_dir(self, step: int) -> str:
        """The folder of a committed step (whether or not it exists)."""
        return io.join(self.root, self.naming.folder(step))

    def all_steps(self) -> list[int]:
        """Committed steps (a `step-{N}` folder holding a manifest), sorted ascending; not validated."""
        if self._remote:
            return sorted(self._remote_manifests())
        steps = []
        try:
            with os.scandir(self.root) as it:
                for entry in it:
                    step = self.naming.step_of(entry.name)
                    if step is not None and entry.is_dir() and os.path.exists(os.path.join(entry.path, MANIFEST_NAME)):
                        steps.append(step)
        except FileNotFoundError:  # the run folder was removed under us: it holds nothing
            return []
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest committed step whose manifest parses and whose files are all there at their size.

        This is the step `restore(state)` picks; None when the run has no usable checkpoint.
        """
        for step in reversed(self.all_steps()):
            if self._problem(step, verify=False) is None:
                return step
        return None

    def _remote_manifests(self) -> dict[int, io.DirEntry]:
        """Step -> manifest object of every committed step of a remote run (one listing of the run)."""
        found = {}
        for rel, entry in io.list_tree(self.root).items():
            folder, _, name = rel.partition("/")
            step = self.naming.step_of(folder)
            if step is not None and name == MANIFEST_NAME:
                found[step] = entry
        return found

    def pointer(self) -> str | None:
        """The folder name the `latest` file names, or None when there is none."""
        if self._remote:
            try:
                return io.read_text(io.join(self.root, POINTER_NAME)).strip() or None
            except (CheckpointNotFound, CorruptCheckpoint):
                return None
        try:
            with open(os.path.join(self.root, POINTER_NAME), encoding="utf-8") as f:
                return f.read().strip() or None
        except (FileNotFoundError, UnicodeDecodeError):
            return None

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None) -> None:
        """Save `state` as step `step`, replacing a checkpoint of that step if there is one.

        With `async_save`, returns once the state is copied to CPU memory; the write and the commit run
        in a background thread (see `wait`).

        Args:
            step: the global step (a non-negative integer).
            state: entry name -> module, optimizer, scheduler, stateful object or plain value.
            metrics: JSON-able numbers and strings recorded in the manifest (an `epoch` key also fills the
                manifest's `epoch`).

        Raises:
            SerializationError: an entry holds a value that cannot be stored without pickle.
            StorageError: writing failed (also a failure of the previous background save).
        """
        self._join()
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step must be a non-negative integer, not {step!r}")
        step = int(step)
        clean_metrics = _plain_metrics(metrics)
        world = dist_.current_world()
        if world.multi:
            self._save_multi_rank(step, state, clean_metrics, world)
            return
        if not self.async_save:
            self._commit_single(step, self._snapshot(state, world, copy=False), clean_metrics)
            return
        started = time.perf_counter()
        snapshot = self._snapshot(state, world, copy=True)
        log.debug("step %d staged in CPU memory in %.3fs", step, time.perf_counter() - started)
        self._thread = threading.Thread(
            target=self._background, args=(step, snapshot, clean_metrics), name=f"ckptctl-save-{step}"
        )
        self._thread.start()

    def wait(self) -> None:
        """Block until a background save has committed; re-raise its error if it failed."""
        self._join()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _background(self, step: int, snapshot: _Snapshot, metrics: dict[str, Any]) -> None:
        try:
            self._commit_single(step, snapshot, metrics)
        except BaseException as exc:  # handed to the training thread on its next call
            self._error = exc

    def _snapshot(self, state: Mapping[str, Any], world: dist_.World, *, copy: bool) -> _Snapshot:
        if not isinstance(state, Mapping):
            raise SerializationError(f"state must be a dict of entries, not {type(state).__name__}")
        entries = []
        sharded: dict[str, tuple[str, Any]] = {}
        modules = {}
        for name, obj in state.items():
            check_name(name)
            kind = kind_of(name, obj)
            if kind == "module":
                modules[name] = obj
            if world.multi and kind in _SHARDED_KINDS:
                sharded[name] = (kind, obj)
                continue
            if world.rank != 0:  # rank 0 alone writes the unsharded entries
                continue
            value, extra = state_of(kind, obj)
            stage = self._stager.for_entry(name) if copy else None
            encoded = state_tree.encode(value, name=f"state[{name!r}]", root_key=name, stage=stage)
            entries.append(_EntrySnapshot(name, kind, encoded, extra))
        rng_tree = state_tree.encode(rng.capture(), name="rng", stage=self._stager.for_entry("rng") if copy else None)
        if copy:
            self._stager.finish()
        return _Snapshot(tuple(entries), rng_tree, sharded, modules)

    def _commit_single(self, step: int, snapshot: _Snapshot, metrics: dict[str, Any]) -> None:
        started = time.perf_counter()
        staging = self._local_staging(step, secrets.token_hex(4))
        try:
            with _storage_errors(f"saving step {step} into {self.root}"):
                os.makedirs(staging, exist_ok=self._remote)
                files: dict[str, FileRecord] = {}
                components: dict[str, ComponentRecord] = {}
                for entry in snapshot.entries:
                    written = _write_tree(staging, entry.name, entry.encoded, entry.extra, files)
                    components[entry.name] = ComponentRecord(entry.kind, "safetensors", written)
                components["rng"] = ComponentRecord(
                    "rng", "safetensors", _write_tree(staging, "rng", snapshot.rng, {}, files)
                )
                self._commit(step, staging, files, components, metrics, world_size=1)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if self._remote:
            shutil.rmtree(staging, ignore_errors=True)
        size = sum(r.size for r in files.values())
        elapsed = time.perf_counter() - started
        log.info("saved step %d: %.1f MB in %.2fs", step, size / 1e6, elapsed)
        self._apply_retention()

    def _local_staging(self, step: int, token: str) -> str:
        """Where a save is written before it is committed: next to the target locally; for a remote run, a
        local folder named the same on every rank (ranks on one node share it: their files differ)."""
        if not self._remote:
            return os.path.join(self.root, self.naming.staging(step, token))
        base = self.staging_dir or tempfile.gettempdir()
        return os.path.join(base, f"ckptctl-upload-{self.naming.staging(step, token).lstrip('.')}")

    def _save_multi_rank(
        self, step: int, state: Mapping[str, Any], metrics: dict[str, Any], world: dist_.World
    ) -> None:
        # Every rank reaches every collective below, whatever fails locally: a rank that raised early
        # would leave the others waiting forever. Local failures travel with the gathered results.
        staging, error = None, None
        if world.rank == 0:
            staging = self._local_staging(step, secrets.token_hex(4))
            try:
                if self._remote:
                    self._clear_remote_step(step)
                else:
                    os.makedirs(os.path.join(staging, "dcp"))
            except OSError as exc:
                error = f"cannot create {staging}: {exc.strerror or exc}"
            except CkptctlError as exc:
                error = str(exc)
        staging, error = dist_.broadcast((staging, error))
        if error:
            raise StorageError(error)
        assert staging is not None
        if self._remote:
            try:
                os.makedirs(os.path.join(staging, "dcp"), exist_ok=True)
            except OSError as exc:
                raise StorageError(f"cannot create {staging}: {exc.strerror or exc}") from exc

        local: BaseException | None = None
        snapshot = None
        try:
            snapshot = self._snapshot(state, world, copy=False)
        except CkptctlError as exc:
            local = exc
        self._agree(world, staging, local, "preparing the state")
        assert snapshot is not None

        dcp_dir = os.path.join(staging, "dcp")
        try:
            if snapshot.sharded:
                dist_.save_dcp(dcp_dir, snapshot.sharded, snapshot.modules)
        except BaseException:
            if world.rank == 0 or self._remote:
                shutil.rmtree(staging, ignore_errors=True)
            raise

        files: dict[str, FileRecord] = {}
        components: dict[str, ComponentRecord] = {}
        rng_files: tuple[str, ...] = ()
        try:
            with _storage_errors(f"saving step {step} into {self.root}"):
                rng_files = _write_tree(staging, f"rng.rank-{world.rank}", snapshot.rng, {}, files)
                for entry in snapshot.entries:
                    components[entry.name] = ComponentRecord(
                        entry.kind, "safetensors", _write_tree(staging, entry.name, entry.encoded, entry.extra, files)
                    )
                for name in dist_.dcp_files_of_rank(dcp_dir, world):
                    path = os.path.join(dcp_dir, name)
                    files[f"dcp/{name}"] = FileRecord(os.path.getsize(path), file_digest(path))
            if self._remote:
                # Every rank uploads what it wrote; rank 0 adds DCP's metadata once all shards are up.
                self._upload(step, staging, [f for f in files if not _is_dcp_metadata(f)])
        except BaseException as exc:
            local = exc
        gathered = dist_.all_gather((files, rng_files, _describe(local)))

        status = None
        if world.rank == 0:
            failures = [f"rank {r}: {msg}" for r, (_, _, msg) in enumerate(gathered) if msg]
            if failures:
                status = "; ".join(failures)
                if not self._remote:
                    shutil.rmtree(staging, ignore_errors=True)
            else:
                all_files = {k: v for rank_files, _, _ in gathered for k, v in rank_files.items()}
                dcp_files = tuple(sorted(k for k in all_files if k.startswith("dcp/")))
                for name, (kind, _) in snapshot.sharded.items():
                    components[name] = ComponentRecord(kind, "dcp", dcp_files)
                components["rng"] = ComponentRecord("rng", "safetensors", tuple(f for _, rf, _ in gathered for f in rf))
                try:
                    with _storage_errors(f"committing step {step} into {self.root}"):
                        self._commit(step, staging, all_files, components, metrics, world_size=world.size)
                    self._apply_retention()
                except BaseException as exc:
                    if not self._remote:
                        shutil.rmtree(staging, ignore_errors=True)
                    status = _describe(exc)
        status = dist_.broadcast(status)
        if self._remote:
            shutil.rmtree(staging, ignore_errors=True)
        if local is not None:
            raise local
        if status:
            raise StorageError(f"saving step {step} failed: {status}")

    def _agree(self, world: dist_.World, staging: str, local: BaseException | None, what: str) -> None:
        """Raise on every rank if any rank failed at `what` (a collective)."""
        messages = dist_.all_gather(_describe(local))
        failures = [f"rank {r}: {m}" for r, m in enumerate(messages) if m]
        if not failures:
            return
        if world.rank == 0 or self._remote:
            shutil.rmtree(staging, ignore_errors=True)
        if local is not None:
            raise local
        raise SerializationError(f"{what} failed on another rank: {'; '.join(failures)}")

    def _commit(
        self,
        step: int,
        staging: str,
        files: dict[str, FileRecord],
        components: dict[str, ComponentRecord],
        metrics: dict[str, Any],
        world_size: int,
    ) -> None:
        epoch = metrics.get("epoch")
        manifest = Manifest(
            files=files,
            created=now_iso(),
            native=True,
            step=step,
            epoch=float(epoch) if isinstance(epoch, int | float) and not isinstance(epoch, bool) else None,
            metrics=metrics,
            world_size=world_size,
            versions=_versions(),
            components=components,
        )
        if self._remote:
            self._publish(step, staging, files, manifest)
            return
        commit.write_marker(staging, MANIFEST_NAME, manifest.to_json())
        replaced = commit.install(staging, self.step_dir(step))
        io.write_bytes_atomic(os.path.join(self.root, POINTER_NAME), f"{self.naming.folder(step)}\n".encode())
        if replaced is not None:
            trash.purge(replaced)

    def _publish(self, step: int, staging: str, files: Mapping[str, FileRecord], manifest: Manifest) -> None:
        """Commit a remote step: upload what is left of it (a single-process save uploads everything here),
        then the manifest, then the `latest` pointer."""
        upload = commit.ObjectStoreUpload(staging, self.step_dir(step), _MARKERS)
        if manifest.world_size == 1:
            upload.clear()
            upload.upload(_upload_batches(list(files)))
        else:  # the ranks have uploaded their files; DCP's metadata names them all, so it goes after
            upload.upload([[f for f in files if _is_dcp_metadata(f)]])
        upload.finish(MANIFEST_NAME, manifest.to_json())
        io.write_bytes_atomic(io.join(self.root, POINTER_NAME), f"{self.naming.folder(step)}\n".encode())

    def _upload(self, step: int, staging: str, names: list[str]) -> None:
        """Upload a rank's files of the local staging folder into the remote `step-{N}/`."""
        commit.ObjectStoreUpload(staging, self.step_dir(step), _MARKERS).upload(_upload_batches(names))

    def _clear_remote_step(self, step: int) -> None:
        """Delete a remote `step-{N}/` before re-saving it: the manifest first, so that the step stops
        reading as committed before any of its files go."""
        trash.delete(self.step_dir(step), _MARKERS)

    def _apply_retention(self) -> None:
        if self.policy is None or self.policy.keeps_everything:
            return
        if self._remote:
            self._apply_remote_retention()
            return
        try:
            trash.empty(os.path.join(self.root, TRASH_NAME))
            pointer = self.pointer()
            candidates = [self._retention_candidate(step, pointer) for step in self.all_steps()]
            doomed = [d.step for d in self.policy.plan(candidates, now=datetime.now(UTC)) if not d.keep]
            # Every doomed step is retired (out of sight) before any is purged: a crash mid-deletion leaves
            # a half-deleted folder in the trash, never a step folder that looks complete and is not.
            retired = [trash.retire(self.step_dir(step), _MARKERS) for step in doomed if step is not None]
            for folder in retired:
                trash.purge(folder)
            if doomed:
                log.info("retention deleted steps %s", doomed)
        except (OSError, CkptctlError) as exc:
            warnings.warn(f"retention in {self.root} failed: {exc}", CheckpointWarning, stacklevel=2)

    def _apply_remote_retention(self) -> None:
        assert self.policy is not None
        try:
            pointer = self.pointer()
            manifests = self._remote_manifests()
            candidates = [
                self._retention_candidate(step, pointer, datetime.fromtimestamp(entry.mtime, tz=UTC))
                for step, entry in sorted(manifests.items())
            ]
            doomed = [d.step for d in self.policy.plan(candidates, now=datetime.now(UTC)) if not d.keep]
            retired = [trash.retire(self.step_dir(step), _MARKERS) for step in doomed if step is not None]
            for folder in retired:
                trash.purge(folder)
            if doomed:
                log.info("retention deleted steps %s", doomed)
        except CkptctlError as exc:
            warnings.warn(f"retention in {self.root} failed: {exc}", CheckpointWarning, stacklevel=2)

    def _retention_candidate(self, step: int, pointer: str | None, created: datetime | None = None) -> Candidate:
        """What the policy needs to know about a committed step; sizes and metrics only when it asks."""
        folder = self.step_dir(step)
        manifest_path = io.join(folder, MANIFEST_NAME)
        if not self._remote:
            try:
                created = datetime.fromtimestamp(os.stat(manifest_path).st_mtime, tz=UTC)
            except OSError:
                created = None
        metrics: Mapping[str, Any] = {}
        if self.policy is not None and self.policy.keep_best:
            with contextlib.suppress(CkptctlError):
                metrics = parse_manifest(io.read_bytes(manifest_path), manifest_path).metrics
        size = 0
        if self.policy is not None and self.policy.max_total_size is not None:
            size = folder_size(folder)
        name = self.naming.folder(step)
        protected = ("named by the run's latest pointer",) if name == pointer else ()
        return Candidate(step, name, created=created, size_bytes=size, metrics=metrics, protected=protected)

    # ------------------------------------------------------------------ restore

    def restore(self, state: MutableMapping[str, Any], step: int | None = None, *, verify: bool = False) -> int:
        """Load a checkpoint into `state` and restore the random generators; return its step.

        Objects are loaded in place (`load_state_dict`); plain values replace `state[key]`. Entries of
        `state` that the checkpoint does not hold keep their state, with a `CheckpointWarning`.

        Args:
            state: the same kind of dict that was saved (freshly built objects to load into).
            step: the step to load; None loads the newest valid checkpoint (committed, manifest readable,
                every file present at its recorded size), skipping broken newer ones.
            verify: also check every file's blake3 digest against the manifest before loading. A remote
                run's files are always checked, as they are downloaded.

        Raises:
            CheckpointNotFound: no (valid) checkpoint, or no checkpoint of `step`.
            CorruptCheckpoint: the chosen checkpoint is broken.
        """
        self._join()
        world = dist_.current_world()
        if self._remote:
            with self._downloaded(step, verify, world) as (chosen, folder):
                self._load(state, chosen, folder, world)
            return chosen
        chosen = self._agreed_choice(step, verify, world, {})
        self._load(state, chosen, self.step_dir(chosen), world)
        return chosen

    def _agreed_choice(self, step: int | None, verify: bool, world: dist_.World, skip: Mapping[int, str]) -> int:
        """The step to restore, the same on every rank: rank 0 decides."""
        if not world.multi:
            return self._choose(step, verify, skip)
        choice: tuple[int | None, BaseException | None] = (None, None)
        if world.rank == 0:
            try:
                choice = (self._choose(step, verify, skip), None)
            except CkptctlError as exc:
                choice = (None, exc)
        chosen, error = dist_.broadcast(choice)
        if error is not None:
            raise error
        assert chosen is not None
        return int(chosen)

    @contextlib.contextmanager
    def _downloaded(self, step: int | None, verify: bool, world: dist_.World) -> Iterator[tuple[int, str]]:
        """Choose a remote step and download it into a local temporary folder, checking sizes and digests;
        yields (step, folder). With `step` None, a step whose download fails the checks is skipped for the
        next older valid one."""
        folder = tempfile.mkdtemp(prefix="ckptctl-restore-", dir=self.staging_dir)
        try:
            skip: dict[int, str] = {}
            while True:
                chosen = self._agreed_choice(step, verify, world, skip)
                failure: tuple[bool, str] | None = None
                try:
                    self._download(chosen, folder)
                except CkptctlError as exc:
                    failure = (isinstance(exc, CorruptCheckpoint), str(exc))
                if world.multi:  # a rank that failed alone must not leave the others in DCP's collectives
                    failure = next((f for f in dist_.all_gather(failure) if f is not None), None)
                if failure is None:
                    break
                corrupt, message = failure
                if step is not None or not corrupt:
                    raise (CorruptCheckpoint if corrupt else StorageError)(message)
                skip[chosen] = message
                shutil.rmtree(folder, ignore_errors=True)
                os.makedirs(folder)
            yield chosen, folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _download(self, step: int, folder: str) -> None:
        """Download a remote step's files into `folder` in parallel, hashing each as it arrives.

        Raises:
            CorruptCheckpoint: a file's size or blake3 digest differs from the manifest.
        """
        source = self.step_dir(step)
        data = io.read_bytes(io.join(source, MANIFEST_NAME))
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
        with _storage_errors(f"downloading step {step} from {self.root}"):
            problems = [p for p in io.parallel_map(fetch, items) if p]
            with open(os.path.join(folder, MANIFEST_NAME), "wb") as f:
                f.write(data)
        if problems:
            raise CorruptCheckpoint(f"{source}: {'; '.join(problems)}", "restore another step")

    def _load(self, state: MutableMapping[str, Any], chosen: int, folder: str, world: dist_.World) -> None:
        """Load the checkpoint in the local `folder` into `state` (the body of `restore`)."""
        manifest = parse_manifest(io.read_bytes(os.path.join(folder, MANIFEST_NAME)), folder)
        modules = {name: obj for name, obj in state.items() if isinstance(obj, torch.nn.Module)}
        sharded: dict[str, tuple[str, Any]] = {}
        missing = []
        for name, obj in list(state.items()):
            component = manifest.components.get(name)
            if component is None or component.kind == "rng":
                missing.append(name)
                continue
            kind = kind_of(name, obj)
            if component.storage == "dcp":
                if kind not in _SHARDED_KINDS:
                    raise CorruptCheckpoint(
                        f"{folder}: entry {name!r} is stored with DCP but state[{name!r}] is a {kind}"
                    )
                sharded[name] = (kind, obj)
                continue
            stored = state_tree.read_files(folder, name)
            if kind == "value":
                state[name] = stored.value
            elif world.multi and kind == "module":
                dist_.load_full_module(obj, stored.value)
            elif world.multi and kind == "optimizer":
                dist_.load_full_optimizer(dist_.owner_of(name, obj, modules), obj, stored.value)
            else:
                load_into(kind, obj, stored.value, stored.extra)
        if sharded:
            dist_.load_dcp(os.path.join(folder, "dcp"), sharded, modules)
        self._restore_rng(folder, manifest, world)
        if missing:
            warnings.warn(
                f"{self.step_dir(chosen)} holds no entry {', '.join(map(repr, missing))}; it keeps its current state",
                CheckpointWarning,
                stacklevel=3,
            )
        log.info("restored step %d from %s", chosen, self.step_dir(chosen))

    def _restore_rng(self, folder: str, manifest: Manifest, world: dist_.World) -> None:
        # A rank restores its own generators; a single process restoring a multi-rank save takes rank 0's.
        for stem in (f"rng.rank-{world.rank}", "rng"):
            if f"{stem}.json" in manifest.files:
                rng.restore(state_tree.read_files(folder, stem).value, source=f"{folder}/{stem}.json")
                return
        warnings.warn(
            f"{folder} holds no random generator state for rank {world.rank}; the generators keep their current state",
            CheckpointWarning,
            stacklevel=4,
        )

    def _choose(self, step: int | None, verify: bool, skip: Mapping[int, str]) -> int:
        if step is not None:
            problem = self._problem(step, verify)
            if problem is None:
                return step
            if not io.is_dir(self.step_dir(step)):
                raise CheckpointNotFound(f"no checkpoint of step {step} in {self.root}", _steps_hint(self.all_steps()))
            raise CorruptCheckpoint(
                f"{self.step_dir(step)}: {problem}", "restore another step, or step=None for the newest valid one"
            )
        skipped: list[tuple[str, str]] = []
        for candidate in reversed(self.all_steps()):
            problem = skip.get(candidate) or self._problem(candidate, verify)
            if problem is None:
                if skipped:
                    detail = "; ".join(f"{name}: {why}" for name, why in skipped)
                    warnings.warn(
                        f"restoring {self.naming.folder(candidate)}, skipping newer broken ones ({detail})",
                        CheckpointWarning,
                        stacklevel=5,
                    )
                return candidate
            skipped.append((self.naming.folder(candidate), problem))
        detail = "; ".join(f"{name}: {why}" for name, why in skipped)
        raise CheckpointNotFound(
            f"no valid committed checkpoint in {self.root}" + (f" (skipped {detail})" if detail else ""),
            "save one first, or check the run folder path",
        )

    def _problem(self, step: int, verify: bool) -> str | None:
        """Why a step cannot be restored, or None when it can (a remote step's digests are checked as it
        is downloaded, not here)."""
        folder = self.step_dir(step)
        manifest_path = io.join(folder, MANIFEST_NAME)
        remote_sizes = {rel: e.size for rel, e in io.list_tree(folder).items()} if self._remote else None
        if not (MANIFEST_NAME in remote_sizes if remote_sizes is not None else os.path.exists(manifest_path)):
            return "not committed (no manifest)"
        try:
            manifest = parse_manifest(io.read_bytes(manifest_path), manifest_path)
        except CkptctlError as exc:
            return str(exc)
        if not manifest.native or manifest.step != step:
            return f"the manifest is not a native manifest of step {step}"
        for rel, record in manifest.files.items():
            try:
                size = remote_sizes[rel] if remote_sizes is not None else os.path.getsize(os.path.join(folder, rel))
            except (KeyError, OSError):
                return f"{rel} is missing"
            if size != record.size:
                return f"{rel} has {size} bytes, the manifest says {record.size}"
        if verify and not self._remote:
            for rel, record in manifest.files.items():
                if file_digest(os.path.join(folder, rel)) != record.blake3:
                    return f"{rel} does not match its blake3 digest"
        return None


def _upload_batches(names: list[str]) -> list[list[str]]:
    """The order a save's files go up in: RNG files first (they make a partial upload read as ours and in
    progress), then the rest."""
    return [[n for n in names if is_rng_file(n)], [n for n in names if not is_rng_file(n)]]


def _is_dcp_metadata(rel: str) -> bool:
    """DCP's `.metadata` (and any other non-shard file of `dcp/`): it names every shard, so it is uploaded last."""
    return rel.startswith("dcp/") and not rel.endswith(".distcp")


def _write_tree(
    folder: str, stem: str, encoded: EncodedTree, extra: Mapping[str, Any], files: dict[str, FileRecord]
) -> tuple[str, ...]:
    written = state_tree.write_files(folder, stem, encoded, extra)
    for name, w in written.items():
        files[name] = FileRecord(w.size, w.blake3)
    return tuple(written)


@contextlib.contextmanager
def _storage_errors(what: str) -> Iterator[None]:
    """Turn OS errors into a `StorageError` that says what was being done."""
    try:
        yield
    except OSError as exc:
        hint = "free some space" if exc.errno == errno.ENOSPC else "check the folder's permissions and free space"
        raise StorageError(f"{what} failed: {exc.strerror or exc}", hint) from exc


def _describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def _steps_hint(steps: list[int]) -> str:
    if not steps:
        return "the run has no committed checkpoint"
    shown = ", ".join(map(str, steps[-10:]))
    return f"committed steps: {'..., ' if len(steps) > 10 else ''}{shown}"


def _plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metrics as JSON values: 1-element tensors and numpy scalars become Python numbers."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise SerializationError(f"metrics must be a dict, not {type(metrics).__name__}")

    def clean(value: Any, where: str) -> Any:
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.item()
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return value.item()
        if isinstance(value, Mapping):
            return {str(k): clean(v, f"{where}[{k!r}]") for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v, f"{where}[{i}]") for i, v in enumerate(value)]
        raise SerializationError(
            f"cannot store {type(value).__qualname__} at {where}", "metrics hold numbers and strings"
        )

    return {str(k): clean(v, f"metrics[{k!r}]") for k, v in metrics.items()}


@functools.cache
def _versions() -> dict[str, str]:
    return {
        "ckptctl": ckptctl.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
