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

Such a file whose name gives a step or an epoch (the naming rules of `contract.step_names`: `ep0-ba10-rank0.pt`) is a
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
from dataclasses import replace
from functools import cache, lru_cache

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Component, Problem, ProblemKind
from ckptctl.contract.base import Layout, timestamp
from ckptctl.contract.resume import PlanContext, ResumeProfile, generic_profile
from ckptctl.contract.step_names import CHECKPOINT_SUFFIXES, NameFacts, name_facts
from ckptctl.contract.training_state import TrainingState, read_training_state
from ckptctl.errors import CkptctlError, UnknownLayout
from ckptctl.formats.safetensors import read_header
from ckptctl.formats.torch_pickle_classes import OPAQUE_PICKLE_GLOBALS
from ckptctl.formats.torch_zip import TorchArchive
from ckptctl.io import DirEntry
from ckptctl.layouts.run_state import run_state_files
from ckptctl.quoting import shell

__all__ = [
    "GENERIC",
    "TRAINING_STATE",
    "GenericLayout",
    "NameFacts",
    "TrainingStateLayout",
    "checkpoint_like",
    "generic_layout",
    "name_facts",
    "training_state_layout",
    "training_state_of",
    "unclaimed",
]

#: The layout name (and state) of what the generic reader finds: `list --json` says `"layout": "unknown"`.
GENERIC = "unknown"
#: A file so named but of no format ckptctl reads counts from this size on (a smaller one is a note, a stub).
MEANINGFUL_BYTES = 1 << 20
#: Names of symbolic links that point at the newest checkpoint beside them (Composer's `latest-rank0.pt`,
#: Lightning's `last.ckpt`).
_POINTER_LINK = re.compile(r"^(?:latest|last)(?:[-_.].*)?$", re.IGNORECASE)

_ZIP_MAGIC = b"PK\x03\x04"
_ZIP_HEADER = 30  # a zip local file header's fixed part; the name's length is at byte 26
_TORCH_ENTRY = b"/data.pkl"
_TORCH_ZIP = "torch.save zip"
#: The layout name of a training state the generic reader recognises by its top-level keys (`training_state`):
#: a step-named torch.save file, or a folder holding one (`step-00000010/lit_model.pth`).
TRAINING_STATE = "training_state"


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
    if not name.endswith(CHECKPOINT_SUFFIXES) or io.is_link(url):
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
            return _TORCH_ZIP
    if size >= MEANINGFUL_BYTES:
        return f"{size >> 20} MiB of a format ckptctl does not read"
    return None


@lru_cache(maxsize=4096)
def _training_state(url: str, size: int, mtime: float) -> TrainingState | None:
    """What a torch.save file holds when its top-level keys make it a training state with a model (the pickle
    read through the allowlist, cached by size and time: the walk asks once per file); else None."""
    from ckptctl.formats.torch_pickle import open_torch_pickle

    try:
        root = open_torch_pickle(url, size, OPAQUE_PICKLE_GLOBALS).root
    except CkptctlError:  # verify says why
        return None
    state = read_training_state(root)
    return state if Component.MODEL in state.components.values() else None


def training_state_of(url: str, entry: DirEntry) -> TrainingState | None:
    """`_training_state` of a checkpoint-like torch.save file (None for any other file)."""
    if checkpoint_like(url, entry) != _TORCH_ZIP:
        return None
    return _training_state(url, entry.size, entry.mtime or 0.0)


def _pointed_files(url: str, entries: Sequence[DirEntry]) -> set[str]:
    """The names of the entries beside them that `latest`-style symbolic links (Composer's `latest-rank0.pt`,
    a `latest` link to a folder) or tracker files (`latest`, `latest_checkpointed_iteration.txt`: a name or a
    step) in the folder name."""
    pointed = set()
    names = {e.name for e in entries}
    for entry in entries:
        if not _POINTER_LINK.match(entry.name):
            continue
        path = io.join(url, entry.name)
        if io.is_link(path):
            with contextlib.suppress(OSError):  # removed while we look
                target = os.readlink(io.local_path(path)).rstrip("/")
                if "/" not in target and target in names:
                    pointed.add(target)
        elif not entry.is_dir and entry.size <= _MAX_TRACKER and _TRACKER.match(entry.name):
            pointed |= _tracked(path, entries)
    return pointed


