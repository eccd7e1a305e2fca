"""What `ckptctl.CheckpointManager` writes (docs/native-format.md).

A committed checkpoint is a `step-N` folder holding `ckptctl-manifest.json`; a `.step-N.staging-*`
folder is one being written. The run folder's `latest` file names the newest committed one.

A staging folder holds a record of the process writing it (`ckptctl-writer.json`), so that one left by a
save that was killed reads as `abandoned` rather than in progress forever (`abandoned_staging`). A step
folder holding `ckptctl-superseded.json` is committed but `superseded`: the run went back to an older
step and saved again (the manager's `save`), so resumes follow the new branch.

Object stores have no atomic folder rename, so there the core uploads straight into `step-N/`: the RNG
files first, the manifest last. A remote `step-N/` holding RNG files but no manifest is therefore an upload
in progress while its newest object is recent (`REMOTE_UPLOAD_WINDOW`), and an interrupted one after.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache

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
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.manifest import DIGESTS_NAME, MANIFEST_NAME, Manifest, load_manifest
from ckptctl.formats.safetensors import read_header
from ckptctl.io import DirEntry
from ckptctl.io.process import Liveness, ProcessRecord
from ckptctl.io.trash import TRASH_NAME
from ckptctl.layouts.base import (
    Layout,
    every_child_folder,
    folder_size,
    list_files,
    newest_mtime,
    step_from_name,
    timestamp,
)
from ckptctl.layouts.resume import ResumeProfile
from ckptctl.units import format_age

__all__ = [
    "ABANDON_GRACE",
    "COMPONENT_OF_KIND",
    "DCP_FOLDER",
    "POINTER_NAME",
    "REMOTE_UPLOAD_WINDOW",
    "SUPERSEDED_NAME",
    "TRASH_NAME",
    "WRITER_NAME",
    "NativeLayout",
    "StepNaming",
    "abandoned_staging",
    "is_rng_file",
    "read_native_manifest",
    "superseded_marker",
    "superseded_note",
]

POINTER_NAME = "latest"
DCP_FOLDER = "dcp"
_RNG_FILE = re.compile(r"^rng(\.rank-\d+)?\.json$")
#: How long after its newest object a remote `step-N/` without a manifest still reads as being uploaded
#: (uploads of single objects take minutes at most); older, it reads as an interrupted upload.
REMOTE_UPLOAD_WINDOW = timedelta(hours=1)
#: The record of the process writing a staging folder (`io.process.ProcessRecord`), written first.
WRITER_NAME = "ckptctl-writer.json"
#: Present in a committed step folder that a save of a lower step made after it superseded.
SUPERSEDED_NAME = "ckptctl-superseded.json"
#: How long a staging folder whose writer cannot be checked from here (another machine, no record) must
#: have gone unwritten, behind a step committed after it, before `list` and the manager's own clean-up
#: count it as abandoned. A save keeps touching its files; an hour without a write is no slow save.
ABANDON_GRACE = timedelta(hours=1)


def is_rng_file(name: str) -> bool:
    """Whether `name` is one of the RNG state files the core writes into every checkpoint (`rng.json`,
    `rng.rank-3.json`): with no manifest beside them they mark a checkpoint the core did not finish."""
    return _RNG_FILE.match(name) is not None


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


@dataclass(frozen=True, slots=True)
class StepNaming:
    """Builds and recognises the folder names of a native run (one object shared by the core that
    writes them and this reader, so both stay in step)."""

    prefix: str = "step-"

    def folder(self, step: int) -> str:
        return f"{self.prefix}{step}"

    def staging(self, step: int, token: str) -> str:
        return f".{self.prefix}{step}.staging-{token}"

    def step_of(self, name: str) -> int | None:
        """The step of a committed folder name (`step-30` -> 30; `step-030` is not one of ours)."""
        m = re.fullmatch(re.escape(self.prefix) + r"(0|[1-9]\d*)", name)
        return int(m.group(1)) if m else None

    def staging_step(self, name: str) -> int | None:
        """The step of a staging folder name, or None if `name` is not one."""
        m = re.fullmatch(r"\." + re.escape(self.prefix) + r"(\d+)\.staging-[0-9A-Za-z]+", name)
        return int(m.group(1)) if m else None


NAMING = StepNaming()


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
        if not any(_RNG_FILE.match(e.name) for e in entries):
            return None
        if not io.is_local(url):
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
            from ckptctl.frameworks.dcp.layout import verify_dcp

            problems.extend(verify_dcp(io.join(url, DCP_FOLDER), path_prefix=f"{DCP_FOLDER}/"))
        return problems

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """The manifest, which the core writes last (without it a folder is in progress or broken)."""
        return (MANIFEST_NAME,) if MANIFEST_NAME in files else ()

    def abandoned(self, ref: CheckpointRef, grace: timedelta) -> str | None:
        """A staging folder's verdict (`abandoned_staging`); committed folders are never abandoned."""
        if NAMING.staging_step(io.name_of(ref.url)) is None:
            return None
        return abandoned_staging(ref.url, grace)

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.native.resume`."""
        from ckptctl.frameworks.native.resume import PROFILE

        return PROFILE


def abandoned_staging(url: str, grace: timedelta, *, now: float | None = None) -> str | None:
    """Why the staging folder `url` of a native run is what a save left when its writer stopped, or None
    while its writer may still be at it.

    Abandoned, by the record of its writer (`WRITER_NAME`): a process of this machine that is gone. A
    writer that is alive here keeps it in progress however old it is (a slow save). Where nothing can be
    told (a writer on another machine, no record: the save was killed before writing it), the folder must
    have gone unwritten for `grace` and a step at least as high must have been committed after its last
    write: the run went on without it.

    Args:
        url: a `.step-N.staging-*` folder.
        grace: see above.
        now: the current time (POSIX seconds; tests fix it).
    """
    step = NAMING.staging_step(io.name_of(url))
    if step is None:
        return None
    record = _writer_of(url)
    if record is not None:
        liveness = record.liveness()
        if liveness is Liveness.GONE:
            return f"its writer ({record.describe()}) is gone"
        if liveness is Liveness.ALIVE:
            return None
    parent = io.parent_of(url)
    try:
        siblings = {e.name: e for e in io.list_dir(parent)}
        files = io.list_tree(url)
    except CkptctlError:  # removed while we looked: nothing to judge
        return None
    own = siblings.get(io.name_of(url))
    last = max([e.mtime for e in files.values() if e.mtime] + ([own.mtime] if own and own.mtime else []), default=None)
    if last is None:
        return None
    age = (time.time() if now is None else now) - last
    if age < grace.total_seconds():
        return None
    later = sorted(s for name in siblings if (s := NAMING.step_of(name)) is not None and s >= step)
    for newer in later:
        manifest = _manifest_mtime(io.join(parent, NAMING.folder(newer)))
        if manifest is not None and manifest > last:
            who = f"its writer, {record.describe()}, cannot be checked from here; " if record else ""
            return (
                f"{who}nothing has written to it for {format_age(timedelta(seconds=round(age)))} and "
                f"{NAMING.folder(newer)} was committed after its last write"
            )
    return None


def _writer_of(url: str) -> ProcessRecord | None:
    try:
        return ProcessRecord.parse(io.read_bytes(io.join(url, WRITER_NAME), max_size=io.MAX_MARKER_BYTES))
    except CkptctlError:  # no record yet (or any more), or unreadable: nothing proved
        return None


def _manifest_mtime(folder: str) -> float | None:
    try:
        return next((e.mtime for e in io.list_dir(folder) if e.name == MANIFEST_NAME and not e.is_dir), None)
    except CkptctlError:
        return None


def superseded_marker(by: int) -> bytes:
    """The content of `SUPERSEDED_NAME` in a step that a save of step `by` superseded."""
    doc = {"superseded_by": NAMING.folder(by), "step": by, "time": datetime.now(UTC).isoformat(timespec="seconds")}
    return json.dumps(doc, indent=1).encode()


def superseded_note(url: str) -> str:
    """Why the committed step folder `url` is superseded, from its `SUPERSEDED_NAME` marker, for people."""
    by = ""
    with contextlib.suppress(CkptctlError, ValueError, AttributeError):
        doc = json.loads(io.read_bytes(io.join(url, SUPERSEDED_NAME), max_size=io.MAX_MARKER_BYTES))
        by = f" by {doc['superseded_by']}" if isinstance(doc.get("superseded_by"), str) else ""
    return f"superseded{by}: the run went back to an older step and saved again, and resumes follow that branch"


#: A parse cache owned by this module for the whole process, not by a scan (`layouts.ScanContext`): keyed
#: by the local file's version (path, size, mtime in ns), so it serves only the bytes it parsed.
_MANIFEST_CACHE: OrderedDict[tuple[str, int, int], Manifest] = OrderedDict()
_MANIFEST_CACHE_SIZE = 8
_MANIFEST_CACHE_LOCK = threading.Lock()


def read_native_manifest(url: str) -> Manifest:
    """The manifest of a committed native checkpoint.

    identify, open and verify of one checkpoint all need it: local manifests are parsed once and kept
    in a small cache keyed by size and modification time, so a rewritten manifest is read again.
    """
    manifest_url = io.join(url, MANIFEST_NAME)
    key = None
    if io.is_local(manifest_url):
        try:
            st = os.stat(io.local_path(manifest_url))
        except OSError:
            pass  # read_bytes below raises the clear error
        else:
            key = (os.path.abspath(io.local_path(manifest_url)), st.st_size, st.st_mtime_ns)
            with _MANIFEST_CACHE_LOCK:
                cached = _MANIFEST_CACHE.get(key)
            if cached is not None:
                return cached
    manifest = load_manifest(manifest_url)
    if not manifest.native:
        raise CorruptCheckpoint(f"{manifest_url} is a digests file, not a checkpoint manifest")
    if key is not None:
        with _MANIFEST_CACHE_LOCK:
            _MANIFEST_CACHE[key] = manifest
            while len(_MANIFEST_CACHE) > _MANIFEST_CACHE_SIZE:
                _MANIFEST_CACHE.popitem(last=False)
    return manifest


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
        from ckptctl.frameworks.dcp.layout import dcp_tensor_index

        kinds = {name: COMPONENT_OF_KIND.get(c.kind, Component.EXTRA) for name, c in manifest.components.items()}

        def component_of(key: str) -> Component:
            return kinds.get(key.split(".", 1)[0], Component.EXTRA)

        entries.extend(dcp_tensor_index(io.join(url, DCP_FOLDER), component_of, path_prefix=f"{DCP_FOLDER}/"))
    return tuple(entries)
