"""The facts of the native format, what `ckptctl.CheckpointManager` writes (docs/native-format.md): shared by
the core that writes it and the native plugin that reads it (`frameworks.native`), so both stay in step.

A committed checkpoint is a `step-N` folder holding `ckptctl-manifest.json` (written last: the completion
marker); a `.step-N.staging-*` folder is one being written (`StepNaming` builds and recognises both). The
run folder's `latest` file names the newest committed one.

A staging folder says who writes it, so that one left by a save that was killed reads as `abandoned` rather
than in progress forever (`abandoned_staging`): its name carries the writer's pid and machine
(`staging_token`), from the moment it exists to its commit, and a record of the process
(`ckptctl-writer.json`) written into it first adds the host name and the process start time. A step
folder holding `ckptctl-superseded.json` is committed but `superseded`: the run went back to an older
step and saved again (the manager's `save`), so resumes follow the new branch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from ckptctl import io
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.manifest import MANIFEST_NAME, Manifest, load_manifest
from ckptctl.io.process import Liveness, ProcessRecord, machine_tag
from ckptctl.units import format_age

__all__ = [
    "ABANDON_GRACE",
    "DCP_FOLDER",
    "NAMING",
    "POINTER_NAME",
    "SUPERSEDED_NAME",
    "WRITER_NAME",
    "StepNaming",
    "abandoned_staging",
    "completion_markers",
    "is_rng_file",
    "read_native_manifest",
    "staging_token",
    "superseded_marker",
    "superseded_note",
]

POINTER_NAME = "latest"
DCP_FOLDER = "dcp"
_RNG_FILE = re.compile(r"^rng(\.rank-\d+)?\.json$")
#: The record of the process writing a staging folder (`io.process.ProcessRecord`), written first.
WRITER_NAME = "ckptctl-writer.json"
#: What `io.write_bytes_atomic` leaves of `WRITER_NAME` when killed before its rename (the only record in a
#: staging folder of an older version whose save was killed right after creating it).
_WRITER_TEMP = re.compile(r"\." + re.escape(WRITER_NAME) + r"\.tmp-\d+-\d+")
#: A staging token that names its writer (`staging_token`): random, the pid, the machine tag.
_TOKEN_WRITER = re.compile(r"[0-9a-f]{8}p([1-9]\d{0,9})m([0-9a-f]{12})")
#: Present in a committed step folder that a save of a lower step made after it superseded.
SUPERSEDED_NAME = "ckptctl-superseded.json"
#: How long a staging folder whose writer cannot be checked from here (another machine, no record) must
#: have gone unwritten, behind a step committed after it, before `list` and the manager's own clean-up
#: count it as abandoned. A save keeps touching its files; an hour without a write is no slow save.
ABANDON_GRACE = timedelta(hours=1)


def completion_markers(files: Mapping[str, int]) -> tuple[str, ...]:
    """The manifest, which the core writes last (without it a folder is in progress or broken)."""
    return (MANIFEST_NAME,) if MANIFEST_NAME in files else ()


def is_rng_file(name: str) -> bool:
    """Whether `name` is one of the RNG state files the core writes into every checkpoint (`rng.json`,
    `rng.rank-3.json`): with no manifest beside them they mark a checkpoint the core did not finish."""
    return _RNG_FILE.match(name) is not None


@dataclass(frozen=True, slots=True)
class StepNaming:
    """Builds and recognises the folder names of a native run (one object shared by the core that
    writes them and the native plugin that reads them, so both stay in step)."""

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


def staging_token() -> str:
    """The token of a new staging folder's name (`StepNaming.staging`): random, then who writes it,
    `p<pid>m<machine tag>` (`io.process.machine_tag`).

    The name is there from the folder's first moment to its commit, when no record of the writer may be
    (killed before `WRITER_NAME` was in place, or after the commit removed it and before the rename, or a
    re-save's swap put the replaced step under the name): whatever moment a kill lands on, what it leaves
    says whose it was.
    """
    return f"{os.urandom(4).hex()}p{os.getpid()}m{machine_tag()}"  # secrets.token_hex(4), without importing `random`


def abandoned_staging(url: str, grace: timedelta, *, now: float | None = None) -> str | None:
    """Why the staging folder `url` of a native run is what a save left when its writer stopped, or None
    while its writer may still be at it.

    Abandoned, by its writer (`_writer_of`): a process of this machine that is gone. A writer that is
    alive here keeps it in progress however old it is (a slow save). Where nothing can be told (a writer
    on another machine, or an older version's folder without a record), the folder must have gone
    unwritten for `grace` and a step at least as high must have been committed after its last write: the
    run went on without it.

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
    """Who writes the staging folder `url`, as far as it says: its record (`WRITER_NAME`); else a record a
    kill left before its rename (`_WRITER_TEMP`); else the writer its name carries (`staging_token`), when
    that is a process of this machine. None when nothing says (another machine's folder without a record,
    an older version's folder killed before its record was written)."""
    record = _record(io.join(url, WRITER_NAME))
    if record is None:
        with contextlib.suppress(CkptctlError):  # removed while we looked: the name still tells
            temps = sorted(e.name for e in io.list_dir(url) if not e.is_dir and _WRITER_TEMP.fullmatch(e.name))
            record = next(filter(None, (_record(io.join(url, name)) for name in temps)), None)
    if record is None and (named := _TOKEN_WRITER.fullmatch(io.name_of(url).rpartition(".staging-")[2])):
        record = ProcessRecord.tagged(int(named.group(1)), named.group(2))
    return record


def _record(url: str) -> ProcessRecord | None:
    try:
        return ProcessRecord.parse(io.read_bytes(url, max_size=io.MAX_MARKER_BYTES))
    except CkptctlError:  # missing, or unreadable: nothing proved
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
    if io.is_local(manifest_url):  # a stat is cheap only here: a remote manifest is read each time
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