#: Tracker files: a small text file naming the newest checkpoint beside it, or its step (Megatron-style
#: `latest_checkpointed_iteration.txt`, DeepSpeed-style `latest`).
_TRACKER = re.compile(r"^(?:latest|last)(?:[-_.][\w.-]*)?$", re.IGNORECASE)
_MAX_TRACKER = 256


def _tracked(url: str, entries: Sequence[DirEntry]) -> set[str]:
    try:
        text = io.read_bytes(url, 0, _MAX_TRACKER).decode("utf-8", "strict").strip()
    except (CkptctlError, UnicodeDecodeError):
        return set()
    names = {e.name for e in entries}
    if text in names and text != io.name_of(url):
        return {text}
    if text.isdigit() and len(text) <= 18:
        step = int(text)
        return {e.name for e in entries if name_facts(e.name).step == step}
    return set()


# --------------------------------------------------------------------------------------------------
# The walker's fallback.
# --------------------------------------------------------------------------------------------------


def _note(described: Sequence[tuple[str, str]]) -> str:
    shown = ", ".join(f"{name} ({what})" for name, what in described[:4])
    more = f" and {len(described) - 4} more" if len(described) > 4 else ""
    return f"not a layout ckptctl knows; read as generic files: {shown}{more}"


def _ref(
    url: str,
    facts: NameFacts,
    entries: Sequence[DirEntry],
    note: str,
    latest: bool = False,
    state: TrainingState | None = None,
) -> CheckpointRef:
    """An unknown checkpoint's ref, or with `state` a recognised training state's (its counters give the step
    and epoch its name does not)."""
    times = [e.mtime for e in entries if e.mtime]
    step = facts.step if facts.step is not None or state is None else state.step
    epoch = None if facts.epoch is None else float(facts.epoch)
    return CheckpointRef(
        url=url,
        layout=GENERIC if state is None else TRAINING_STATE,
        step=step,
        epoch=epoch if epoch is not None or state is None else state.epoch,
        created=timestamp(max(times) if times else None),
        state=CheckpointState.UNKNOWN if state is None else CheckpointState.COMPLETE,
        size_bytes=sum(e.size for e in entries),
        latest=latest,
        note=note if state is None else "",
    )


def unclaimed(
    url: str, entries: Sequence[DirEntry], claimed: frozenset[str] = frozenset(), *, run_state: bool = False
) -> tuple[CheckpointRef | None, list[CheckpointRef]]:
    """The unknown checkpoints of a folder no plugin recognised: the folder itself, when it holds
    checkpoint-like files whose names give no step, and each checkpoint-like file whose name does.

    Args:
        url: the folder.
        entries: its listing.
        claimed: names of its files that a plugin took for whole checkpoints (Lightning's `.ckpt`).
        run_state: count run-level state files beside child folders (`layouts.run_state`) too: the walker
            asks so only when no model folder beside them took them.

    Returns:
        The folder's ref (its own files only: its child folders are walked on) or None, and the files' refs.
    """
    if not run_state:
        claimed = claimed | frozenset(run_state_files(entries))
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
            state = training_state_of(io.join(url, entry.name), entry)
            files.append(_ref(io.join(url, entry.name), facts, [entry], note, entry.name in pointed, state))
    folder = None
    if loose:
        own = [e for e in entries if not e.is_dir]
        # One training state and nothing else checkpoint-like: the folder is that state (LitGPT's step folders).
        state = training_state_of(io.join(url, loose[0][0].name), loose[0][0]) if len(loose) == 1 else None
        folder = _ref(url, name_facts(io.name_of(url)), own, _note([(e.name, what) for e, what in loose]), state=state)
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
        """A checkpoint-like file, whatever its name (a training state's ref when it is one)."""
        what = checkpoint_like(url, entry)
        if what is None:
            return None
        return _ref(
            url, name_facts(entry.name), [entry], _note([(entry.name, what)]), state=training_state_of(url, entry)
        )

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """The child a `latest`-style link or tracker file names (see `_pointed_files`), when it names one."""
        pointed = _pointed_files(url, entries)
        return next(iter(pointed)) if len(pointed) == 1 else None

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


