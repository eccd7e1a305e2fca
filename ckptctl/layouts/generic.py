"""The generic reader: checkpoint-like files that no framework plugin claims (DESIGN §1, "Unknown is a state").

A run written by a framework ckptctl was never taught (a fine-tuning library's `step-00000010/train.pth`, a
trainer's `ep0-ba10-rank0.pt` files) is not "nothing here": the run walker asks this module, after every
plugin, about each folder no plugin recognised. Files are checkpoint-like by their content or their size,
never by their name alone:

- a torch.save zip: `PK\\x03\\x04` and a first entry `<archive>/data.pkl` (one small read);
- a safetensors file whose header parses (`formats.safetensors.read_header`);
- a DCP data file (`*.distcp`);
- any `*.pt`/`*.pth`/`*.bin`/`*.ckpt`/`*.safetensors` of at least `MEANINGFUL_BYTES` (a legacy pickle, a
  format of its own).

Such a file whose name gives a step or an epoch (the naming rules of `name_facts`: `ep0-ba10-rank0.pt`) is a
checkpoint of its own; the other ones make the folder holding them one checkpoint (`step-00000010/` with its
`train.pth`). Either is listed with layout and state `unknown` and a note naming the files that made it so:
`verify` reads them as generic files and exits 2, a `verify --latest` is no fresh start, `prune` keeps them
and `resume-plan` says "unknown layout". Nothing here opens them as a training state.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache, lru_cache

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Problem, ProblemKind
from ckptctl.errors import CkptctlError, UnknownLayout
from ckptctl.formats.safetensors import read_header
from ckptctl.io import DirEntry
from ckptctl.layouts.base import Layout, timestamp
from ckptctl.layouts.resume import ResumeProfile, generic_profile
from ckptctl.quoting import shell

__all__ = [
    "GENERIC",
    "GenericLayout",
    "NameFacts",
    "checkpoint_like",
    "generic_layout",
    "name_facts",
    "unclaimed",
]

#: The layout name (and state) of what the generic reader finds: `list --json` says `"layout": "unknown"`.
GENERIC = "unknown"
#: Names frameworks give to files that hold checkpoints.
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
#: A file so named but of no format ckptctl reads counts from this size on (a smaller one is a note, a stub).
MEANINGFUL_BYTES = 1 << 20
#: Names of symbolic links that point at the newest checkpoint beside them (Composer's `latest-rank0.pt`,
#: Lightning's `last.ckpt`).
_POINTER_LINK = re.compile(r"^(?:latest|last)(?:[-_.].*)?$", re.IGNORECASE)

_ZIP_MAGIC = b"PK\x03\x04"
_ZIP_HEADER = 30  # a zip local file header's fixed part; the name's length is at byte 26
_TORCH_ENTRY = b"/data.pkl"


# --------------------------------------------------------------------------------------------------
# Names that order checkpoints (LAYOUTS.md §13).
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NameFacts:
    """What a checkpoint's name says about where training was: a step, an epoch, or both."""

    step: int | None = None
    epoch: int | None = None


#: The naming rules, most specific first; each pattern matches a whole name (its suffix and a trailing rank
#: removed): `(?P<epoch>)` and `(?P<step>)` are what it gives.
_NAME_RULES: tuple[re.Pattern[str], ...] = tuple(
    re.compile(pattern, re.IGNORECASE)
    for pattern in (
        r"epoch=(?P<epoch>\d+)-step=(?P<step>\d+)",  # Lightning's ModelCheckpoint default
        r"ep(?P<epoch>\d+)-ba(?P<step>\d+)",  # Composer: batches are its steps
        r"global_step_?(?P<step>\d+)",  # DeepSpeed (global_stepN), verl and ByteCheckpoint (global_step_N)
        r"(?:step|steps|iter|iteration|checkpoint|ckpt)[-_]?(?P<step>\d+)",  # step-00000010, iter_0000100, ...
        r"epoch[-_]?(?P<epoch>\d+)",  # epoch_0 (torchtune, accelerate's epoch folders)
    )
)
_RANK_SUFFIX = re.compile(r"[-_.]rank[-_]?\d+$", re.IGNORECASE)


