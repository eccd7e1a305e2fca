"""What `Accelerator.load_state(DIR)` reads of a `save_state` folder: its load set (`contract.load_set`), decided
from the folder's own facts.

Read from accelerate 1.16: `Accelerator.load_state` (`accelerator.py`) hands the prepared objects to
`load_accelerator_state` (`checkpointing.py`), which reads one file per object, numbered as `save_accelerator_state`
numbered them: `model[_{i}].safetensors` (else `pytorch_model[_{i}].bin`), `optimizer[_{i}].bin`,
`scheduler[_{i}].bin`, `sampler[_{i}].bin` (a `SeedableRandomSampler`'s, saved and loaded under the same
condition), `dl_state_dict[_{i}].bin` (a stateful data loader's, loaded only when present: without it the data order
restarts, silently), `scaler.pt` (the fp16 `GradScaler`); then `custom_checkpoint_{i}.pkl` for each object given to
`register_for_checkpointing` (`load_state` raises when their count differs from the objects'). Every other file
missing makes `torch.load` (`accelerate.utils.load`) raise `FileNotFoundError`: a folder without one of them does
not load into the run that saved it. The RNG files (`random_states_{i}.pkl`) are the layout's rules (its
completion marker), and DeepSpeed tags and FSDP folders their own readers'.

What was saved is the folder's facts: each kind's files are numbered from 0, so a gap names a missing file; a kind
missing entirely is told by the run's other saves (the sibling folders beside it that `save_state` completed), and
the message says that is where the evidence comes from. A folder alone cannot tell that a whole kind is missing,
except the scheduler and the optimizer: torch's LR schedulers write `initial_lr` into the optimizer's parameter
groups, so an optimizer state holding it without any `scheduler.bin` fails, and a `scheduler.bin` without any
`optimizer.bin` fails (a scheduler steps an optimizer the run prepared).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ckptctl import io
from ckptctl.contract.base import absent_numbers
from ckptctl.contract.load_set import LoadMember, MemberKind
from ckptctl.errors import CkptctlError
from ckptctl.formats.torch_pickle import open_torch_pickle
from ckptctl.io import DirEntry
from ckptctl.layouts import peek, peek_dir

__all__ = ["expected_files", "save_state_members", "torn_note"]

_READ_BY = "accelerate load_accelerator_state"
#: Each kind of file save_state numbers: (pattern with the index as group 1 and None for 0, first name, other
#: names with `{i}`, what it holds). A model is `model.safetensors` or `pytorch_model.bin`, as the run saved it.
_KINDS: tuple[tuple[re.Pattern[str], str, str, str], ...] = (
    (
        re.compile(r"^model(?:_(\d+))?\.safetensors$"),
        "model.safetensors",
        "model_{i}.safetensors",
        "the weights of a model",
    ),
    (
        re.compile(r"^pytorch_model(?:_(\d+))?\.bin$"),
        "pytorch_model.bin",
        "pytorch_model_{i}.bin",
        "the weights of a model",
    ),
    (re.compile(r"^optimizer(?:_(\d+))?\.bin$"), "optimizer.bin", "optimizer_{i}.bin", "the state of an optimizer"),
    (re.compile(r"^scheduler(?:_(\d+))?\.bin$"), "scheduler.bin", "scheduler_{i}.bin", "the state of an LR scheduler"),
    (re.compile(r"^sampler(?:_(\d+))?\.bin$"), "sampler.bin", "sampler_{i}.bin", "the sampler state of a data loader"),
    (
        re.compile(r"^dl_state_dict(?:_(\d+))?\.bin$"),
        "dl_state_dict.bin",
        "dl_state_dict_{i}.bin",
        "the state of a stateful data loader",
    ),
    (
        re.compile(r"^custom_checkpoint_(\d+)\.pkl$"),
        "custom_checkpoint_0.pkl",
        "custom_checkpoint_{i}.pkl",
        "the state of an object given to register_for_checkpointing",
    ),
    (re.compile(r"^scaler\.pt$"), "scaler.pt", "scaler.pt", "the fp16 gradient scaler state"),
)


def _kind_of(name: str) -> tuple[int, int] | None:
    """(kind, index) of one of save_state's numbered files, or None."""
    for kind, (pattern, *_rest) in enumerate(_KINDS):
        if m := pattern.match(name):
            return kind, int(m.group(1) or 0) if m.groups() else 0
    return None


def _name(kind: int, index: int) -> str:
    _, first, other, _ = _KINDS[kind]
    return first if index == 0 else other.format(i=index)


def _numbered(names: Sequence[str] | frozenset[str]) -> dict[int, set[int]]:
    found: dict[int, set[int]] = {}
    for name in names:
        if (hit := _kind_of(name)) is not None:
            found.setdefault(hit[0], set()).add(hit[1])
    return found