class TrainingStateLayout(Layout):
    """A training state the generic reader recognises by its top-level keys (`contract.training_state`): a
    torch.save file whose name gives a step (Composer's `ep0-ba10-rank0.pt`), or a folder holding one such file
    and nothing else checkpoint-like (LitGPT's `step-00000010/lit_model.pth`). Read as a single torch file
    (`layouts.single_file.TorchFile`): its model, optimizer, scheduler, RNG and counters, as its keys say. Not in
    the registry: the walker finds it, `get_layout(TRAINING_STATE)` returns it."""

    name = TRAINING_STATE
    checkpoint_files = CHECKPOINT_SUFFIXES

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        ref = unclaimed(url, entries)[0]
        return ref if ref is not None and ref.layout == TRAINING_STATE else None

    def identify_file(self, url: str, entry: DirEntry) -> CheckpointRef | None:
        ref = generic_layout().identify_file(url, entry)
        return ref if ref is not None and ref.layout == TRAINING_STATE else None

    def open(self, url: str) -> Checkpoint:
        from ckptctl.layouts.single_file import TorchFile

        ref, rel = self._ref_and_file(url)
        opened = TorchFile().open(io.join(url, rel) if rel else url)
        index = opened.tensor_index()
        if rel:  # the file's chunks name it "" (itself): here it is one file of the folder
            index = tuple(replace(e, chunks=tuple(replace(c, file=rel) for c in e.chunks)) for e in index)
        files = {rel: opened.ref.size_bytes} if rel else dict(opened.files)
        step = ref.step if ref.step is not None else opened.ref.step
        epoch = ref.epoch if ref.epoch is not None else opened.ref.epoch
        return replace(
            opened,
            ref=replace(ref, step=step, epoch=epoch),
            metadata={**opened.metadata, "state file": rel or io.name_of(url)},
            tensor_index=lambda: index,
            files=files,
        )

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """Its state file read whole: the pickle through the allowlist, every storage inside the file."""
        from ckptctl.layouts.single_file import TorchFile

        rel = next(iter(checkpoint.files), "")
        file = io.join(checkpoint.url, rel) if rel else checkpoint.url
        layout = TorchFile()
        try:
            found = layout.verify(layout.open(file))
        except CkptctlError as exc:
            found = [Problem.from_error(exc, "")]
        return [replace(p, path=p.path or rel) for p in found]

    def torch_archives(self, checkpoint: Checkpoint) -> Sequence[TorchArchive]:
        """Its state file (the checkpoint itself when it is a file)."""
        return tuple(TorchArchive(rel) for rel in checkpoint.files)

    def resume_profile(self) -> ResumeProfile:
        """What its keys hold is what a resume restores; the framework that wrote it is not known."""
        return replace(generic_profile(TRAINING_STATE), hint=_training_state_hint)

    def _ref_and_file(self, url: str) -> tuple[CheckpointRef, str]:
        if io.is_dir(url):
            entries = io.list_dir(url)
            ref = self.identify(url, entries)
            if ref is None:
                raise UnknownLayout(f"{url} holds no training state ckptctl can read", _HINT)
            rel = next(e.name for e in entries if training_state_of(io.join(url, e.name), e) is not None)
            return ref, rel
        name = io.name_of(url)
        entry = next((e for e in io.list_dir(io.parent_of(url)) if e.name == name and not e.is_dir), None)
        ref = None if entry is None else generic_layout().identify_file(url, entry)
        if ref is None or ref.layout != TRAINING_STATE:
            raise UnknownLayout(f"{url} is no training state ckptctl can read", _HINT)
        return ref, ""


def _training_state_hint(ctx: PlanContext) -> str:
    return (
        f"load {ctx.url} with the training code that wrote it (torch.load; its keys: "
        f"{ctx.checkpoint.metadata.get('training state keys', '?')})"
    )


@cache
def training_state_layout() -> TrainingStateLayout:
    """The one instance (layouts hold no state)."""
    return TrainingStateLayout()


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