def name_facts(name: str) -> NameFacts:
    """The step and epoch a checkpoint's name gives by the naming rules (`step-00000010`, `global_step_20`,
    `iter_0000100`, `checkpoint-30`, `epoch_1`, `epoch=1-step=40.ckpt`, `ep0-ba10-rank0.pt`); none when no rule
    matches the whole name."""
    stem = name
    for suffix in CHECKPOINT_SUFFIXES:
        stem = stem.removesuffix(suffix)
    stem = _RANK_SUFFIX.sub("", stem)
    for rule in _NAME_RULES:
        m = rule.fullmatch(stem)
        if m:
            found = m.groupdict()
            return NameFacts(
                int(found["step"]) if found.get("step") else None,
                int(found["epoch"]) if found.get("epoch") else None,
            )
    return NameFacts()


# --------------------------------------------------------------------------------------------------
# Checkpoint-like files.
# --------------------------------------------------------------------------------------------------


def checkpoint_like(url: str, entry: DirEntry) -> str | None:
    """What the file at `url` is, for people (`torch.save zip`), when it holds a checkpoint's bytes; else None.

    Reads at most a small prefix (a safetensors header), and only of files with a checkpoint's suffix; a
    link is never one (it points at one: see `_pointed_files`).
    """
    name = entry.name
    if entry.is_dir or name.startswith("."):
        return None
    if name.endswith(".distcp"):
        return "DCP data"
    if not name.endswith(CHECKPOINT_SUFFIXES) or _is_link(url):
        return None
    return _content(url, entry.size, entry.mtime)


@lru_cache(maxsize=4096)
def _content(url: str, size: int, mtime: float) -> str | None:
    """`checkpoint_like` of a file by its bytes (cached by size and time: the walk asks once per file)."""
    try:
        if url.endswith(".safetensors"):
            read_header(url, size)
            return "safetensors"
        head = io.read_bytes(url, 0, min(size, _ZIP_HEADER + 256))
    except CkptctlError:
        head = b""
    if head.startswith(_ZIP_MAGIC) and len(head) >= _ZIP_HEADER:
        (length,) = struct.unpack_from("<H", head, 26)
        if head[_ZIP_HEADER : _ZIP_HEADER + length].endswith(_TORCH_ENTRY):
            return "torch.save zip"
    if size >= MEANINGFUL_BYTES:
        return f"{size >> 20} MiB of a format ckptctl does not read"
    return None


def _is_link(url: str) -> bool:
    return io.is_local(url) and os.path.islink(io.local_path(url))


def _pointed_files(url: str, entries: Sequence[DirEntry]) -> set[str]:
    """The names of the files beside them that `latest`-style symbolic links in the folder point at."""
    if not io.is_local(url):
        return set()
    pointed = set()
    for entry in entries:
        path = os.path.join(io.local_path(url), entry.name)
        if not entry.is_dir and _POINTER_LINK.match(entry.name) and os.path.islink(path):
            with contextlib.suppress(OSError):  # removed while we look
                target = os.readlink(path)
                if "/" not in target:
                    pointed.add(target)
    return pointed


# --------------------------------------------------------------------------------------------------
# The walker's fallback.
# --------------------------------------------------------------------------------------------------


def _note(described: Sequence[tuple[str, str]]) -> str:
    shown = ", ".join(f"{name} ({what})" for name, what in described[:4])
    more = f" and {len(described) - 4} more" if len(described) > 4 else ""
    return f"not a layout ckptctl knows; read as generic files: {shown}{more}"


def _ref(url: str, facts: NameFacts, entries: Sequence[DirEntry], note: str, latest: bool = False) -> CheckpointRef:
    times = [e.mtime for e in entries if e.mtime]
    return CheckpointRef(
        url=url,
        layout=GENERIC,
        step=facts.step,
        epoch=None if facts.epoch is None else float(facts.epoch),
        created=timestamp(max(times) if times else None),
        state=CheckpointState.UNKNOWN,
        size_bytes=sum(e.size for e in entries),
        latest=latest,
        note=note,
    )


def unclaimed(
    url: str, entries: Sequence[DirEntry], claimed: frozenset[str] = frozenset()
) -> tuple[CheckpointRef | None, list[CheckpointRef]]:
    """The unknown checkpoints of a folder no plugin recognised: the folder itself, when it holds
    checkpoint-like files whose names give no step, and each checkpoint-like file whose name does.

    Args:
        url: the folder.
        entries: its listing.
        claimed: names of its files that a plugin took for whole checkpoints (Lightning's `.ckpt`).

    Returns:
        The folder's ref (its own files only: its child folders are walked on) or None, and the files' refs.
    """
    found = [(e, what) for e in entries if e.name not in claimed and (what := checkpoint_like(io.join(url, e.name), e))]
    if not found:
        return None, []
    pointed = _pointed_files(url, entries)
    files, loose = [], []
    for entry, what in found:
        facts = name_facts(entry.name)
        if facts == NameFacts():
            loose.append((entry, what))
        else:
            note = _note([(entry.name, what)])
            files.append(_ref(io.join(url, entry.name), facts, [entry], note, latest=entry.name in pointed))
    folder = None
    if loose:
        own = [e for e in entries if not e.is_dir]
        folder = _ref(url, name_facts(io.name_of(url)), own, _note([(e.name, what) for e, what in loose]))
    return folder, files