def expected_files(url: str, names: frozenset[str]) -> dict[str, str]:
    """The numbered files the save_state folder at `url` (its top-level `names`) should hold but lacks, each
    with where that is known from: a gap in its kind's numbering, or every other completed save of the run."""
    missing: dict[str, str] = {}
    for kind, indices in _numbered(names).items():
        listed, _ = absent_numbers(indices, max(indices) + 1)
        for i in listed:
            missing[_name(kind, i)] = (
                f"{_KINDS[kind][2].format(i='N')} are numbered from 0 and this folder holds a later one"
            )
    siblings = peek(io.parent_of(url), _sibling_files) or {}
    others = {name: files for name, files in siblings.items() if name != io.name_of(url)}
    if others:
        named = ", ".join(sorted(others)[:3]) + (", ..." if len(others) > 3 else "")
        count = "the run's other save beside it" if len(others) == 1 else f"all {len(others)} other saves of the run"
        for name in sorted(frozenset.intersection(*others.values()) - names):
            missing.setdefault(name, f"this folder cannot tell, but {count} ({named}) hold it")
    return missing


def _sibling_files(url: str, entries: Sequence[DirEntry]) -> dict[str, frozenset[str]]:
    """For each completed save_state folder in the folder `url` (one holding `random_states_0.pkl`), its numbered
    files (`_KINDS`)."""
    found: dict[str, frozenset[str]] = {}
    for entry in entries:
        if not entry.is_dir:
            continue
        listing = peek_dir(io.join(url, entry.name)) or []
        files = {e.name for e in listing if not e.is_dir}
        if "random_states_0.pkl" in files:
            found[entry.name] = frozenset(n for n in files if _kind_of(n) is not None)
    return found


def torn_note(url: str, names: frozenset[str]) -> str:
    """Why the completed save_state folder is torn, from the listings alone ("" when it is not)."""
    missing = expected_files(url, names)
    return f"torn: {', '.join(sorted(missing))} missing" if missing else ""


def save_state_members(url: str, files: Mapping[str, int]) -> list[LoadMember]:
    """The numbered files `load_state` reads of the folder: those present, those its own numbering or its run's
    other saves say it lacks, `scheduler.bin` when the optimizer's state shows a scheduler, and `optimizer.bin`
    when a scheduler's state is here."""
    top = frozenset(name for name in files if "/" not in name)
    members = []
    for name in sorted(n for n in top if _kind_of(n) is not None):
        kind, _ = _kind_of(name) or (0, 0)
        members.append(LoadMember(name, _member_kind(name), _KINDS[kind][3], _READ_BY))
    for name, why in sorted(expected_files(url, top).items()):
        kind, _ = _kind_of(name) or (0, 0)
        members.append(
            LoadMember(
                name,
                _member_kind(name),
                _KINDS[kind][3],
                _READ_BY,
                missing=f"{why}; {_READ_BY} raises without it (or, for a data loader's state, restarts the data "
                "order without a word)",
            )
        )
    listed = {m.path for m in members}
    if "scheduler.bin" not in listed and not any(_KINDS[3][0].match(n) for n in top) and _has_initial_lr(url, files):
        # An error, not a warning: the fault matrix (tests/faults) proves `load_state` raising FileNotFoundError on
        # the run's own prepared objects, and a scheduler built on an optimizer accelerate prepares is the way
        # accelerate's examples and `get_scheduler` users run.
        members.append(
            LoadMember(
                "scheduler.bin",
                MemberKind.TORCH_SAVE,
                _KINDS[3][3],
                _READ_BY,
                missing="optimizer.bin's parameter groups hold `initial_lr`, which a torch LR scheduler writes: "
                f"{_READ_BY} raises without it when the run prepared that scheduler with accelerate (a run that "
                "never gave it to `prepare` loads without it)",
            )
        )
    plain = any((_kind_of(n) or (-1, 0))[0] in (0, 1) for n in top)  # a model file: no DeepSpeed, no FSDP
    optimizers = any(n.startswith("optimizer") for n in files)
    if plain and not optimizers and any(_KINDS[3][0].match(n) for n in top):
        # A prepared LR scheduler steps an optimizer accelerate prepared too (accelerate/accelerator.py:
        # prepare_scheduler pairs it with one of `self._optimizers`); without DeepSpeed or FSDP (whose optimizer
        # state lives in their own files) load_accelerator_state then reads optimizer.bin for it and raises
        # FileNotFoundError without it.
        members.append(
            LoadMember(
                "optimizer.bin",
                MemberKind.TORCH_SAVE,
                _KINDS[2][3],
                _READ_BY,
                missing=f"scheduler.bin is here, so the run prepared an optimizer for its scheduler to step: {_READ_BY} "
                "raises without its state",
            )
        )
    return members


def _has_initial_lr(url: str, files: Mapping[str, int]) -> bool:
    """Whether optimizer.bin's parameter groups hold `initial_lr` (its `data.pkl` only)."""
    if "optimizer.bin" not in files:
        return False
    try:
        root = open_torch_pickle(io.join(url, "optimizer.bin"), files["optimizer.bin"]).root
    except CkptctlError:
        return False
    groups = root.get("param_groups") if isinstance(root, dict) else None
    return isinstance(groups, list) and any(isinstance(g, dict) and "initial_lr" in g for g in groups)


def _member_kind(name: str) -> MemberKind:
    return MemberKind.SAFETENSORS if name.endswith(".safetensors") else MemberKind.TORCH_SAVE
