"""verl (and SkyRL) FSDP checkpoints (LAYOUTS.md, verl).

```
trainer.default_local_dir/                      checkpoints/${project}/${experiment}/
    latest_checkpointed_iteration.txt           the tracker: the last saved step, written last (SkyRL:
                                                latest_ckpt_global_step.txt)
    global_step_{N}/                            one checkpoint: what `trainer.resume_mode=auto` loads
        actor/                                  a role (SkyRL: policy/), and critic/ when one is trained
            model_world_size_{W}_rank_{R}.pt    torch.save of the rank's FSDP sharded state dict (DTensors)
            optim_world_size_{W}_rank_{R}.pt    the same of its optimizer state
            extra_state_world_size_{W}_rank_{R}.pt   {lr_scheduler, rng}
            huggingface/                        config.json + tokenizer (full weights only with `hf_model`)
            fsdp_config.json                    {FSDP_version, world_size}, written by rank 0 after its files
        data.pt                                 the data loader's state (SkyRL: trainer_state.pt too)
```

`FSDPCheckpointManager.save_checkpoint` (verl/utils/checkpoint/fsdp_checkpoint_manager.py) writes the rank files
on every rank, then rank 0 writes `huggingface/` and `fsdp_config.json`, then all ranks meet at a barrier; the
trainer (`RayPPOTrainer._save_checkpoint`, verl/trainer/ppo/ray_trainer.py) then writes `data.pt` and the tracker.
A role is therefore complete when `fsdp_config.json` is there and every rank's files of its world size are.

A step folder is the checkpoint (`list`, `prune`, `resume-plan`): verl resumes, and its tracker names, a
whole step. Its tensors are its actor's (policy's): the model `convert` writes. A role folder given directly
(`global_step_N/critic`) is a checkpoint of its own, to inspect, verify or convert that role.

Tensors are read through the allowlisting unpickler with DTensor stand-ins (`formats.dtensor`): each rank's
local shard becomes a chunk of the global tensor at the place its placements give it; a shard replicated over
mesh dimensions (HSDP's `ddp`) is taken from one rank only, and a plain tensor (a buffer FSDP leaves whole on
every rank) from rank 0 only, never concatenated (verl's merger once turned a (1,) buffer into (W,), verl PR#7610).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import (
    Checkpoint,
    CheckpointRef,
    CheckpointState,
    Component,
    Problem,
    ProblemKind,
    TensorChunk,
    TensorEntry,
)
from ckptctl.contract.base import (
    Layout,
    absent_numbers,
    every_child_folder,
    folder_size,
    list_files,
    newest_mtime,
    timestamp,
)
from ckptctl.contract.load_set import LoadMember, MemberKind
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.families.in_progress import unfinished_state
from ckptctl.families.torch_file import torch_file_problems
from ckptctl.formats.chunks import tiling_problem
from ckptctl.formats.documents import read_json
from ckptctl.formats.dtensor import dtensor_facts, state_tensors
from ckptctl.formats.dtensor_classes import DTENSOR_PICKLE_GLOBALS, DTensorRef
from ckptctl.formats.slim_marker import SLIM_MARKER
from ckptctl.formats.torch_pickle import TorchPickle, open_torch_pickle
from ckptctl.formats.torch_pickle_classes import TensorRef
from ckptctl.frameworks.verl.files import STEP_RE, read_tracker
from ckptctl.io import DirEntry
from ckptctl.layouts import peek_dir

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = [
    "HF_FOLDER",
    "MARKER",
    "RoleFacts",
    "VerlLayout",
    "mesh_coordinate",
    "rank_file_name",
    "role_facts",
    "role_index",
    "step_roles",
]

_RANK_FILE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
MARKER = "fsdp_config.json"
HF_FOLDER = "huggingface"
DATALOADER = "data.pt"
SKYRL_TRAINER_STATE = "trainer_state.pt"
#: The roles that hold the model people convert, best first (SkyRL calls the actor `policy`).
_POLICY_ROLES = ("actor", "policy")
_KINDS = ("model", "optim", "extra_state")
_MAX_SMALL = 1 << 16


# --------------------------------------------------------------------------------------------------
# A role folder from its listing.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoleFacts:
    """A role folder as its listing tells: its rank files by kind, its world size and what is missing."""

    name: str
    files: dict[str, int]
    ranks: dict[str, set[int]]
    world_sizes: frozenset[int]
    has_marker: bool
    has_hf: bool
    newest: float | None

    @property
    def world_size(self) -> int | None:
        return next(iter(self.world_sizes)) if len(self.world_sizes) == 1 else None

    def problem(self) -> str:
        """Why the role is not a finished save ("" when it is)."""
        if len(self.world_sizes) > 1:
            return f"{self.name}: rank files of several world sizes ({', '.join(map(str, sorted(self.world_sizes)))})"
        absent = next(self.absent_ranks(), None)
        if absent is not None:
            kind, world, missing, count = absent
            files = ", ".join(f"{self.name}/{rank_file_name(kind, world, rank)}" for rank in missing)
            more = f" and {count - len(missing)} more" if count > len(missing) else ""
            return f"{files}{more} missing ({count} of {world} {kind} rank files)"
        if not self.has_marker:
            return f"{self.name}: no {MARKER}: the save has not finished"
        return ""

    def absent_ranks(self) -> Iterator[tuple[str, int, list[int], int]]:
        """Each kind of rank file (a model file always) that some of the world's ranks lack: the kind, the world
        size, the first absent ranks and how many are absent (`absent_numbers`). The world size must be one."""
        world = self.world_size
        assert world is not None
        for kind in _KINDS:
            if kind not in self.ranks and kind != "model":
                continue
            missing, count = absent_numbers(self.ranks.get(kind, set()), world)
            if count:
                yield kind, world, missing, count


def rank_file_name(kind: str, world: int, rank: int) -> str:
    """The name of a rank's file of one kind (`model_world_size_2_rank_1.pt`)."""
    return f"{kind}_world_size_{world}_rank_{rank}.pt"


