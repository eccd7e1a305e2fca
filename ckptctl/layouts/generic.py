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

What makes a file checkpoint-like is `layouts.checkpoint_like`; the layout of a recognised training state is
`layouts.training_state_layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import cache
from typing import TYPE_CHECKING

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Problem, ProblemKind
from ckptctl.contract.base import Layout, timestamp
from ckptctl.contract.step_names import CHECKPOINT_SUFFIXES, NameFacts, name_facts
from ckptctl.errors import CkptctlError, UnknownLayout
from ckptctl.io import DirEntry
from ckptctl.layouts.checkpoint_like import checkpoint_like, pointed_files, training_state_of
from ckptctl.layouts.run_state import run_state_files
from ckptctl.quoting import shell

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile
    from ckptctl.contract.training_state import TrainingState

__all__ = [
    "GENERIC",
    "TRAINING_STATE",
    "UNKNOWN_HINT",
    "GenericLayout",
    "NameFacts",
    "generic_layout",
    "name_facts",
    "read_as_files",
    "unclaimed",
]

#: The layout name (and state) of what the generic reader finds: `list --json` says `"layout": "unknown"`.
GENERIC = "unknown"
#: The layout name of a training state the generic reader recognises by its top-level keys (`training_state`):
#: a step-named torch.save file, or a folder holding one (`step-00000010/lit_model.pth`).
TRAINING_STATE = "training_state"


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
    pointed = pointed_files(url, entries)
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
        """The child a `latest`-style link or tracker file names (see `pointed_files`), when it names one."""
        pointed = pointed_files(url, entries)
        return next(iter(pointed)) if len(pointed) == 1 else None

    def open(self, url: str) -> Checkpoint:
        """Never: what the files are for cannot be told (the error names them, as `list` does; of a folder that
        holds other folders, a run folder's hint comes first)."""
        ref = self._ref_of(url)
        hint = UNKNOWN_HINT
        if io.is_dir(url) and any(e.is_dir for e in io.list_dir(url)):
            hint = f"if this is a run folder, use `{shell('ckptctl', 'list', url)}` to see its checkpoints; {hint}"
        raise UnknownLayout(f"{url}: {ref.note}", hint)

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """Never reached: `open` refuses (see `read_as_files`)."""
        raise UnknownLayout(f"{checkpoint.url}: {checkpoint.ref.note}", UNKNOWN_HINT)

    def resume_profile(self) -> ResumeProfile:
        """Nothing a resume can be judged by."""
        from ckptctl.contract.resume import ResumeProfile, generic_profile

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
UNKNOWN_HINT = (
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
