"""Multi-rank support: who we are in the process group, collectives, and torch DCP for sharded state.

Module and optimizer entries of a multi-rank save go through `torch.distributed.checkpoint` (DCP) into the
checkpoint's `dcp/` folder, keyed `{entry}.{flattened state_dict key}`. Their state dicts come from
`get_model_state_dict`/`get_optimizer_state_dict`, so FSDP2 (`fully_shard`) DTensor state stays sharded
and optimizer state is keyed by parameter FQN; DCP reshards on load, so a checkpoint restores in one
process (no process group) or in any number of ranks.

`torch.distributed.checkpoint` is imported inside the functions: it costs about a second and single-process
training never needs it.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ckptctl import io
from ckptctl.errors import SerializationError
from ckptctl.formats.dcp_metadata import parse_dcp_metadata

__all__ = [
    "World",
    "all_gather",
    "broadcast",
    "current_world",
    "dcp_files_of_rank",
    "load_dcp",
    "load_full_module",
    "load_full_optimizer",
    "save_dcp",
]

#: DCP's per-rank data files (`__{rank}_{n}.distcp`); every other file of `dcp/` is written by rank 0.
_DISTCP = re.compile(r"__(\d+)_\d+\.distcp")


@dataclass(frozen=True, slots=True)
class World:
    """This process's place in the default process group (rank 0 of 1 when there is none)."""

    rank: int = 0
    size: int = 1

    @property
    def multi(self) -> bool:
        return self.size > 1


def current_world() -> World:
    """The default process group's rank and size, or a world of one when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def broadcast(obj: Any, src: int = 0) -> Any:
    """`obj` of rank `src` on every rank (picklable objects only; small control messages)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, indexed by rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def owner_of(name: str, optimizer: torch.optim.Optimizer, modules: Mapping[str, torch.nn.Module]) -> torch.nn.Module:
    """The module entry whose parameters include every parameter of the optimizer.

    DCP's optimizer state dict is keyed by parameter FQN, which only the owning module knows.

    Raises:
        SerializationError: no single module entry of the state owns all the optimizer's parameters.
    """
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules.values():
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    raise SerializationError(
        f"optimizer state[{name!r}] updates parameters that no single module entry of the state holds",
        "put the model that owns all of the optimizer's parameters into the state",
    )


def _dcp_state(entries: Mapping[str, tuple[str, Any]], modules: Mapping[str, torch.nn.Module]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {}
    for name, (kind, obj) in entries.items():
        if kind == "module":
            state[name] = get_model_state_dict(obj)
        else:
            state[name] = get_optimizer_state_dict(owner_of(name, obj, modules), obj)
    return state


def save_dcp(path: str, entries: Mapping[str, tuple[str, Any]], modules: Mapping[str, torch.nn.Module]) -> None:
    """Save module and optimizer entries with DCP into `path` (a collective: every rank calls it).

    Args:
        path: the `dcp/` folder of the staging checkpoint (the same path on every rank).
        entries: name -> (kind, object) of the `module` and `optimizer` entries.
        modules: every module entry of the state, to find which module owns each optimizer.
    """
    import torch.distributed.checkpoint as dcp

    # fsync every file: the commit protocol depends on the data being durable before the manifest
    writer = dcp.FileSystemWriter(path, sync_files=True)
    dcp.save(_dcp_state(entries, modules), storage_writer=writer, no_dist=not current_world().multi)


def load_dcp(path: str, entries: Mapping[str, tuple[str, Any]], modules: Mapping[str, torch.nn.Module]) -> None:
    """Load module and optimizer entries from a DCP folder into live objects, resharding as needed.

    Works in one process without a process group (full tensors assembled from every rank's shards) and
    in any number of ranks (every rank calls it).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _dcp_state(entries, modules)
    # torch reads `.metadata` with a plain `pickle.load`: let the allowlisting parser see it first, so a
    # tampered file is refused before torch's unpickler could run anything from it.
    parse_dcp_metadata(io.read_bytes(io.join(path, ".metadata")), io.join(path, ".metadata"))
    with warnings.catch_warnings():
        # torch warns that it "assumes" a single process; loading in one is what we mean to do
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=not current_world().multi)
    for name, (kind, obj) in entries.items():
        if kind == "module":
            set_model_state_dict(obj, state[name])
        else:
            set_optimizer_state_dict(owner_of(name, obj, modules), obj, state[name])


def load_full_module(module: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """Load a full (unsharded) module state dict on every rank of a multi-rank run; FSDP2 shards it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, dict(state), options=StateDictOptions(full_state_dict=True))


def load_full_optimizer(owner: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load a single-process optimizer state dict (keyed by parameter index) on every rank of a multi-rank run.

    The indices are mapped to FQNs through the live optimizer's parameter order (the order the saving
    optimizer had, since it was built the same way) so that DCP's state-dict helpers can shard the state.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    fqn_of = {id(p): name for name, p in owner.named_parameters()}
    index_to_fqn: dict[Any, str] = {}
    for saved, live in zip(state["param_groups"], optimizer.param_groups, strict=True):
        for index, param in zip(saved["params"], live["params"], strict=True):
            index_to_fqn[index] = fqn_of[id(param)]
    keyed: dict[str, Any] = {
        "state": {index_to_fqn[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [index_to_fqn[i] for i in g["params"]]} for g in state["param_groups"]],
    }
    set_optimizer_state_dict(owner, optimizer, keyed, options=StateDictOptions(full_state_dict=True))
    # The full-state path flattens the hyperparameters (tuples come back as lists): set them as saved,
    # the way Optimizer.load_state_dict does.
    for live, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        live.update({k: v for k, v in saved.items() if k != "params"})


def dcp_files_of_rank(path: str, world: World) -> list[str]:
    """The files of a DCP folder that this rank wrote and must hash: its own `__{rank}_*.distcp`, plus
    every other file (`.metadata`) on rank 0."""
    mine = []
    for name in sorted(os.listdir(path)):
        m = _DISTCP.fullmatch(name)
        if (int(m.group(1)) == world.rank) if m else world.rank == 0:
            mine.append(name)
    return mine