def role_facts(name: str, entries: Sequence[DirEntry]) -> RoleFacts | None:
    """The role folder's facts, or None when it holds no rank file."""
    ranks: dict[str, set[int]] = {}
    worlds = set()
    for entry in entries:
        if entry.is_dir:
            continue
        m = _RANK_FILE.match(entry.name)
        if m:
            world, rank = int(m.group(2)), int(m.group(3))
            worlds.add(world)
            if rank < world:
                ranks.setdefault(m.group(1), set()).add(rank)
    if not worlds:
        return None
    return RoleFacts(
        name,
        {e.name: e.size for e in entries if not e.is_dir},
        ranks,
        frozenset(worlds),
        any(e.name == MARKER and not e.is_dir for e in entries),
        any(e.name == HF_FOLDER and e.is_dir for e in entries),
        newest_mtime(entries),
    )


def step_roles(url: str, entries: Sequence[DirEntry]) -> list[RoleFacts]:
    """The role folders of a step folder, policy first."""
    found = []
    for entry in entries:
        if entry.is_dir and not entry.name.startswith("."):
            role = role_facts(entry.name, peek_dir(io.join(url, entry.name)) or [])
            if role is not None:
                found.append(role)
    return sorted(found, key=_role_order)


def _role_order(role: RoleFacts) -> tuple[int, str]:
    """The policy (actor) first: its model is what a step converts to."""
    return (_POLICY_ROLES.index(role.name) if role.name in _POLICY_ROLES else len(_POLICY_ROLES), role.name)


def _state(note: str, newest: float | None) -> CheckpointState:
    if not note:
        return CheckpointState.COMPLETE
    return unfinished_state(newest)


# --------------------------------------------------------------------------------------------------
# The tensor index: every rank's DTensor shards as chunks of the global tensors.
# --------------------------------------------------------------------------------------------------


def _open_rank_file(url: str, size: int | None) -> TorchPickle:
    return open_torch_pickle(url, size, DTENSOR_PICKLE_GLOBALS)


