"""`CheckpointManager`: save and restore the training state of a run in the native format.

The on-disk format is docs/native-format.md. Saves follow `io.commit`'s protocol, which makes a crash at any
moment harmless:

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
digest as it arrives, and loads from there. What differs between the two is `core.storage`.

Retention deletes through `io.trash`: a doomed step is taken out of sight before `save` returns (renamed
into `.ckptctl-trash/`, or its manifest deleted), and its files are deleted on a background thread
(`core.deleter`), which `wait()` and `close()` wait for.

A save that is killed leaves its staging folder. Every staging folder says who writes it, in its name (pid
and machine, `formats.native.staging_token`) from its first moment and in a record written into it first
(host, pid, process start, boot id, pid namespace), so that `resume()` and every commit can delete the
ones whose writer is provably gone, whatever moment of the save the kill landed on, and those that another
machine's writer left an hour or more before a later step was committed
(`formats.native.abandoned_staging`); a live writer's folder is never touched.

Rollback. A run that goes back to an older step (`restore(state, step=10)`) and saves again (`save(20)`)
has left the newer steps (30) on a branch it abandoned: a later resume must follow the new branch, not
the highest step. Saving a step below the steps that were newer than the one this manager restored
therefore marks those, and the old save of the same step, superseded (`ckptctl-superseded.json` in each)
before the new save commits; so does a save below the manager's own newer saves. A save below newer steps
that another writer committed is no rollback (see "Concurrent writers" below). Resumes,
`latest_step()`, `ckptctl resume-plan` and `verify --latest` skip superseded steps, `list` shows them as
`superseded`, retention leaves them alone and `ckptctl prune` deletes them by its rules. The state lives in the step folders rather than in the `latest` pointer because the pointer is written after
the commit: a crash between the two leaves a newest step the pointer does not name, which must still be
resumed. Marking before the commit, the lowest step first, keeps every crash harmless: killed before any
mark, the run resumes where it was before the rollback; after the mark of the old save of the step but
before the newer ones', also (the newest step is unmarked); after all marks but before the commit, from
the newest unmarked step below, the rollback's base in the usual case (an old save between the base and
the new step stays unmarked); after the commit, from the new save.

Concurrent writers. Several managers (processes) may save disjoint steps into one run, and `ckptctl prune`,
`slim` and `repair` may run beside them. Each update of `latest`, each retention and each slim of a step
holds the run's lock (`core.lock`, the one those commands hold for their whole work): `latest` never moves
from a complete newer step to an older one (the slower writer's commit of step 19 after step 20 leaves it
at step-20), retention plans and retires while nobody else changes the run, and emptying the trash never
deletes a replacement `ckptctl slim` is building there. A save that cannot get the lock within `lock_wait`
is still committed (`restore()` walks the folders, newest first); it leaves `latest` or retention to the
next save, with a `CheckpointWarning`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch

from ckptctl import io
from ckptctl.contract.base import folder_size
from ckptctl.core import distributed as dist_
from ckptctl.core import loading, snapshot
from ckptctl.core.deleter import BackgroundDeleter
from ckptctl.core.entries import CheckpointWarning
from ckptctl.core.lock import RunLock
from ckptctl.core.mirror import Mirror
from ckptctl.core.retention import Candidate, RetentionPolicy
from ckptctl.core.snapshot import Snapshot, write_tree
from ckptctl.core.storage import open_run, storage_errors
from ckptctl.errors import CheckpointNotFound, CkptctlError, CorruptCheckpoint, SerializationError, StorageError
from ckptctl.formats.manifest import MANIFEST_NAME, ComponentRecord, FileRecord, Manifest, load_manifest, now_iso
from ckptctl.formats.native import ABANDON_GRACE, POINTER_NAME, StepNaming, staging_token, superseded_note
from ckptctl.formats.slim_marker import SLIM_NOTE
from ckptctl.io import trash
from ckptctl.io.trash import TRASH_NAME, Retired
from ckptctl.version import __version__

__all__ = ["POINTER_NAME", "TRASH_NAME", "CheckpointManager", "StepNaming"]

log = logging.getLogger("ckptctl.core")

#: Default `lock_wait`: far longer than another manager holds the run lock, short enough that a training loop
#: does not stall behind a `ckptctl prune` waiting at its prompt.
LOCK_WAIT = 10.0


class CheckpointManager:
    """Saves and restores a training state as native checkpoints under one run folder.

    The state is a dict of modules, optimizers, LR schedulers, objects with `state_dict()`/
    `load_state_dict()` (a resumable sampler) and plain values. Random generator states are saved and
    restored with every checkpoint without being asked.

    When `torch.distributed` is initialised with more than one rank, module and optimizer entries are
    saved through torch DCP (sharded, reshardable) and rank 0 commits; every rank must call `save` and
    `resume`/`restore`. Async saves are asynchronous on several ranks too (see `save`).

    Args:
        root: the run folder: a local path (created if missing) or an fsspec URL such as
            `s3://bucket/runs/exp1` (credentials and endpoint from the standard AWS settings).
        policy: retention applied after each commit; None keeps everything. The steps it drops are gone
            from `all_steps()` when `save` returns; their files are deleted in the background.
        async_save: return from `save` once the state is copied to host memory and write in a background
            thread; on a multi-rank run each rank copies its own shards and rank 0 commits once every rank
            has written. The copy buffers (pinned when CUDA is available) are kept for the next save: one
            host copy of the state this process saves stays allocated until `close()`.
        staging_dir: for a remote `root`, the local folder where a save is written before it is uploaded
            and a restore is downloaded before it is loaded (default: the system temp folder); it needs
            room for one checkpoint.
        mirror: a second run folder (`s3://bucket/runs/exp1`, any fsspec URL or a local path) that each
            committed step is copied to in the background, as `ckptctl sync` copies it (manifest last, then
            `latest`): `save` does not wait for the upload; `wait()` and `close()` do. A failed copy is a
            `CheckpointWarning` and is tried again after the next save (`core.mirror.Mirror`). Retention
            keeps a step until its copy is whole there, and applies to `root` only: the mirror keeps every
            step it received (`ckptctl prune` it).
        lock_wait: seconds a save waits for the run's lock (see "Concurrent writers" in the module docstring)
            before it leaves `latest` or retention to the next save, with a `CheckpointWarning`. Another
            manager holds it for milliseconds; `ckptctl prune`, `slim` and `repair` for their whole run.

    Example:
        >>> manager = CheckpointManager("runs/exp1", policy=RetentionPolicy(keep_last=3))
        >>> state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
        >>> for step in range(manager.resume(state), total):  # 0 on a fresh run, else one past the restored step
        ...     train_step()
        ...     if step % 100 == 0:
        ...         manager.save(step, state, metrics={"loss": loss})
        >>> manager.close()
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        policy: RetentionPolicy | None = None,
        async_save: bool = False,
        *,
        staging_dir: str | os.PathLike[str] | None = None,
        lock_wait: float = LOCK_WAIT,
        mirror: str | os.PathLike[str] | None = None,
    ) -> None:
        self.policy = policy
        self.async_save = async_save
        self.lock_wait = lock_wait
        self.naming = StepNaming()
        self.staging_dir = None if staging_dir is None else os.fspath(staging_dir)
        self._storage = open_run(os.fspath(root), self.naming, self.staging_dir)
        self.root = self._storage.root
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stager = snapshot.Stager()
        self._group: tuple[Any, Any] | None = None  # (the default group it was made for, the background group)
        self._deleter = BackgroundDeleter(f"ckptctl-delete-{self.naming.prefix}")
        self._mirror = None if mirror is None else Mirror(self.root, os.fspath(mirror), POINTER_NAME)
        # The steps on this manager's own way through the run: those it committed, and those newer than the
        # step it restored last (as they were then). A save below some of them goes back (a rollback); steps
        # that another writer commits meanwhile are never among them.
        self._own_steps: set[int] = set()
        # This manager's threads (the training loop's, the deleter's) take turns at the run's lock here rather
        # than fail on each other's lock file within `lock_wait`.
        self._lock_turn = threading.Lock()

    # ------------------------------------------------------------------ queries

    def step_dir(self, step: int) -> str:
        """The folder of a committed step (whether or not it exists)."""
        return self._storage.step_dir(step)

    def all_steps(self) -> list[int]:
        """Committed steps (a `step-{N}` folder holding a manifest), sorted ascending; not validated.

        Superseded steps (see `save`) are committed and listed; `latest_step()` and `restore` skip them.
        """
        return sorted(self._storage.committed())

    def latest_step(self) -> int | None:
        """The newest committed step whose manifest parses and whose files are all there at their size, and
        that a rollback did not supersede.

        This is the step `restore(state)` picks; None when the run has no usable checkpoint. A slim step
        (`ckptctl slim`, `keep_full_last`: its model only) is never picked.
        """
        unusable = self._storage.superseded() | self._storage.slimmed()
        for step in reversed(self.all_steps()):
            if step not in unusable and self._problem(step, verify=False) is None:
                return step
        return None

    def pointer(self) -> str | None:
        """The folder name the `latest` file names, or None when there is none."""
        try:
            return io.read_text(io.join(self.root, POINTER_NAME), max_size=io.MAX_MARKER_BYTES).strip() or None
        except (CheckpointNotFound, CorruptCheckpoint):
            return None

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None) -> None:
        """Save `state` as step `step`, replacing a checkpoint of that step if there is one.

        With `async_save`, returns once the state is copied to host memory; the write and the commit run
        in a background thread (see `wait`). On a multi-rank run every rank's thread writes its part and
        rank 0's commits after all of them have written, coordinating over a gloo group of their own
        (created by the first such save), so the training loop's collectives never wait for them; a
        failure on any rank is raised by the next `save`/`wait`/`restore` on every rank.

        Saving a step below the steps that were newer than the one this manager restored (after
        `restore(state, step=...)` of an older one), or below its own newer saves, goes back in the run: those
        newer steps, and an earlier save of this step, are marked superseded before this one commits, with a
        `CheckpointWarning`. They
        stay on disk (`all_steps()` lists them; retention neither counts nor deletes them) but resumes follow
        the new branch, whose saves replace them as they reach their steps; `ckptctl prune` deletes the
        others. Newer steps that another writer committed are left as they are, and so is `latest` when it
        names one of them (see "Concurrent writers" in the module docstring).

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
        clean_metrics = snapshot.plain_metrics(metrics)
        world = dist_.current_world()
        if world.multi:
            self._save_multi_rank(step, state, clean_metrics, world)
            return
        if not self.async_save:
            self._commit_single(step, snapshot.take(state, world, None), clean_metrics)
            return
        started = time.perf_counter()
        taken = snapshot.take(state, world, self._stager)
        log.debug("step %d staged in CPU memory in %.3fs", step, time.perf_counter() - started)
        self._thread = threading.Thread(
            target=self._background, args=(step, taken, clean_metrics), name=f"ckptctl-save-{step}"
        )
        self._thread.start()

    def wait(self) -> None:
        """Block until a background save has committed and the deletions of retention are done; re-raise
        the save's error if it failed (a failed deletion is a `CheckpointWarning`)."""
        self._join()
        self._deleter.flush()
        if self._mirror is not None:
            self._mirror.flush()
        self._report_deletions(stacklevel=3)

    def close(self) -> None:
        """Finish what runs in the background (as `wait`) and free the host buffers of async saves; call it
        when training ends. The manager stays usable (a later async save allocates the buffers again)."""
        self.wait()
        self._stager.release()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._report_deletions(stacklevel=4)
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _report_deletions(self, stacklevel: int) -> None:
        """Warn, on the caller's thread, of background deletions that failed since the last call: the
        checkpoints they were deleting are out of sight already, and the next retention retries."""
        for exc in self._deleter.take_errors():
            warnings.warn(f"retention in {self.root} failed: {exc}", CheckpointWarning, stacklevel=stacklevel)
        failed = self._mirror.take_errors() if self._mirror is not None else []
        if self._mirror is not None and failed:
            # One warning for the copies that failed since the last one, saying what it costs locally: retention
            # keeps every step not yet copied, so an unreachable mirror fills the local disk step after step.
            kept = sorted(self._mirror.pending())
            tries = f" ({len(failed)} copies)" if len(failed) > 1 else ""
            message = f"mirroring to {self._mirror.url} failed{tries}: {failed[-1]}"
            if kept:
                message += (
                    f"; {len(kept)} step(s) not yet copied there stay in {self.root} whatever the retention policy "
                    f"says until a copy succeeds (tried again after the next save): {', '.join(kept)}"
                )
            warnings.warn(message, CheckpointWarning, stacklevel=stacklevel)

    def _background(self, step: int, taken: Snapshot, metrics: dict[str, Any]) -> None:
        try:
            self._commit_single(step, taken, metrics)
        except BaseException as exc:  # handed to the training thread on its next call
            self._error = exc

    def _commit_single(self, step: int, taken: Snapshot, metrics: dict[str, Any]) -> None:
        started = time.perf_counter()
        staging = self._storage.staging(step, staging_token())
        files: dict[str, FileRecord] = {}
        components: dict[str, ComponentRecord] = {}
        try:
            with storage_errors(f"saving step {step} into {self.root}"):
                self._storage.begin(staging)
                for entry in taken.entries:
                    written = write_tree(staging, entry.name, entry.encoded, entry.extra, files, fsync=False)
                    components[entry.name] = ComponentRecord(entry.kind, "safetensors", written)
                components["rng"] = ComponentRecord(
                    "rng", "safetensors", write_tree(staging, "rng", taken.rng, {}, files, fsync=False)
                )
                # Every file durable before the manifest that names them is written (the commit protocol).
                snapshot.fsync_files(staging, list(files))
                self._commit(step, staging, files, components, metrics, world_size=1)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # a failed save's files; committed ones moved away
        size = sum(r.size for r in files.values())
        elapsed = time.perf_counter() - started
        log.info("saved step %d: %.1f MB in %.2fs", step, size / 1e6, elapsed)
        self._remove_abandoned()
        self._apply_retention()

    def _save_multi_rank(
        self, step: int, state: Mapping[str, Any], metrics: dict[str, Any], world: dist_.World
    ) -> None:
        # Every rank reaches every collective of the save, whatever fails locally: a rank that raised early
        # would leave the others waiting forever. Local failures travel with the gathered results.
        group = self._background_group() if self.async_save else None
        local: BaseException | None = None
        taken = None
        try:
            taken = snapshot.take(state, world, self._stager if self.async_save else None)
        except Exception as exc:  # any failure (a torch error too) must reach `_open_multi_rank`'s collective
            local = exc
        if group is None or local is not None:
            # A sync save; or this rank cannot save: it agrees so with the others' save threads over their
            # group now (the training thread has none of its own running) and raises here.
            staging = self._open_multi_rank(step, world, local, group)
            assert taken is not None
            self._write_multi_rank(step, staging, taken, metrics, world, group)
            return
        # Each rank writes its part and rank 0 commits on a thread of their own, which talk over a group
        # of their own (`dist_.background_group`). The loop is blocked for the host copy only: the staging
        # folder, its writer record and the ranks' agreement are the thread's work too. torch's
        # `dcp.async_save` would stage and write the DCP part alone: the commit protocol needs more after it
        # on every rank (the rank's RNG and rank 0's unsharded files, uploading them to an object store) and
        # one outcome agreed by all ranks before rank 0 commits, its staging cache differs between torch
        # releases, and this way sync and async saves run the same code. The host copy `snapshot.take` made
        # is what this thread writes; DCP sees it as it would the live state (same DTensor specs).
        self._thread = threading.Thread(
            target=self._background_multi_rank,
            args=(step, taken, metrics, world, group),
            name=f"ckptctl-save-{step}",
        )
        self._thread.start()

    def _open_multi_rank(self, step: int, world: dist_.World, local: BaseException | None, group: Any) -> str:
        """Create the staging folder of a multi-rank save on rank 0 (with its writer record) and agree, in one
        collective over `group`, on its path and on whether every rank is ready to write; return the path.

        Raises, on every rank, when any rank failed to take its state or rank 0 to create the folder.
        """
        staging, error = None, None
        if world.rank == 0:
            staging = self._storage.staging(step, staging_token())
            try:
                self._storage.prepare(step)
                with storage_errors(f"saving step {step} into {self.root}"):
                    self._storage.begin(staging)
            except CkptctlError as exc:
                error = exc
        try:
            gathered = dist_.all_gather((staging, None if error is None else str(error), _describe(local)), group)
        except Exception as exc:
            if staging is not None:
                self._discard(world, staging)
            if dist_.is_lost_peer(exc):
                raise _lost(step, exc) from exc
            raise
        staging, not_created = gathered[0][0], gathered[0][1]
        assert staging is not None
        failures = [f"rank {r}: {m}" for r, (_, _, m) in enumerate(gathered) if m]
        if not_created is None and not failures:
            return staging
        self._discard(world, staging)  # whatever rank 0 had created of it
        if local is not None:
            raise local
        if error is not None:
            raise error
        if not_created is not None:
            raise StorageError(not_created)
        raise SerializationError(f"preparing the state failed on another rank: {'; '.join(failures)}")

    def _background_group(self) -> Any:
        """The process group of this manager's background saves, created by the first multi-rank async
        save (every rank makes it together, in `save`), and again after the default group was replaced."""
        default = dist_.default_group()
        if self._group is None or self._group[0] is not default:
            self._group = (default, dist_.background_group())
        return self._group[1]

    def _background_multi_rank(
        self, step: int, taken: Snapshot, metrics: dict[str, Any], world: dist_.World, group: Any
    ) -> None:
        try:
            staging = self._open_multi_rank(step, world, None, group)
            self._write_multi_rank(step, staging, taken, metrics, world, group)
        except BaseException as exc:  # handed to the training thread on its next call, on every rank
            self._error = exc

    def _write_multi_rank(
        self, step: int, staging: str, taken: Snapshot, metrics: dict[str, Any], world: dist_.World, group: Any
    ) -> None:
        """Write this rank's part of a multi-rank save, and commit it on rank 0 once every rank has written
        (collectives over `group`: the default group for a sync save, the background group for an async one).

        Raises, on every rank, when any rank failed or lost contact with the others (then nothing is
        committed: the previous checkpoint stays the one a restore takes).
        """
        dcp_dir = os.path.join(staging, "dcp")
        written: dict[str, FileRecord] = {}
        try:
            if taken.dcp:
                written = dist_.save_dcp(dcp_dir, taken.dcp, group)
        except BaseException as exc:
            self._discard(world, staging)
            if dist_.is_lost_peer(exc):
                raise _lost(step, exc) from exc
            raise

        files: dict[str, FileRecord] = {}
        components: dict[str, ComponentRecord] = {}
        rng_files: tuple[str, ...] = ()
        local: BaseException | None = None
        try:
            with storage_errors(f"saving step {step} into {self.root}"):
                os.makedirs(staging, exist_ok=True)  # a rank's own staging folder on an object store's run
                rng_files = write_tree(staging, f"rng.rank-{world.rank}", taken.rng, {}, files, fsync=False)
                for entry in taken.entries:
                    written_tree = write_tree(staging, entry.name, entry.encoded, entry.extra, files, fsync=False)
                    components[entry.name] = ComponentRecord(entry.kind, "safetensors", written_tree)
                snapshot.fsync_files(staging, list(files))  # all at once, as a one-process save does
                files.update((f"dcp/{name}", record) for name, record in written.items())  # hashed as written
            self._storage.share(step, staging, list(files))
        except BaseException as exc:
            local = exc
        status: str | None = None
        committed = False
        try:
            gathered = dist_.all_gather((files, rng_files, _describe(local)), group)
            if world.rank == 0:
                failures = [f"rank {r}: {msg}" for r, (_, _, msg) in enumerate(gathered) if msg]
                if failures:
                    status = "; ".join(failures)
                else:
                    all_files = {k: v for rank_files, _, _ in gathered for k, v in rank_files.items()}
                    dcp_files = tuple(sorted(k for k in all_files if k.startswith("dcp/")))
                    for name, (kind, _) in taken.sharded.items():
                        components[name] = ComponentRecord(kind, "dcp", dcp_files)
                    rng = tuple(f for _, rf, _ in gathered for f in rf)
                    components["rng"] = ComponentRecord("rng", "safetensors", rng)
                    try:
                        with storage_errors(f"committing step {step} into {self.root}"):
                            self._commit(step, staging, all_files, components, metrics, world_size=world.size)
                        committed = True
                    except BaseException as exc:
                        status = _describe(exc)
                    if committed:  # tidying the run after a commit never fails the save it follows
                        try:
                            self._remove_abandoned()
                            self._apply_retention()
                        except Exception as exc:
                            log.warning("step %d committed, but tidying %s failed: %s", step, self.root, exc)
            status = dist_.broadcast(status, group=group)
        except Exception as exc:  # the commit's own failures are in `status`: this is the collectives'
            if committed:  # every rank had written: the checkpoint is whole, whoever left since
                log.warning("step %d committed, but a rank left before hearing so: %s", step, exc)
                return
            self._discard(world, staging)
            raise _lost(step, exc) from exc
        self._discard(world, staging)  # a failed save's files; committed ones moved away
        if local is not None:
            raise local
        if status:
            raise StorageError(f"saving step {step} failed: {status}")

    def _discard(self, world: dist_.World, staging: str) -> None:
        """Remove a multi-rank save's staging folder: rank 0 removes a shared one, every rank its own."""
        if world.rank == 0 or not self._storage.shared_staging:
            shutil.rmtree(staging, ignore_errors=True)

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
        self._supersede_newer(step)
        replaced = self._storage.commit(step, staging, manifest)
        self._own_steps.add(step)
        self._point_to(step)
        if self._mirror is not None:
            self._mirror.submit(self.naming.folder(step))
        if replaced is not None:
            self._purge_later(replaced)

    def _point_to(self, step: int) -> None:
        """Make `latest` name the step just committed, unless it names a newer step a resume would load: with
        two writers in one run, the slower one's commit of an older step must not move it back. Compared and
        written under the run's lock, which `ckptctl repair` holds while it rewrites the pointer too."""
        try:
            with self._run_lock(f"latest <- {self.naming.folder(step)}"):
                named = self.pointer()
                newer = None if named is None else self.naming.step_of(named)
                if newer is not None and newer > step and self._resumable(newer):
                    log.info("latest stays %s, newer than the %s just committed", named, self.naming.folder(step))
                    return
                io.write_bytes_atomic(io.join(self.root, POINTER_NAME), f"{self.naming.folder(step)}\n".encode())
        except CkptctlError as exc:  # committed all the same: `latest_step()` and `restore` walk the folders
            warnings.warn(
                f"{self.naming.folder(step)} is committed, but {POINTER_NAME} was not updated: {exc}",
                CheckpointWarning,
                stacklevel=2,
            )

    def _resumable(self, step: int) -> bool:
        """Whether `step` is one `restore()` could pick: committed whole, neither superseded nor slim."""
        if step in self._storage.superseded() or step in self._storage.slimmed():
            return False
        return step in self._storage.committed() and self._problem(step, verify=False) is None

    @contextlib.contextmanager
    def _run_lock(self, doing: str) -> Iterator[None]:
        """The run's lock (`core.lock`: the one `ckptctl prune`, `slim` and `repair` take), waiting `lock_wait`.

        Raises:
            RunLocked: another process held it for longer than `lock_wait`.
            LockUnusable: the lock file cannot be created.
        """
        # Taking over a dead holder's lock is routine (a job killed mid-save, restarted): a log line, no warning.
        with (
            self._lock_turn,
            RunLock(self.root, wait=self.lock_wait, command=f"CheckpointManager: {doing}", warn=log.warning),
        ):
            yield

    def _supersede_newer(self, step: int) -> None:
        """Before `step` commits: if committed steps on this manager's own way (`_own_steps`: saved by it, or
        newer than the step it restored) are newer than `step`, the run went back; mark them and an earlier
        save of `step` superseded, the lowest first (see the module docstring for why this order and why before
        the commit). Newer steps that another writer committed are that writer's progress, not a branch left
        behind."""
        committed = self._storage.committed()
        if not any(s > step for s in committed if s in self._own_steps):
            return  # the usual save: nothing newer, or only other writers' newer steps
        marked = self._storage.superseded()
        doomed = sorted(s for s in committed if s >= step and s not in marked and s in self._own_steps)
        if not any(s > step for s in doomed):
            return  # a save on a branch already taken: the newer steps are marked
        for old in doomed:
            self._storage.supersede(old, step)
        names = ", ".join(self.naming.folder(s) for s in doomed)
        warnings.warn(
            f"saving step {step} below the run's newest step {doomed[-1]}: {names} are superseded; resumes "
            f"follow the run from {self.naming.folder(step)} on",
            CheckpointWarning,
            stacklevel=5,  # the caller of save() (a synchronous single-process save)
        )

    def _remove_abandoned(self) -> None:
        """Take the staging folders that stopped saves left in the run out of sight, and delete them in the
        background (`formats.native.abandoned_staging`: never one whose writer may be alive)."""
        try:
            for url, why in self._storage.abandoned(ABANDON_GRACE):
                try:
                    retired = trash.retire(url)
                except FileNotFoundError:  # another process removed it first
                    continue
                log.info("removing %s, an interrupted save: %s", url, why)
                self._purge_later(retired)
        except (OSError, CkptctlError) as exc:
            warnings.warn(f"removing interrupted saves in {self.root} failed: {exc}", CheckpointWarning, stacklevel=3)

    # ------------------------------------------------------------------ retention

    def _apply_retention(self) -> None:
        if self.policy is None or (self.policy.keeps_everything and self.policy.keep_full_last is None):
            return
        try:
            # Under the run's lock, as `ckptctl prune` and `slim` work: a plan made while one of them changes the
            # run would retire what it just slimmed, or act on a pointer `repair` is rewriting.
            with self._run_lock("retention"):
                self._retain(self.policy)
        except (OSError, CkptctlError) as exc:
            warnings.warn(f"retention in {self.root} failed: {exc}", CheckpointWarning, stacklevel=2)

    def _retain(self, policy: RetentionPolicy) -> None:
        """Apply `policy` to the committed steps (the run's lock held): retire the doomed ones now, queue their
        deletion and the slims it decides."""
        leftovers = self._storage.leftovers()  # of a deletion that was interrupted (a crash, a killed prune)
        if leftovers is not None:
            self._deleter.submit(functools.partial(self._empty_trash, leftovers))
        pointer = self.pointer()
        # Superseded steps are off the run's branch: not counted by the rules, and not deleted either
        # (a person may want to look at the branch the run left). A re-save of their step on the new
        # branch replaces them; `ckptctl prune` deletes the others.
        superseded = self._storage.superseded()
        slimmed = self._storage.slimmed()
        candidates = [
            replace(
                self._retention_candidate(step, pointer, datetime.fromtimestamp(mtime, tz=UTC)),
                slim=step in slimmed,
            )
            for step, mtime in sorted(self._storage.committed().items())
            if step not in superseded
        ]
        decisions = policy.plan(candidates, now=datetime.now(UTC))
        doomed = [d.step for d in decisions if not d.keep]
        # Every doomed step is out of sight before this returns; a crash mid-deletion leaves a
        # half-deleted folder in the trash (or a prefix without a manifest), never a step folder that
        # looks complete and is not.
        for step in doomed:
            assert step is not None  # every candidate has one
            self._purge_later(self._storage.retire(step))
        if doomed:
            log.info("retention deleted steps %s", doomed)
        # Steps kept without their training-only state (`keep_full_last`), slimmed off the training loop's
        # path, after the deletions queued before them; on an object store they stay whole.
        for decision in decisions:
            if decision.slim and decision.step is not None and io.is_local(self.root):
                self._deleter.submit(functools.partial(self._slim, decision.step))

    def _slim(self, step: int) -> None:
        """Drop the training-only state of a committed step (`layouts.slimming`: built beside it, swapped in),
        on the deleter's thread, under the run's lock (a `ckptctl slim` or `prune` may have started since the
        retention that queued it)."""
        from ckptctl.layouts import detect
        from ckptctl.layouts.slimming import slim_checkpoint

        with self._run_lock(f"slimming {self.naming.folder(step)}"):
            if step in self._storage.slimmed() or step not in self._storage.committed():
                return  # slimmed by an earlier retention's job or by `ckptctl slim`, or deleted since
            _, ref = detect(self.step_dir(step), "native")
            freed = slim_checkpoint(ref)
        log.info("retention slimmed %s, freeing %d bytes", self.naming.folder(step), freed)

    def _empty_trash(self, leftovers: str) -> None:
        """Empty what interrupted deletions left in the run's trash, on the deleter's thread, under the run's
        lock: the trash is also where a running `ckptctl slim` builds its replacements (`trash.workspace`)."""
        with self._run_lock("emptying the trash"):
            trash.empty(leftovers)

    def _purge_later(self, retired: Retired) -> None:
        self._deleter.submit(functools.partial(trash.purge, retired))

    def _retention_candidate(self, step: int, pointer: str | None, created: datetime) -> Candidate:
        """What the policy needs to know about a committed step; sizes and metrics only when it asks."""
        folder = self.step_dir(step)
        manifest_path = io.join(folder, MANIFEST_NAME)
        metrics: Mapping[str, Any] = {}
        if self.policy is not None and self.policy.keep_best:
            with contextlib.suppress(CkptctlError):
                metrics = load_manifest(manifest_path).metrics
        size = 0
        if self.policy is not None and self.policy.max_total_size is not None:
            size = folder_size(folder)
        name = self.naming.folder(step)
        protected = ("named by the run's latest pointer",) if name == pointer else ()
        # Kept until its mirror copy is whole, as `ckptctl sync --keep-local` keeps what is not whole at DST.
        busy = f"not yet copied to {self._mirror.url}" if self._mirror and name in self._mirror.pending() else ""
        return Candidate(step, name, created=created, size_bytes=size, metrics=metrics, protected=protected, busy=busy)

    # ------------------------------------------------------------------ restore

    def resume(self, state: MutableMapping[str, Any], *, first_step: int = 0, verify: bool = False) -> int:
        """Continue the run if it has a checkpoint: restore the newest valid one into `state`; return the step
        to run next.

        The one call a training loop needs, whether the job starts the run or continues it after a crash
        or a preemption::

            for step in range(manager.resume(state), total_steps):
                ...

        Args:
            state: as for `restore` (freshly built objects to load into).
            first_step: what to return when the run has no checkpoint yet (1 for loops that count from 1).
            verify: as for `restore`.

        Returns:
            The restored step + 1, or `first_step` when nothing has been committed yet (`state` is then left
            as built; a staging folder of an interrupted first save counts as nothing). Staging folders of
            saves whose writer is gone are deleted first.

        Raises:
            CheckpointNotFound: the run has committed checkpoints but none is valid. Starting over would
                quietly throw the run's progress away, so that is left to the caller (`restore` a given
                step, or move the run folder aside).
            CorruptCheckpoint: the chosen checkpoint is broken.
        """
        self._join()
        world = dist_.current_world()
        if world.rank == 0:
            self._remove_abandoned()
        saved = bool(self.all_steps())
        if world.multi:  # rank 0's view decides, as it does for the step `restore` picks
            saved = bool(dist_.broadcast(saved))
        if not saved:
            return first_step
        return self.restore(state, verify=verify) + 1

    def restore(self, state: MutableMapping[str, Any], step: int | None = None, *, verify: bool = False) -> int:
        """Load a checkpoint into `state` and restore the random generators; return its step.

        Objects are loaded in place (`load_state_dict`); plain values replace `state[key]`. Entries of
        `state` that the checkpoint does not hold keep their state, and entries of the checkpoint that
        `state` does not ask for are not restored, each with a `CheckpointWarning`.

        Args:
            state: the same kind of dict that was saved (freshly built objects to load into).
            step: the step to load; None loads the newest valid checkpoint (committed, manifest readable,
                every file present at its recorded size) that a rollback did not supersede, skipping
                broken newer ones. A superseded step given here loads, with a `CheckpointWarning`.
            verify: also check every file's blake3 digest against the manifest before loading. A remote
                run's files are always checked, as they are downloaded.

        Raises:
            CheckpointNotFound: no (valid) checkpoint, or no checkpoint of `step`.
            CorruptCheckpoint: the chosen checkpoint is broken.
            StateMismatch: a module of `state` has other parameters or shapes than the checkpoint's.
        """
        self._join()
        world = dist_.current_world()
        with self._storage.fetcher() as fetch:
            chosen, folder = self._fetch_valid(fetch, step, verify, world)
            loading.load(state, folder, world, self.step_dir(chosen))
        if world.rank == 0:  # the rank that commits, and so marks what a rollback leaves
            marked = self._storage.superseded()
            self._own_steps = {s for s in self._storage.committed() if s > chosen and s not in marked}
        log.info("restored step %d from %s", chosen, self.step_dir(chosen))
        return chosen

    def _fetch_valid(
        self, fetch: Callable[[int], str], step: int | None, verify: bool, world: dist_.World
    ) -> tuple[int, str]:
        """Choose the step to restore and fetch it (a remote one is downloaded, checking sizes and digests);
        returns (step, local folder). With `step` None, a step that fails the checks while it is fetched is
        skipped for the next older valid one."""
        skip: dict[int, str] = {}
        while True:
            chosen = self._agreed_choice(step, verify, world, skip)
            failure: tuple[bool, str] | None = None
            folder = ""
            try:
                folder = fetch(chosen)
            except CkptctlError as exc:
                failure = (isinstance(exc, CorruptCheckpoint), str(exc))
            # A rank that failed alone must not leave the others in DCP's collectives; a local step's fetch
            # cannot fail (every rank loads it in place), and then the ranks need not agree on it.
            if world.multi and self._storage.fetch_may_fail:
                failure = next((f for f in dist_.all_gather(failure) if f is not None), None)
            if failure is None:
                return chosen, folder
            corrupt, message = failure
            if step is not None or not corrupt:
                raise (CorruptCheckpoint if corrupt else StorageError)(message)
            skip[chosen] = message

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

    def _choose(self, step: int | None, verify: bool, skip: Mapping[int, str]) -> int:
        superseded = self._storage.superseded()
        slimmed = self._storage.slimmed()
        if step is not None and step in slimmed:
            raise CkptctlError(
                f"{self.step_dir(step)} is {SLIM_NOTE}: it holds the model only, no state to resume from",
                "restore another step, or load its model with ckptctl convert",
            )
        if step is not None:
            problem = self._problem(step, verify)
            if problem is None:
                if step in superseded:
                    warnings.warn(
                        f"restoring {self.naming.folder(step)}, which is off the run's branch "
                        f"({superseded_note(self.step_dir(step))})",
                        CheckpointWarning,
                        stacklevel=5,
                    )
                return step
            if not io.is_dir(self.step_dir(step)):
                raise CheckpointNotFound(f"no checkpoint of step {step} in {self.root}", _steps_hint(self.all_steps()))
            raise CorruptCheckpoint(
                f"{self.step_dir(step)}: {problem}", "restore another step, or step=None for the newest valid one"
            )
        skipped: list[tuple[str, str]] = []
        for candidate in reversed(self.all_steps()):
            if candidate in superseded:  # off the run's branch: not worth a warning, it is how rollbacks work
                log.debug("skipping %s: superseded", self.naming.folder(candidate))
                continue
            if candidate in slimmed:  # the model only, kept on purpose
                skipped.append((self.naming.folder(candidate), SLIM_NOTE))
                continue
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
        skipped += [(self.naming.folder(s), "superseded by a rollback") for s in sorted(superseded, reverse=True)]
        detail = "; ".join(f"{name}: {why}" for name, why in skipped)
        raise CheckpointNotFound(
            f"no valid committed checkpoint in {self.root}" + (f" (skipped {detail})" if detail else ""),
            "save one first, or check the run folder path"
            + (" (a superseded step loads when named: restore(state, step=N))" if superseded else ""),
        )

    def _problem(self, step: int, verify: bool) -> str | None:
        """Why a step cannot be restored, or None when it can (a remote step's digests are checked as it
        is downloaded, not here)."""
        folder = self.step_dir(step)
        manifest_path = io.join(folder, MANIFEST_NAME)
        sizes = {rel: e.size for rel, e in io.list_tree(folder).items()}
        if MANIFEST_NAME not in sizes:
            return "not committed (no manifest)"
        try:
            manifest = load_manifest(manifest_path)
        except CkptctlError as exc:
            return str(exc)
        if not manifest.native or manifest.step != step:
            return f"the manifest is not a native manifest of step {step}"
        for rel, record in manifest.files.items():
            if rel not in sizes:
                return f"{rel} is missing"
            if sizes[rel] != record.size:
                return f"{rel} has {sizes[rel]} bytes, the manifest says {record.size}"
        return self._storage.check_digests(folder, manifest) if verify else None


def _lost(step: int, exc: BaseException) -> StorageError:
    return StorageError(
        f"saving step {step} failed: lost contact with another rank ({exc})",
        "a rank stopped mid-save; nothing was committed, the previous checkpoint is the one a restore takes",
    )


def _describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def _steps_hint(steps: list[int]) -> str:
    if not steps:
        return "the run has no committed checkpoint"
    shown = ", ".join(map(str, steps[-10:]))
    return f"committed steps: {'..., ' if len(steps) > 10 else ''}{shown}"


@functools.cache
def _versions() -> dict[str, str]:
    return {
        "ckptctl": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