class GenericLayout(Layout):
    """Checkpoints of a layout ckptctl does not know: listed (state `unknown`), never opened as a training
    state, never deleted. Not in the registry: the walker asks it after every plugin, and `get_layout(GENERIC)`
    returns it for the commands that act on what the walk found."""

    name = GENERIC
    checkpoint_files = CHECKPOINT_SUFFIXES

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """The folder, when its own checkpoint-like files have names that give no step (see `unclaimed`)."""
        return unclaimed(url, entries)[0]

    def identify_file(self, url: str, entry: DirEntry) -> CheckpointRef | None:
        """A checkpoint-like file, whatever its name."""
        what = checkpoint_like(url, entry)
        return None if what is None else _ref(url, name_facts(entry.name), [entry], _note([(entry.name, what)]))

    def open(self, url: str) -> Checkpoint:
        """Never: what the files are for cannot be told (the error names them, as `list` does; of a folder that
        holds other folders, a run folder's hint comes first)."""
        ref = self._ref_of(url)
        hint = _HINT
        if io.is_dir(url) and any(e.is_dir for e in io.list_dir(url)):
            hint = f"if this is a run folder, use `{shell('ckptctl', 'list', url)}` to see its checkpoints; {hint}"
        raise UnknownLayout(f"{url}: {ref.note}", hint)

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """Never reached: `open` refuses (see `read_as_files`)."""
        raise UnknownLayout(f"{checkpoint.url}: {checkpoint.ref.note}", _HINT)

    def resume_profile(self) -> ResumeProfile:
        """Nothing a resume can be judged by."""
        profile = generic_profile(GENERIC)
        return ResumeProfile(
            framework=profile.framework, hint=profile.hint, world_size=profile.world_size, resumable=False
        )

    def _ref_of(self, url: str) -> CheckpointRef:
        if io.is_dir(url):
            ref = self.identify(url, io.list_dir(url))
        else:
            name = io.name_of(url)
            entry = next((e for e in io.list_dir(io.parent_of(url)) if e.name == name), None)
            ref = None if entry is None else self.identify_file(url, entry)
        if ref is None:
            raise UnknownLayout(f"{url} holds no checkpoint-like file", "check the path")
        return ref


#: What a person can do with a checkpoint of a layout ckptctl does not know.
_HINT = (
    "ckptctl reads each file on its own (`ckptctl inspect FILE`, `ckptctl verify FILE`) but cannot tell "
    "whether the checkpoint is whole or what a resume needs (`prune` never deletes it)"
)


@cache
def generic_layout() -> GenericLayout:
    """The one instance (layouts hold no state)."""
    return GenericLayout()


def read_as_files(ref: CheckpointRef) -> list[Problem]:
    """`verify` of an unknown checkpoint: each of its checkpoint-like files checked as a single file (a torch.save
    zip's pickle through the allowlist and its storages inside the file, a safetensors header), then the one
    problem that makes the verdict: not a layout ckptctl knows."""
    from ckptctl.layouts.single_file import detect_file

    if io.is_dir(ref.url):
        entries = io.list_dir(ref.url)
        files = [io.join(ref.url, e.name) for e in entries if checkpoint_like(io.join(ref.url, e.name), e)]
    else:
        files = [ref.url]
    problems = [Problem(ProblemKind.UNKNOWN_LAYOUT, "", ref.note or _note([]))]
    for file in files:
        if file.endswith(".distcp"):
            continue
        rel = "" if file == ref.url else io.name_of(file)
        try:
            layout, _ = detect_file(file)
            found = layout.verify(layout.open(file))
        except CkptctlError as exc:
            found = [Problem.from_error(exc, "")]
        # A single file's problems name it "" (itself): here it is one file of the checkpoint.
        problems += [replace(p, path=p.path or rel) for p in found]
    return problems