def mesh_coordinate(recorded: tuple[int, ...] | None, rank: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The rank's coordinate in the mesh: what its pickle records, else its rank unravelled in mesh order
    (DeviceMesh's default rank map)."""
    if recorded is not None:
        return recorded
    coordinate = []
    for n in reversed(mesh_shape):
        coordinate.append(rank % n)
        rank //= n
    return tuple(reversed(coordinate))


def role_index(role_url: str, role: RoleFacts, prefix: str) -> tuple[TensorEntry, ...]:
    """The global tensors of a role's model and optimizer rank files, each with one chunk per distinct shard.

    Args:
        role_url: the role folder.
        role: its facts.
        prefix: what chunk file names get in front (`actor/` for a step folder's index, "" for the role's own).

    Raises:
        CorruptCheckpoint: a rank file is missing or unreadable, shards disagree, or they do not cover a tensor.
        UnsafePickle: a rank file names a global outside the allowlist.
    """
    world = role.world_size
    if world is None:
        raise CorruptCheckpoint(f"{role_url}: rank files of several world sizes")
    entries: list[TensorEntry] = []
    # The model's tensors keep their stored names (PEFT's `base_layer`/`lora_A.default` included, for convert's
    # LoRA rules); the optimizer's get `optimizer.` in front.
    for kind in ("model", "optim"):
        if kind not in role.ranks:
            continue
        component = Component.MODEL if kind == "model" else Component.OPTIMIZER
        name_prefix = "" if kind == "model" else "optimizer."
        built: dict[str, tuple[str, tuple[int, ...], list[TensorChunk]]] = {}
        for rank in range(world):
            file = rank_file_name(kind, world, rank)
            if file not in role.files:
                raise CorruptCheckpoint(f"{role_url}: {file} is missing", "the save did not finish on every rank")
            opened = _open_rank_file(io.join(role_url, file), role.files[file])
            for name, value in state_tensors(opened.root):
                full = name_prefix + name
                chunk = _chunk(opened, value, rank, prefix + file, f"{role_url}/{file}: {name}")
                dtype, shape = value.dtype, value.shape
                have = built.setdefault(full, (dtype, shape, []))
                if have[0] != dtype or have[1] != shape:
                    raise CorruptCheckpoint(f"{role_url}: ranks disagree on the dtype or shape of {full}")
                if chunk is not None:
                    have[2].append(chunk)
        for name, (dtype, shape, chunks) in built.items():
            # The shared tiling rule, not an element count: two rank files that record the same mesh
            # coordinate (a rank's file copied over another's) add up to the right count while half the
            # tensor is missing.
            problem = tiling_problem(shape, [(c.offsets, c.sizes) for c in chunks])
            if problem is not None:
                raise CorruptCheckpoint(f"{role_url}: the shards of {name} do not tile it: {problem}")
            entries.append(TensorEntry(name, component, dtype, shape, tuple(chunks)))
    return tuple(entries)


def _chunk(opened: TorchPickle, value: TensorRef | DTensorRef, rank: int, file: str, source: str) -> TensorChunk | None:
    """The chunk rank `rank`'s file holds of a tensor, or None when another rank's copy is the one taken (a
    replicated shard, a plain tensor of a rank other than 0) or the shard is empty."""
    if type(value) is TensorRef:
        if rank != 0:
            return None
        local, offsets, sizes = value, (0,) * len(value.shape), value.shape
    else:
        assert type(value) is DTensorRef
        facts = dtensor_facts(value, source)
        coordinate = mesh_coordinate(facts.coordinate, rank, facts.mesh_shape)
        if not facts.is_primary(coordinate):
            return None
        offsets, sizes = facts.local_box(coordinate)
        local = facts.local
        if tuple(local.shape) != sizes:
            raise CorruptCheckpoint(
                f"{source}: the local shard is {list(local.shape)}, its placements say {list(sizes)}"
            )
    if math.prod(sizes) == 0:
        return None
    found = opened.byte_range(local)
    if found is None:
        raise CorruptCheckpoint(f"{source}: a shard that is not one contiguous little-endian range is not supported")
    start, end = found
    return TensorChunk(file, start, end - start, tuple(offsets), tuple(sizes))


# --------------------------------------------------------------------------------------------------
# The layout.
# --------------------------------------------------------------------------------------------------


class VerlLayout(Layout):
    """A verl/SkyRL `global_step_N/` folder (its role folders inside), or one role folder given directly."""

    name = "verl"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A `global_step_N` folder holding a role folder with FSDP rank files, or such a role folder itself."""
        name = io.name_of(url)
        m = STEP_RE.match(name)
        if m is not None:
            roles = step_roles(url, entries)
            if not roles:
                return None
            notes = [p for r in roles if (p := r.problem())]
            names = {e.name for e in entries if not e.is_dir}
            if not names & {DATALOADER, SKYRL_TRAINER_STATE, SLIM_MARKER}:
                # The trainer writes it after every role's files and before the tracker: without it the save
                # did not finish (or lost it since); `slim` drops it on purpose.
                notes.append(f"no {DATALOADER}")
            newest = max((t for t in [newest_mtime(entries), *(r.newest for r in roles)] if t), default=None)
            return CheckpointRef(
                url=url,
                layout=self.name,
                step=int(m.group(1)),
                epoch=None,
                created=timestamp(newest),
                state=_state("; ".join(notes), newest),
                size_bytes=folder_size(url, entries),
                note="; ".join(notes),
                roles=tuple(r.name for r in roles),
            )
        role = role_facts(name, entries)
        if role is None:
            return None
        step = STEP_RE.match(io.name_of(io.parent_of(url)))
        note = role.problem()
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=int(step.group(1)) if step else None,
            epoch=None,
            created=timestamp(role.newest),
            state=_state(note, role.newest),
            size_bytes=folder_size(url, entries),
            note=note,
            roles=(role.name,),
        )

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """The `global_step_N` folder the run's tracker names."""
        found = read_tracker(url, entries)
        if found is None:
            return None
        child = f"global_step_{found[1]}"
        return child if any(e.name == child and e.is_dir for e in entries) else None

    def members(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """Every child folder: a step's role folders and a role's `huggingface/` are part of it."""
        return every_child_folder(entries)

    def open(self, url: str) -> Checkpoint:
        """The step (its policy role's tensors) or the role: components, world size, roles, lazy index."""
        entries = io.list_dir(url)
        ref = self.identified(url, entries, "a verl checkpoint (global_step_N/ with actor/ or critic/ rank files)")
        is_step = STEP_RE.match(io.name_of(url)) is not None
        roles = step_roles(url, entries) if is_step else [r for r in [role_facts(io.name_of(url), entries)] if r]
        main = roles[0]
        main_url = io.join(url, main.name) if is_step else url
        prefix = f"{main.name}/" if is_step else ""
        names = {e.name for e in entries if not e.is_dir}
        components: set[Component] = set()
        fsdp_versions: dict[str, Any] = {}
        for role in roles:
            components |= _role_components(role)
            config = _read_small_json(io.join(url, role.name, MARKER) if is_step else io.join(url, MARKER))
            fsdp_versions[role.name] = config.get("FSDP_version") if isinstance(config, dict) else None
        if is_step and DATALOADER in names:
            components.add(Component.DATALOADER)
        if is_step and SKYRL_TRAINER_STATE in names:
            components.add(Component.TRAINER_STATE)
        metadata: dict[str, Any] = {
            "format": "verl",
            "kind": "step" if is_step else "role",
            "roles": [role.name for role in roles],
            "role_world_sizes": {role.name: role.world_size for role in roles},
            "fsdp_versions": fsdp_versions,
            "tensors_of": main.name,
            "resume_setting": "trainer.resume_mode=auto (the tracker's step), or trainer.resume_mode=resume_path "
            "trainer.resume_from_path=<global_step_N>",
        }
        if ref.step is not None:
            metadata["progress"] = {"global_step": ref.step}

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            return role_index(main_url, main, prefix)

        return Checkpoint(
            ref=ref,
            components=frozenset(components),
            world_size=main.world_size,
            metadata=metadata,
            tensor_index=tensor_index,
            files=list_files(url),
            progress={"global_step": ref.step} if ref.step is not None else {},
        )

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """Every role: all rank files of its world size, `fsdp_config.json` present and agreeing, each rank
        file's pickle safe and its storages inside the file, the shards covering every tensor; a step: its
        data loader state (and SkyRL's trainer state) safe where present (`load_set` requires `data.pt`)."""
        url = checkpoint.url
        entries = io.list_dir(url)
        is_step = STEP_RE.match(io.name_of(url)) is not None
        problems: list[Problem] = []
        if is_step:
            roles = [(f"{r.name}/", io.join(url, r.name), r) for r in step_roles(url, entries)]
            names = {e.name: e.size for e in entries if not e.is_dir}
            problems += [
                p
                for name in (DATALOADER, SKYRL_TRAINER_STATE)
                if name in names
                for p in _state_file(url, name, names[name])
            ]
        else:
            role = role_facts(io.name_of(url), entries)
            roles = [("", url, role)] if role is not None else []
        for prefix, role_url, role in roles:
            problems += _role_problems(prefix, role_url, role)
        return problems

    def load_set(self, checkpoint: Checkpoint) -> Sequence[LoadMember]:
        """A step's `data.pt` (each role's rank files of its world size and kinds, which verl's
        `FSDPCheckpointManager.load_checkpoint` reads, are the layout's own rules).

        verl 0.9.1 `RayPPOTrainer._load_checkpoint` (verl/trainer/ppo/ray_trainer.py) loads the roles, then
        `data.pt` into the train data loader; without it, it prints "No dataloader state found ... will start from
        scratch" and the resumed run sees the epoch's samples again: state it saved, lost. An error.
        """
        if STEP_RE.match(io.name_of(checkpoint.url)) is None or SKYRL_TRAINER_STATE in checkpoint.files:
            return ()  # SkyRL's trainer keeps its data loader in `trainer_state.pt` (read by the layout's rules)
        return (
            LoadMember(
                DATALOADER,
                MemberKind.TORCH_SAVE,
                "the data loader state",
                "verl RayPPOTrainer._load_checkpoint (else the data loader starts the epoch over)",
            ),
        )

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """Each role's `fsdp_config.json` (rank 0 writes it after its files), then the step's `data.pt`."""
        markers = sorted(n for n in files if n == MARKER or (n.count("/") == 1 and n.endswith(f"/{MARKER}")))
        return (*markers, *((DATALOADER,) if DATALOADER in files else ()))

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.verl.resume`."""
        from ckptctl.frameworks.verl.resume import PROFILE

        return PROFILE


def _role_components(role: RoleFacts) -> set[Component]:
    found = {Component.MODEL} if "model" in role.ranks else set()
    if "optim" in role.ranks:
        found.add(Component.OPTIMIZER)
    if "extra_state" in role.ranks:
        found |= {Component.SCHEDULER, Component.RNG}
    if role.has_hf:
        found |= {Component.CONFIG, Component.TOKENIZER}
    return found


def _read_small_json(url: str) -> Any:
    try:
        return read_json(url, max_bytes=_MAX_SMALL)
    except CkptctlError:
        return None


def _role_problems(prefix: str, role_url: str, role: RoleFacts | None) -> list[Problem]:
    if role is None:
        return []
    problems: list[Problem] = []
    if len(role.world_sizes) > 1:
        return [Problem(ProblemKind.UNEXPECTED_FILE, prefix, role.problem())]
    world = role.world_size
    for kind, world, missing, count in role.absent_ranks():
        for rank in missing:
            problems.append(
                Problem(
                    ProblemKind.MISSING_FILE,
                    f"{prefix}{rank_file_name(kind, world, rank)}",
                    f"{rank_file_name(kind, world, rank)} is missing (rank {rank} of {world} wrote no {kind} file): verl "
                    "cannot load this role on any rank",
                )
            )
        if count > len(missing):
            problems.append(
                Problem(ProblemKind.MISSING_FILE, prefix, f"{count - len(missing)} more {kind} rank files missing")
            )
    if not role.has_marker:
        problems.append(
            Problem(
                ProblemKind.IN_PROGRESS,
                f"{prefix}{MARKER}",
                f"no {MARKER}: rank 0 writes it after the rank files, so the save has not finished (verl's merger "
                "refuses the folder)",
            )
        )
    else:
        config = _read_small_json(io.join(role_url, MARKER))
        if not isinstance(config, dict) or type(config.get("world_size")) is not int:
            problems.append(Problem(ProblemKind.BAD_METADATA, f"{prefix}{MARKER}", f"{MARKER} holds no world_size"))
        elif config["world_size"] != world:
            problems.append(
                Problem(
                    ProblemKind.BAD_METADATA,
                    f"{prefix}{MARKER}",
                    f"{MARKER} says world_size {config['world_size']} but the rank files are of world size {world}",
                )
            )
    if not role.has_hf:
        problems.append(
            Problem(
                ProblemKind.MISSING_FILE,
                f"{prefix}{HF_FOLDER}/",
                f"no {HF_FOLDER}/: the model config and tokenizer verl saves with every role are missing",
                severity="warning",
            )
        )
    for file, size in sorted(role.files.items()):
        if not _RANK_FILE.match(file):
            continue
        _, found = torch_file_problems(
            prefix + file,
            partial(_open_rank_file, io.join(role_url, file), size),
            unreadable=ProblemKind.UNREADABLE,
            storages=_storage_problems,
        )
        problems += found
    if not any(p.severity == "error" for p in problems):
        try:
            role_index(role_url, role, prefix)
        except CkptctlError as exc:
            problems.append(Problem(ProblemKind.COVERAGE, prefix, exc.message))
    return problems


def _state_file(url: str, name: str, size: int) -> list[Problem]:
    """A step's plain torch.save state (`data.pt`, SkyRL's `trainer_state.pt`) read through the allowlist."""
    _, problems = torch_file_problems(
        name,
        partial(open_torch_pickle, io.join(url, name), size),
        unreadable=ProblemKind.UNREADABLE,
        storages=_storage_problems,
    )
    return problems


def _storage_problems(opened: TorchPickle) -> list[str]:
    """Why the storages of the file's tensors and DTensor shards do not all lie whole inside it."""
    refs: dict[str, TensorRef] = {}
    for _, value in state_tensors(opened.root):
        ref = value if isinstance(value, TensorRef) else value.local
        refs.setdefault(ref.storage_key, ref)
    try:
        for ref in refs.values():
            opened.storage_record(ref)
        opened.data_starts(refs.values())
    except CorruptCheckpoint as exc:
        return [exc.message]
    return []
