"""The native plugin: reads what `ckptctl.CheckpointManager` writes (docs/native-format.md), on the facts of
the format that the core shares (`formats.native`: step naming, pointer, manifest, writer record,
abandoned staging folders, superseded steps).

Object stores have no atomic folder rename, so there the core uploads straight into `step-N/`: the RNG
files first, the manifest last. A remote `step-N/` holding RNG files but no manifest is therefore an upload
in progress while its newest object is recent (`REMOTE_UPLOAD_WINDOW`), and an interrupted one after.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from functools import cache
from typing import TYPE_CHECKING

from ckptctl import io
from ckptctl.checkpoint import (
    Checkpoint,
    CheckpointRef,
    CheckpointState,
    ChunkEncoding,
    Component,
    Problem,
    ProblemKind,
    TensorChunk,
    TensorEntry,
)
from ckptctl.contract.base import (
    Layout,
    every_child_folder,
    folder_size,
    list_files,
    newest_mtime,
    step_from_name,
    timestamp,
)
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.families.dcp_folder import dcp_tensor_index, verify_dcp
from ckptctl.formats.manifest import DIGESTS_NAME, MANIFEST_NAME, Manifest
from ckptctl.formats.native import (
    ABANDON_GRACE,
    DCP_FOLDER,
    NAMING,
    POINTER_NAME,
    SUPERSEDED_NAME,
    abandoned_staging,
    completion_markers,
    is_rng_file,
    read_native_manifest,
    superseded_note,
)
from ckptctl.formats.safetensors import read_header
from ckptctl.io import DirEntry

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = ["COMPONENT_OF_KIND", "REMOTE_UPLOAD_WINDOW", "NativeLayout"]

#: How long after its newest object a remote `step-N/` without a manifest still reads as being uploaded
#: (uploads of single objects take minutes at most); older, it reads as an interrupted upload.
REMOTE_UPLOAD_WINDOW = timedelta(hours=1)

#: Manifest component kinds -> the shared component names.
COMPONENT_OF_KIND = {
    "module": Component.MODEL,
    "optimizer": Component.OPTIMIZER,
    "scheduler": Component.SCHEDULER,
    "rng": Component.RNG,
    "dataloader": Component.DATALOADER,
    "stateful": Component.EXTRA,
    "value": Component.EXTRA,
}


class NativeLayout(Layout):
    """Checkpoints written by ckptctl's own core."""

    name = "native"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        folder = io.name_of(url)
        in_progress_step = NAMING.staging_step(folder)
        if in_progress_step is not None:
            why = abandoned_staging(url, ABANDON_GRACE)
            return CheckpointRef(
                url=url,
                layout=self.name,
                step=in_progress_step,
                epoch=None,
                created=timestamp(newest_mtime(entries)),
                state=CheckpointState.ABANDONED if why else CheckpointState.IN_PROGRESS,
                size_bytes=folder_size(url),
                note=f"an interrupted save: {why}; the run's next save or `ckptctl prune` deletes it"
                if why
                else "being written (staging folder, no manifest yet)",
            )
        if not any(e.name == MANIFEST_NAME and not e.is_dir for e in entries):
            return self._damaged(url, entries)
        manifest_entry = next(e for e in entries if e.name == MANIFEST_NAME)
        try:
            manifest = read_native_manifest(url)
        except CkptctlError as exc:
            return CheckpointRef(
                url=url,
                layout=self.name,
                step=step_from_name(folder),
                epoch=None,
                created=timestamp(manifest_entry.mtime),
                state=CheckpointState.BROKEN,
                size_bytes=folder_size(url),
                note=str(exc),
            )
        created = _parse_time(manifest.created) or timestamp(manifest_entry.mtime)
        superseded = any(e.name == SUPERSEDED_NAME and not e.is_dir for e in entries)
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=manifest.step if manifest.step is not None else step_from_name(folder),
            epoch=manifest.epoch,
            created=created,
            state=CheckpointState.SUPERSEDED if superseded else CheckpointState.COMPLETE,
            size_bytes=folder_size(url),
            note=superseded_note(url) if superseded else "",
        )

    def _damaged(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A committed folder that lost its manifest (the core always writes RNG files, and the manifest
        before the rename): report it as broken rather than let another layout claim it as complete."""
        folder = io.name_of(url)
        step = NAMING.step_of(folder)
        if step is None:
            return None
        if not any(is_rng_file(e.name) for e in entries):
            return None
        if not io.is_local(url):  # a local save is staged under another name; an upload fills the step's own prefix
            return self._unfinished_upload(url, step)
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=step,
            epoch=None,
            created=timestamp(newest_mtime(entries)),
            state=CheckpointState.BROKEN,
            size_bytes=folder_size(url),
            note=f"{MANIFEST_NAME} is missing: the checkpoint is damaged",
        )

    def _unfinished_upload(self, url: str, step: int) -> CheckpointRef:
        """A remote `step-N/` with RNG files and no manifest: the manifest is uploaded last, so this is an
        upload in progress, or one that stopped (or a deletion, which removes the manifest first)."""
        files = io.list_tree(url)
        newest = max((e.mtime for e in files.values() if e.mtime), default=None)
        recent = newest is None or time.time() - newest < REMOTE_UPLOAD_WINDOW.total_seconds()
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=step,
            epoch=None,
            created=timestamp(newest),
            state=CheckpointState.IN_PROGRESS if recent else CheckpointState.BROKEN,
            size_bytes=sum(e.size for e in files.values()),
            note=f"no {MANIFEST_NAME} yet: being uploaded"
            if recent
            else f"no {MANIFEST_NAME}: an upload or a deletion that stopped midway",
        )

    def members(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """Every child folder (`dcp/` of a multi-rank save): the core writes a checkpoint in a staging
        folder and renames it into place whole."""
        return every_child_folder(entries)

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        if not any(e.name == POINTER_NAME and not e.is_dir for e in entries):
            return None
        try:
            name = io.read_text(io.join(url, POINTER_NAME), max_size=io.MAX_MARKER_BYTES).strip()
        except CkptctlError:
            return None
        return name or None

    def open(self, url: str) -> Checkpoint:
        entries = io.list_dir(url)
        ref = self.identify(url, entries)
        if ref is None:
            raise CorruptCheckpoint(f"{url} is not a ckptctl checkpoint")
        if ref.state is CheckpointState.IN_PROGRESS:
            from ckptctl.errors import CheckpointInProgress

            raise CheckpointInProgress(f"{url} is still being written (no manifest yet)", "wait for the save to commit")
        if ref.state is CheckpointState.ABANDONED:
            raise CorruptCheckpoint(f"{url} is {ref.note}", "it was never committed: open a step-N folder instead")
        manifest = read_native_manifest(url)
        components = {COMPONENT_OF_KIND.get(record.kind, Component.EXTRA) for record in manifest.components.values()}
        # The manifest records the step, time and metrics: the counters `restore()` hands back.
        components.add(Component.TRAINER_STATE)
        files = list_files(url)
        metadata = {
            "metrics": dict(manifest.metrics),
            "versions": dict(manifest.versions),
            "entries": {name: f"{c.kind} in {c.storage}" for name, c in manifest.components.items()},
        }

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            return _tensor_index(url, manifest, files)

        return Checkpoint(
            ref=ref,
            components=frozenset(components),
            world_size=manifest.world_size,
            metadata=metadata,
            tensor_index=tensor_index,
            files=files,
            metrics=dict(manifest.metrics),
        )

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        url = checkpoint.url
        problems: list[Problem] = []
        manifest = read_native_manifest(url)
        files = checkpoint.files
        for rel, record in manifest.files.items():
            if rel not in files:
                problems.append(Problem(ProblemKind.MISSING_FILE, rel, f"{rel} is listed in the manifest but missing"))
            elif files[rel] != record.size:
                kind = ProblemKind.TRUNCATED if files[rel] < record.size else ProblemKind.SIZE_MISMATCH
                problems.append(
                    Problem(kind, rel, f"{rel} has {files[rel]} bytes, the manifest recorded {record.size}")
                )
        for rel in sorted(set(files) - set(manifest.files) - {MANIFEST_NAME, DIGESTS_NAME, SUPERSEDED_NAME}):
            problems.append(
                Problem(ProblemKind.UNEXPECTED_FILE, rel, f"{rel} is not in the manifest", severity="warning")
            )
        for rel in sorted(r for r in manifest.files if r.endswith(".safetensors") and r in files):
            try:
                read_header(io.join(url, rel), files[rel])
            except CkptctlError as exc:
                problems.append(Problem(ProblemKind.BAD_METADATA, rel, exc.message))
        if any(c.storage == "dcp" for c in manifest.components.values()):
            problems.extend(verify_dcp(io.join(url, DCP_FOLDER), path_prefix=f"{DCP_FOLDER}/"))
        return problems

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """The manifest, which the core writes last (without it a folder is in progress or broken)."""
        return completion_markers(files)

    def abandoned(self, ref: CheckpointRef, grace: timedelta) -> str | None:
        """A staging folder's verdict (`abandoned_staging`); committed folders are never abandoned."""
        if NAMING.staging_step(io.name_of(ref.url)) is None:
            return None
        return abandoned_staging(ref.url, grace)

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.native.resume`."""
        from ckptctl.frameworks.native.resume import PROFILE

        return PROFILE


def _parse_time(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def _tensor_index(url: str, manifest: Manifest, files: dict[str, int]) -> tuple[TensorEntry, ...]:
    entries: list[TensorEntry] = []
    for record in manifest.components.values():
        component = COMPONENT_OF_KIND.get(record.kind, Component.EXTRA)
        for rel in record.files:
            if record.storage != "safetensors" or not rel.endswith(".safetensors") or rel not in files:
                continue
            header = read_header(io.join(url, rel), files[rel])
            for rec in header.tensors:
                chunk = TensorChunk(
                    rel, rec.begin, rec.end - rec.begin, (0,) * len(rec.shape), rec.shape, ChunkEncoding.RAW
                )
                # The file stem is the entry name ("model") or, for per-rank RNG files, "rng.rank-1".
                stem = rel.removesuffix(".safetensors")
                entries.append(TensorEntry(f"{stem}.{rec.name}", component, rec.dtype, rec.shape, (chunk,)))
    if any(c.storage == "dcp" for c in manifest.components.values()):
        kinds = {name: COMPONENT_OF_KIND.get(c.kind, Component.EXTRA) for name, c in manifest.components.items()}

        def component_of(key: str) -> Component:
            return kinds.get(key.split(".", 1)[0], Component.EXTRA)

        entries.extend(dcp_tensor_index(io.join(url, DCP_FOLDER), component_of, path_prefix=f"{DCP_FOLDER}/"))
    return tuple(entries)
