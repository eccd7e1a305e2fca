"""`reshard` to verl: a verl `global_step_N` (or one role folder of it) saved on W ranks, written for W' ranks in
the shape verl 0.9.1's own `FSDPCheckpointManager.load_checkpoint` takes (`TrainingStateWriter`).

verl loads, on rank r of W', `model_world_size_{W'}_rank_{r}.pt` into `model.load_state_dict`,
`optim_world_size_{W'}_rank_{r}.pt` into `optimizer.load_state_dict` and `extra_state_world_size_{W'}_rank_{r}.pt`
(`{lr_scheduler, rng}`), each with `torch.load(weights_only=False)` (verl/utils/checkpoint/
fsdp_checkpoint_manager.py). FSDP2 copies each loaded DTensor into its parameter's DTensor locally, so every
rank file holds DTensors whose mesh equals the mesh the resuming run builds and whose local shard is that rank's
piece by DTensor's own rule (`formats.dtensor`: `torch.chunk` pieces per `Shard(d)`, whole per `Replicate()`).

What is written, per role (`actor`, `critic`, ...):
- model and optimizer files: every DTensor cut for rank r from the source's bytes (read through ckptctl's
  allowlisting reader, never `torch.load`), on the mesh verl's `create_device_mesh(W', fsdp_size)` builds for the
  source's `fsdp_size`: `("fsdp",)` of W' for a 1-D mesh (`fsdp_size` -1 or >= W); for HSDP
  `("ddp", "fsdp")` of (D, F), (W'/F, F) when F < W', else `("fsdp",)` of W'. Plain tensors (an optimizer's
  `step`, a buffer FSDP leaves whole) are rank 0's, on every rank; `param_groups` as saved. Each mesh is made
  without a process group and keeps the source's device type and group names (`_source_mesh`); the resuming
  run's fsdp_size for each role is named in the `resume_hint`. A dimension shorter than the ranks cutting it
  leaves the last ranks empty pieces, as FSDP2 itself does.
- extra_state: the file of source rank r, byte for byte (its LR scheduler is the same on every rank; its RNG
  is rank r's own), rank 0's for ranks r >= W: verl seeds every rank with the same seed on a fresh start
  (`enable_full_determinism(seed)`), so ranks sharing one stream is what verl itself does.
- `fsdp_config.json` with the new `world_size` (after the rank files, as verl writes it), everything else in
  the role folder (`huggingface/`, `lora_train_meta.json`) copied.
A step folder also gets its other files (`data.pt`, the single data loader on verl's driver, whatever the world
size) copied, and the run's tracker naming the step, written last.

FSDP1 saves (`FSDP_version` 1, verl's `strategy=fsdp`: `use_orig_params=False` on a 1-D mesh) are written as
FSDP1 loads them (`frameworks.verl.fsdp1`): on W' >= 2 ranks each model parameter a DTensor `Shard(0)` on a
`("fsdp",)` mesh of W' (buffers whole), on one rank (`NO_SHARD`) every model entry whole; the optimizer's
FlatParameter states re-cut as FSDP1 cuts them for W' ranks (ceil(N / W') elements each, zeros after the end),
its other states (`step`) whole. A one-rank source records no mesh: its device type is the one whose RNG state
its extra_state holds (verl's `get_rng_state` saves the accelerator's under its name). FSDP1's HSDP
(`HYBRID_SHARD` on a 2-D mesh) and `use_orig_params=True` saves are refused.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, TensorEntry
from ckptctl.contract.capabilities import NotCarried, ReshardRequest, WrittenState
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.chunks import read_chunk
from ckptctl.formats.documents import read_json
from ckptctl.formats.dtensor import DTensorFacts, Placement, dtensor_facts, state_tensors
from ckptctl.formats.dtensor_classes import DTENSOR_PICKLE_GLOBALS, DTensorRef
from ckptctl.formats.safe_pickle import state_fields
from ckptctl.formats.torch_pickle import open_torch_pickle
from ckptctl.formats.torch_pickle_classes import OrderedDictStandIn, TensorRef
from ckptctl.frameworks.verl.files import STEP_RE, TRACKERS, tracker_of
from ckptctl.frameworks.verl.fsdp1 import FlatOptimizer, is_param, param_numels, plan_flat_optimizer
from ckptctl.frameworks.verl.layout import (
    MARKER,
    RoleFacts,
    mesh_coordinate,
    rank_file_name,
    role_facts,
    role_index,
    step_roles,
)

if TYPE_CHECKING:
    import torch

__all__ = ["WRITER", "VerlStateWriter", "role_fsdp_config", "source_roles", "torn_file"]

_KINDS = ("model", "optim", "extra_state")
_MAX_CONFIG = 1 << 16
#: The placements a verl FSDP2 mesh dimension of each name may hold: FSDP shards over `fsdp` and replicates
#: over HSDP's `ddp`.
_MESH_NAMES = {("fsdp",), ("ddp", "fsdp")}
#: The name of the default process group (`torch.distributed.distributed_c10d`: the first group made), which a
#: mesh dimension over the whole world uses.
_DEFAULT_GROUP = "0"


# --------------------------------------------------------------------------------------------------
# The source: its roles, checked whole before anything is written.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _SourceRole:
    """A role folder of the source: where it lies, its listing's facts, and where it goes in the staging folder."""

    url: str
    facts: RoleFacts
    out: str

    @property
    def world(self) -> int:
        world = self.facts.world_size
        assert world is not None
        return world


def source_roles(source: Checkpoint) -> tuple[str, list[_SourceRole]]:
    """(the staging subfolder of the step, or "" for a role folder; the roles) of a verl checkpoint."""
    url = source.url
    name = io.name_of(url)
    if STEP_RE.match(name):
        return name, [
            _SourceRole(io.join(url, r.name), r, f"{name}/{r.name}") for r in step_roles(url, io.list_dir(url))
        ]
    facts = role_facts(name, io.list_dir(url))
    return "", [] if facts is None else [_SourceRole(url, facts, "")]


def torn_file(role: _SourceRole) -> str | None:
    """Why a role is not a whole save, naming the file it lacks."""
    facts = role.facts
    if facts.world_size is None:
        return f"{role.url}: rank files of several world sizes ({', '.join(map(str, sorted(facts.world_sizes)))})"
    for kind in _KINDS:
        for rank in range(facts.world_size):
            if rank_file_name(kind, facts.world_size, rank) not in facts.files:
                return f"{io.join(role.url, rank_file_name(kind, facts.world_size, rank))} is missing: the save is torn"
    if not facts.has_marker:
        return f"{io.join(role.url, MARKER)} is missing: rank 0 writes it after the rank files, the save did not finish"
    return None


def role_fsdp_config(role: _SourceRole) -> dict[str, Any]:
    config = read_json(io.join(role.url, MARKER), max_bytes=_MAX_CONFIG)
    if not isinstance(config, dict) or config.get("world_size") != role.world:
        raise CorruptCheckpoint(f"{io.join(role.url, MARKER)} does not say world_size {role.world}")
    return config


def _fsdp_version(role: _SourceRole) -> int:
    version = role_fsdp_config(role).get("FSDP_version")
    if version not in (1, 2):
        raise CkptctlError(f"{io.join(role.url, MARKER)} says FSDP_version {version}: verl saves FSDP 1 or 2")
    return int(version)


def _accelerator(role: _SourceRole) -> str:
    """The device type of a one-rank FSDP1 save (which records no mesh): the accelerator whose RNG state its
    extra_state holds beside the CPU's (verl/utils/checkpoint/checkpoint_manager.py `get_rng_state`), else cpu."""
    file = rank_file_name("extra_state", role.world, 0)
    root = open_torch_pickle(io.join(role.url, file), role.facts.files.get(file), DTENSOR_PICKLE_GLOBALS).root
    rng = root.get("rng") if type(root) is dict else None
    devices = [k for k in rng if k not in ("cpu", "numpy", "random")] if type(rng) is dict else []
    if len(devices) > 1 or not all(type(d) is str and d.isidentifier() for d in devices):
        raise CorruptCheckpoint(f"{io.join(role.url, file)}: RNG states of several devices {devices}")
    return devices[0] if devices else "cpu"


# --------------------------------------------------------------------------------------------------
# Where each DTensor goes on W' ranks.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    """A DTensor's sharding on the target: DTensor facts with the target's placements, mesh shape and names."""

    facts: DTensorFacts
    device_type: str
    group_names: tuple[str, ...]


def _target(facts: DTensorFacts, mesh: _SourceMesh, world: int, name: str) -> _Target:
    """Where verl's mesh for `world` ranks puts a DTensor saved on `facts`' mesh (the module docstring's rule).

    Raises:
        CkptctlError: a mesh verl's FSDP workers do not build, a placement FSDP does not make, or an HSDP
            fsdp_size that does not divide the new world size.

    A dimension shorter than the ranks that cut it is not refused: FSDP2 gives the last ranks empty pieces
    (a critic's (1, hidden) value head on 2 ranks), verl saves and loads them so, and so are they written.
    """
    names, shape, placements = facts.mesh_dim_names, facts.mesh_shape, facts.placements
    if names not in _MESH_NAMES:
        raise CkptctlError(
            f"{name} lies on a device mesh {list(names) or 'without names'} of shape {list(shape)}: verl's FSDP "
            "workers build (fsdp,) or (ddp, fsdp) meshes, and ckptctl reshards only those"
        )
    if names == ("ddp", "fsdp"):
        if placements[0].kind != "replicate":
            raise CkptctlError(f"{name} is {placements[0]} over HSDP's ddp dimension, which FSDP replicates")
        fsdp_size = shape[1]
        if fsdp_size < world:
            if world % fsdp_size:
                raise CkptctlError(
                    f"the source's fsdp_size {fsdp_size} does not divide world size {world}: verl's "
                    "create_device_mesh needs (world // fsdp_size, fsdp_size) to cover every rank"
                )
            target = replace(facts, mesh_shape=(world // fsdp_size, fsdp_size))
            return _Target(target, mesh.device_type, mesh.group_names)
        # A 1-D mesh over the whole world: its group is the default one, as the source's whole-world ddp's.
        target = replace(facts, mesh_shape=(world,), mesh_dim_names=("fsdp",), placements=placements[1:])
        whole = [g for g, n in zip(mesh.group_names, shape, strict=True) if n == math.prod(shape)]
        return _Target(target, mesh.device_type, (whole[0] if whole else _DEFAULT_GROUP,))
    return _Target(replace(facts, mesh_shape=(world,)), mesh.device_type, mesh.group_names)


def _fsdp1_target(value: Any, source_world: int, world: int, device: str, where: str) -> _Target | None:
    """Where FSDP1 on `world` ranks takes a model entry (the module docstring): None for a whole tensor."""
    if world == 1 or not is_param(value, source_world):
        return None
    if type(value) is DTensorRef:
        facts = dtensor_facts(value, where)
        if facts.mesh_dim_names != ("fsdp",) or facts.placements != (Placement("shard", 0),):
            raise CkptctlError(
                f"{where} is {', '.join(map(str, facts.placements))} on a {list(facts.mesh_dim_names)} mesh: "
                "ckptctl reshards FSDP1 saves of verl's 1-D (fsdp,) mesh, not its HSDP (HYBRID_SHARD) ones"
            )
        mesh = _source_mesh(value, 1, where)
        return _Target(replace(facts, mesh_shape=(world,)), mesh.device_type, mesh.group_names)
    facts = DTensorFacts(value.dtype, value.shape, value, (Placement("shard", 0),), (world,), ("fsdp",), None)
    return _Target(facts, device, (_DEFAULT_GROUP,))


@dataclass(frozen=True)
class _SourceMesh:
    """What a source DTensor's pickled mesh records beyond its shape: its device type (`cuda` for a GPU save:
    verl's mesh equals only a mesh of its own device type) and the names of its dimensions' process groups."""

    device_type: str
    group_names: tuple[str, ...]


def _source_mesh(ref: DTensorRef, ndim: int, source: str) -> _SourceMesh:
    """The mesh facts of a pickled DTensor (`_SourceMesh`).

    The group names matter: the resuming rank's optimizer keeps the loaded DTensors (moved to its device) as
    its state, and a collective on one (gathering a full state dict, DCP) resolves its mesh's groups by these
    names. verl builds its meshes in the same order whatever the world size, so the target's are the source's.
    """
    mesh = state_fields(state_fields(ref.spec, source)["mesh"], source)
    device = mesh.get("_device_type", mesh.get("device_type"))
    if type(device) is not str or not device.isidentifier():
        raise CorruptCheckpoint(f"{source}: a device mesh without a device type")
    names: Any = mesh.get("_dim_group_names")
    if (
        not isinstance(names, list | tuple)
        or len(names) != ndim
        or not all(type(n) is str and len(n) < 256 for n in names)
    ):
        raise CorruptCheckpoint(f"{source}: a device mesh without the names of its process groups")
    return _SourceMesh(device, tuple(names))


# --------------------------------------------------------------------------------------------------
# A rank file's state dict: the source's structure with each tensor cut for the target rank.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    """One tensor of a rank file: its index entry (the global tensor's chunks) and, for a DTensor, its target."""

    entry: TensorEntry
    target: _Target | None


@dataclass(frozen=True)
class _RankFile:
    """A model or optimizer rank file as rank 0 of the source saved it: its structure (containers of plain
    values and tensor references) and what each tensor reference becomes."""

    kind: str
    root: Any
    tensors: Mapping[int, _Tensor]


def _plan_file(
    role: _SourceRole, kind: str, index: Mapping[str, TensorEntry], world: int, fsdp1_device: str | None = None
) -> _RankFile:
    """The structure of a role's `kind` rank file and each tensor's target sharding, from rank 0's file
    (`fsdp1_device`: an FSDP1 model file, and the device type of its meshes where it records none).

    Raises:
        CkptctlError: a tensor the index lacks or the target cannot cut, a mesh verl does not build.
    """
    file = rank_file_name(kind, role.world, 0)
    source = io.join(role.url, file)
    opened = open_torch_pickle(source, role.facts.files.get(file), DTENSOR_PICKLE_GLOBALS)
    prefix = "" if kind == "model" else "optimizer."
    tensors: dict[int, _Tensor] = {}
    for path, value in state_tensors(opened.root):
        entry = index.get(prefix + path)
        if entry is None:
            raise CorruptCheckpoint(f"{source}: {path} is not in the role's tensor index")
        target = None
        if fsdp1_device is not None:
            target = _fsdp1_target(value, role.world, world, fsdp1_device, f"{source}: {path}")
        elif type(value) is DTensorRef:
            where = f"{source}: {path}"
            facts = dtensor_facts(value, where)
            mesh = _source_mesh(value, len(facts.mesh_shape), where)
            target = _target(facts, mesh, world, f"{role.out or '.'}/{path}")
        tensors[id(value)] = _Tensor(entry, target)
    return _RankFile(kind, opened.root, tensors)


def _realize(value: Any, tensor: Callable[[Any], Any], where: str) -> Any:
    """`value` (what the allowlisting reader rebuilt) as the plain objects torch.save writes, each tensor
    reference replaced by `tensor(reference)`.

    Raises:
        CkptctlError: something other than containers, plain values and tensors (an object reshard cannot
            rebuild without unpickling it).
    """
    if type(value) in (TensorRef, DTensorRef):
        return tensor(value)
    if type(value) is dict:
        return {k: _realize(v, tensor, where) for k, v in value.items()}
    if type(value) is OrderedDictStandIn:
        # `module.state_dict()`: an OrderedDict whose `_metadata` (each module's state-dict version) the
        # loader hands to `_load_from_state_dict`.
        ordered = OrderedDict((k, _realize(v, tensor, where)) for k, v in value.items())
        state = getattr(value, "state", None)
        if state is not None:
            if type(state) is not dict or set(state) != {"_metadata"}:
                raise CkptctlError(f"{where}: an OrderedDict with state other than _metadata")
            ordered._metadata = _realize(state["_metadata"], tensor, where)  # type: ignore[attr-defined]
        return ordered
    if type(value) in (list, tuple):
        return type(value)(_realize(v, tensor, where) for v in value)
    if value is None or type(value) in (str, int, float, bool, bytes):
        return value
    raise CkptctlError(f"{where} holds a {type(value).__name__}, which reshard does not rebuild")


def _read_box(url: str, entry: TensorEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The part of a global tensor at `offsets` of `sizes`, from the chunks that overlap it (each read whole)."""
    import torch

    out = torch.empty(sizes, dtype=getattr(torch, entry.dtype))
    if math.prod(sizes) == 0:
        return out
    for chunk in entry.chunks:
        starts = [max(o, c) for o, c in zip(offsets, chunk.offsets, strict=True)]
        ends = [min(o + s, c + n) for o, s, c, n in zip(offsets, sizes, chunk.offsets, chunk.sizes, strict=True)]
        if any(e <= s for s, e in zip(starts, ends, strict=True)):
            continue
        data = read_chunk(url, entry, chunk)
        into = tuple(slice(s - o, e - o) for s, e, o in zip(starts, ends, offsets, strict=True))
        take = tuple(slice(s - c, e - c) for s, e, c in zip(starts, ends, chunk.offsets, strict=True))
        out[into] = data[take]
    return out


class _Meshes:
    """The DeviceMesh of each target rank, made without a process group (`_init_backend=False`): what torch
    pickles of it (layout, rank map, names, device type, the rank's coordinate) is what the resuming rank's
    `init_device_mesh` mesh equals."""

    def __init__(self) -> None:
        self._made: dict[tuple[str, tuple[int, ...], tuple[str, ...], tuple[str, ...], int], Any] = {}

    def get(self, target: _Target, rank: int) -> Any:
        import torch
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.distributed_c10d import GroupName

        facts = target.facts
        key = (target.device_type, facts.mesh_shape, facts.mesh_dim_names, target.group_names, rank)
        if key not in self._made:
            ranks = torch.arange(math.prod(facts.mesh_shape), dtype=torch.int).reshape(facts.mesh_shape)
            mesh = DeviceMesh(
                target.device_type, ranks, mesh_dim_names=facts.mesh_dim_names, _init_backend=False, _rank=rank
            )
            # What `_init_process_groups` sets, and torch pickles, on a mesh made with its groups.
            mesh._dim_group_names = [GroupName(n) for n in target.group_names]
            self._made[key] = mesh
        return self._made[key]


def _dtensor(local: torch.Tensor, target: _Target, mesh: Any) -> Any:
    """A DTensor of `local` on `mesh`, built without collectives (what `DTensor.from_local` makes, minus its
    move of the local tensor to the mesh's device: the resuming rank's `load_state_dict` copies it there)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    facts = target.facts
    placements = tuple(
        Shard(p.dim) if p.kind == "shard" and p.dim is not None else Replicate() for p in facts.placements
    )
    stride = tuple(math.prod(facts.shape[i + 1 :]) for i in range(len(facts.shape)))
    meta = TensorMeta(torch.Size(facts.shape), stride, getattr(torch, facts.dtype))
    return DTensor(local, DTensorSpec(mesh, placements, tensor_meta=meta), requires_grad=False)


def _rank_state(role: _SourceRole, planned: _RankFile, rank: int, meshes: _Meshes) -> tuple[Any, int]:
    """(the state dict of target rank `rank`'s file of `planned.kind`, its tensor bytes)."""
    written = 0

    def tensor(ref: Any) -> Any:
        nonlocal written
        found = planned.tensors[id(ref)]
        entry, target = found.entry, found.target
        if target is None:
            local = _read_box(role.url, entry, (0,) * len(entry.shape), entry.shape)
            written += local.nbytes
            return local
        mesh = meshes.get(target, rank)
        offsets, sizes = target.facts.local_box(mesh_coordinate(None, rank, target.facts.mesh_shape))
        local = _read_box(role.url, entry, offsets, sizes)
        written += local.nbytes
        return _dtensor(local, target, mesh)

    state = _realize(planned.root, tensor, f"{role.url}/{rank_file_name(planned.kind, role.world, 0)}")
    return state, written


def _flat_rank_state(role: _SourceRole, flat: FlatOptimizer, rank: int, world: int) -> tuple[Any, int]:
    """(the FSDP1 optimizer state dict of target rank `rank`, its tensor bytes): each FlatParameter state's
    piece for the rank, zeros after the FlatParameter's end as FSDP1 pads it."""
    import torch

    written = 0

    def tensor(ref: Any) -> Any:
        nonlocal written
        entry, start, held, padding = flat.shard(ref, rank, world)
        if not entry.shape:
            local = _read_box(role.url, entry, (), ())
        else:
            local = _read_box(role.url, entry, (start,), (held,))
            if padding:
                local = torch.cat([local, local.new_zeros(padding)])
        written += local.nbytes
        return local

    return _realize(flat.root, tensor, f"{role.url}/{rank_file_name('optim', role.world, 0)}"), written


@dataclass(frozen=True)
class _RolePlan:
    """What a role's model and optimizer rank files become: FSDP2's DTensor files, or an FSDP1 model file and
    its FlatParameter optimizer."""

    files: tuple[_RankFile, ...]
    flat: FlatOptimizer | None

    @property
    def tensors(self) -> int:
        flat = 0 if self.flat is None else len(self.flat.flat) + len(self.flat.whole)
        return sum(len(p.tensors) for p in self.files) + flat

    def rank_files(self, role: _SourceRole, rank: int, world: int, meshes: _Meshes) -> Iterator[tuple[str, Any, int]]:
        """(kind, state dict, tensor bytes) of each model and optimizer file of target rank `rank`, one at a time."""
        for planned in self.files:
            yield (planned.kind, *_rank_state(role, planned, rank, meshes))
        if self.flat is not None:
            yield ("optim", *_flat_rank_state(role, self.flat, rank, world))


def _plan_role(role: _SourceRole, world: int) -> _RolePlan:
    """The role's plan for `world` ranks (the module docstring).

    Raises:
        CkptctlError: what `_plan_file` and `fsdp1.plan_flat_optimizer` refuse.
    """
    index = {e.name: e for e in role_index(role.url, role.facts, "")}
    if _fsdp_version(role) == 2:
        return _RolePlan(tuple(_plan_file(role, kind, index, world) for kind in ("model", "optim")), None)
    device = _accelerator(role) if role.world == 1 else "cpu"
    model = _plan_file(role, "model", index, world, device)
    names = [rank_file_name("optim", role.world, r) for r in range(role.world)]
    params = param_numels(model.root, role.world)
    return _RolePlan((model,), plan_flat_optimizer(role.url, role.facts.files, names, params, role.world))


# --------------------------------------------------------------------------------------------------
# The writer.
# --------------------------------------------------------------------------------------------------


def _copy(url: str, path: str) -> int:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return io.download_file(url, path)


def _write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}..{last}"


def _rng_not_carried(role: _SourceRole, world: int) -> Iterator[NotCarried]:
    """What becomes of the ranks' RNG states (the module docstring's rule) when the rank count changes."""
    source = role.world
    what = f"{role.out or '.'}/extra_state.rng"
    if world > source:
        new = _ranks(source, world - 1)
        yield NotCarried(
            what,
            f"{new} {'has' if world - source == 1 else 'have'} no RNG state of its own in the source and "
            f"{'gets' if world - source == 1 else 'get'} rank 0's (verl seeds every rank with the same seed on a "
            f"fresh start, so ranks sharing a stream is what verl does itself); {_ranks(0, source - 1)} keep their own",
        )
    elif world < source:
        yield NotCarried(
            what,
            f"the RNG state of source {_ranks(world, source - 1)} is dropped: {_ranks(0, world - 1)} resume with "
            "the state of the source rank of the same number",
        )


def _staging_path(staging: str, relative: str) -> str:
    return os.path.join(staging, *relative.split("/"))


class VerlStateWriter:
    """Writes a verl step folder (or role folder) for another world size (the module docstring)."""

    target = "verl"

    def refusal(self, source: Checkpoint, world_size: int | None) -> str | None:
        """A checkpoint of another layout, a torn role (naming the missing file), a mesh verl does not build
        (naming the tensor), an HSDP fsdp_size the new world size is not a multiple of, or an FSDP1 save other
        than verl's default (HSDP, use_orig_params, a wrapping its shard sizes do not tell)."""
        if source.ref.layout != "verl":
            return f"{source.url} is a {source.ref.layout} checkpoint: reshard writes verl state only from verl's"
        if world_size is not None and world_size < 1:
            return f"world size {world_size}: a verl run has at least one rank"
        try:
            _, roles = source_roles(source)
            if not roles:
                return f"{source.url} holds no verl role folder"
            for role in roles:
                torn = torn_file(role)
                if torn is not None:
                    return torn
            for role in roles:
                _plan_role(role, world_size or role.world)
        except CkptctlError as exc:
            return exc.message
        return None

    def write(self, request: ReshardRequest, advance: Callable[[int], None]) -> WrittenState:
        """Each role's rank files, extra states, config and copied files, then the step's files and its tracker."""
        import torch

        source = request.source
        refused = self.refusal(source, request.world_size)
        if refused is not None:
            raise CkptctlError(refused)
        step_folder, roles = source_roles(source)
        world = request.world_size or roles[0].world
        meshes = _Meshes()
        files: list[str] = []
        tensors = 0
        written = 0
        not_carried: list[NotCarried] = []
        for role in roles:
            plan = _plan_role(role, world)
            tensors += plan.tensors
            out = role.out
            for rank in range(world):
                for kind, state, size in plan.rank_files(role, rank, world, meshes):
                    relative = "/".join(p for p in (out, rank_file_name(kind, world, rank)) if p)
                    path = _staging_path(request.staging, relative)
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    torch.save(state, path)
                    del state
                    files.append(relative)
                    written += size
                    advance(size)
                # The extra state of the source rank of the same number, else rank 0's (the module docstring).
                origin = rank_file_name("extra_state", role.world, rank if rank < role.world else 0)
                # Read through the allowlist first: the copy is never unpickled here, but it is not passed on
                # unless ckptctl's reader takes it.
                open_torch_pickle(io.join(role.url, origin), role.facts.files.get(origin), DTENSOR_PICKLE_GLOBALS)
                relative = "/".join(p for p in (out, rank_file_name("extra_state", world, rank)) if p)
                _copy(io.join(role.url, origin), _staging_path(request.staging, relative))
                files.append(relative)
            not_carried += _rng_not_carried(role, world)
            for name in sorted(io.list_tree(role.url)):
                if name == MARKER or (
                    "/" not in name
                    and any(name.startswith(f"{k}_world_size_") and name.endswith(".pt") for k in _KINDS)
                ):
                    continue
                relative = "/".join(p for p in (out, name) if p)
                _copy(io.join(role.url, name), _staging_path(request.staging, relative))
                files.append(relative)
            config = {**role_fsdp_config(role), "world_size": world}
            relative = "/".join(p for p in (out, MARKER) if p)
            _write_text(_staging_path(request.staging, relative), json.dumps(config, indent=4))
            files.append(relative)
        hint = None
        if step_folder:
            role_names = {io.name_of(r.url) for r in roles}
            for name in sorted(io.list_tree(source.url)):
                if name.split("/", 1)[0] in role_names:
                    continue
                relative = f"{step_folder}/{name}"
                _copy(io.join(source.url, name), _staging_path(request.staging, relative))
                files.append(relative)
            tracker = tracker_of(io.parent_of(source.url))
            tracker_name = tracker[0] if tracker is not None else TRACKERS[0]
            step = STEP_RE.match(step_folder)
            assert step is not None
            _write_text(_staging_path(request.staging, tracker_name), step.group(1))
            files.append(tracker_name)
            hint = (
                f"trainer.resume_mode=auto trainer.default_local_dir=<DST> on {world} rank{'s' if world > 1 else ''} "
                "(trainer.nnodes x trainer.n_gpus_per_node)"
            )
        hint = _mesh_hint(roles, world, hint)
        return WrittenState(
            tensors=tensors,
            bytes=written,
            files=tuple(files),
            world_size=world,
            not_carried=tuple(not_carried),
            resume_hint=hint,
        )


def _mesh_hint(roles: list[_SourceRole], world: int, hint: str | None) -> str | None:
    """The hint, with the fsdp_size each HSDP role must keep for its mesh to be the one written."""
    kept = []
    for role in roles:
        facts = role.facts
        file = rank_file_name("model", role.world, 0)
        opened = open_torch_pickle(io.join(role.url, file), facts.files.get(file), DTENSOR_PICKLE_GLOBALS)
        first = next((v for _, v in state_tensors(opened.root) if type(v) is DTensorRef), None)
        if first is None:
            continue
        mesh = dtensor_facts(first, file)
        if mesh.mesh_dim_names == ("ddp", "fsdp") and mesh.mesh_shape[1] < world:
            kept.append(f"{io.name_of(role.url)} fsdp_size={mesh.mesh_shape[1]}")
        else:
            kept.append(f"{io.name_of(role.url)} fsdp_size=-1")
    if not kept:
        return hint
    meshes = "the rank files are cut for " + ", ".join(kept)
    return f"{hint}; {meshes}" if hint else meshes


WRITER = VerlStateWriter()
