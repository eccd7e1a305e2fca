"""verl's FSDP1 saves (`strategy=fsdp`, `fsdp_config.json` `FSDP_version` 1) as `reshard` reads and writes them.

verl wraps each role with `FullyShardedDataParallel(use_orig_params=False, device_mesh=mesh, auto_wrap_policy=...)`
(verl/workers/engine/fsdp/transformer_impl.py `_build_fsdp_module`), and its `FSDPCheckpointManager` saves, inside
`FSDP.state_dict_type(SHARDED_STATE_DICT)` (verl/utils/checkpoint/fsdp_checkpoint_manager.py):

- `model.state_dict()`: FSDP1's sharded state dict, one entry per original parameter name. With a device mesh
  (verl always passes one) a parameter is a DTensor `Shard(0)` on the 1-D `("fsdp",)` mesh, cut by `torch.chunk`
  as FSDP2 cuts it (torch/distributed/fsdp/_shard_utils.py `_create_chunk_dtensor`); a buffer stays a plain tensor.
  On one rank FSDP1 runs `NO_SHARD` (torch/distributed/fsdp/_init_utils.py `_init_core_state`), whose state dict
  is the full one: every entry a plain tensor.
- `optimizer.state_dict()`, the plain optimizer's: its parameters are FSDP1's FlatParameters, one per wrapped
  module (the FSDP unit) in `model.parameters()` order (units in module pre-order), each the concatenation of the
  unit's own parameters (those no nested unit holds) flattened in `parameters()` order, without padding between
  them (`use_orig_params=False` aligns nothing: torch/distributed/fsdp/_flat_param.py `FlatParamHandle.__init__`).
  Rank r holds `flat[r*c : (r+1)*c]` with c = ceil(N / W), the last ranks' pieces padded with zeros to c
  (`FlatParamHandle._get_shard`); on one rank, the whole N elements. Each state tensor of the same shape as its
  FlatParameter's shard (Adam's moments) is cut the same way; others (`step`) are whole on every rank.

The optimizer files do not record N, only c: the unit each parameter belongs to is found from the names and sizes
of the model file (a unit is a module, its parameters the ones under that module's name) by matching the shard
sizes c of every FlatParameter in order (`flat_numels`); a save that matches no wrapping, or two wrappings that
give different sizes, is refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Component, TensorChunk, TensorEntry
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.dtensor import state_tensors
from ckptctl.formats.dtensor_classes import DTENSOR_PICKLE_GLOBALS, DTensorRef
from ckptctl.formats.torch_pickle import TorchPickle, open_torch_pickle
from ckptctl.formats.torch_pickle_classes import TensorRef

__all__ = ["FlatOptimizer", "flat_numels", "is_param", "param_numels", "plan_flat_optimizer"]

#: Wrappings kept while matching, per module and position: real models match one; more is a save whose sizes
#: many wrappings fit, which is refused rather than searched.
_MAX_WAYS = 64


# --------------------------------------------------------------------------------------------------
# Which FSDP unit holds which parameters: the FlatParameters' numels.
# --------------------------------------------------------------------------------------------------


@dataclass
class _Module:
    """A module of the model as its parameters' names show it: its own parameters' numels and its children."""

    own: list[int] = field(default_factory=list)
    children: dict[str, _Module] = field(default_factory=dict)


def _module_tree(params: Sequence[tuple[str, int]]) -> _Module:
    root = _Module()
    for name, numel in params:
        node = root
        *path, _ = name.split(".")
        for part in path:
            node = node.children.setdefault(part, _Module())
        node.own.append(numel)
    return root


# One way to cover a module's subtree: (the next FlatParameter position, elements left to the enclosing unit,
# the numels of the FlatParameters it made, in order).
_Way = tuple[int, int, tuple[int, ...]]


class _Matcher:
    """Finds the FSDP wrappings whose FlatParameters have the saved shard sizes (`flat_numels`)."""

    def __init__(self, shards: Sequence[int], world: int) -> None:
        self.shards = shards
        self.world = world

    def _cap(self, ways: set[_Way]) -> set[_Way]:
        if len(ways) > _MAX_WAYS:
            raise CkptctlError(
                "more than one FSDP wrapping of the model fits its FlatParameters' shard sizes, so their lengths "
                "are not known"
            )
        return ways

    def _children(self, node: _Module, start: int) -> set[_Way]:
        """The ways to cover a module's children from FlatParameter `start`, summing what they leave."""
        ways: set[_Way] = {(start, 0, ())}
        for child in node.children.values():
            ways = self._cap(
                {
                    (end, left + more, made + also)
                    for position, left, made in ways
                    for end, more, also in self.either(child, position)
                }
            )
        return ways

    def either(self, node: _Module, start: int) -> set[_Way]:
        """The ways to cover a module: left to its enclosing unit, or a unit of its own."""
        return self._cap(self.loose(node, start) | {(end, 0, made) for end, made in self.unit(node, start)})

    def loose(self, node: _Module, start: int) -> set[_Way]:
        own = sum(node.own)
        return {(end, left + own, made) for end, left, made in self._children(node, start)}

    def unit(self, node: _Module, start: int) -> set[tuple[int, tuple[int, ...]]]:
        """The ways to make `node` an FSDP unit at FlatParameter `start`: its own FlatParameter first (when it
        keeps any elements: an empty unit makes none), then its nested units'."""
        own = sum(node.own)
        found = set()
        if start < len(self.shards):
            for end, left, made in self._children(node, start + 1):
                numel = own + left
                if numel and -(-numel // self.world) == self.shards[start]:
                    found.add((end, (numel, *made)))
        if not own:
            found |= {(end, made) for end, left, made in self._children(node, start) if not left}
        return found


def flat_numels(params: Sequence[tuple[str, int]], shards: Sequence[int], world: int) -> tuple[int, ...]:
    """The numel of each FlatParameter of an FSDP1 model, from its parameters' names and numels (in module order)
    and the elements each rank holds of each FlatParameter (`shards`, in `model.parameters()` order).

    Raises:
        CkptctlError: no wrapping of the modules (the root always one unit) has these shard sizes, or wrappings
            with different FlatParameter lengths do.
    """
    matcher = _Matcher(shards, world)
    found = {made for end, made in matcher.unit(_module_tree(params), 0) if end == len(shards)}
    if not found:
        raise CkptctlError(
            f"no FSDP wrapping of the model's modules gives FlatParameters of {list(shards)} elements per rank "
            f"on {world} rank{'s' if world > 1 else ''}: a save with tied or frozen parameters, use_orig_params "
            "or a model file that is not the optimizer's"
        )
    if len(found) > 1:
        raise CkptctlError(
            f"{len(found)} FSDP wrappings of the model fit its FlatParameters' shard sizes with different "
            "lengths, so which elements are padding is not known"
        )
    return found.pop()


# --------------------------------------------------------------------------------------------------
# The optimizer's state as global tensors, one per FlatParameter and state key.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlatOptimizer:
    """A role's FSDP1 optimizer files as global tensors.

    Attributes:
        root: rank 0's file as the allowlisting reader rebuilt it (its structure and plain values).
        numels: each FlatParameter's numel, by its index in the optimizer's state.
        flat: id of each of rank 0's sharded state tensors -> (its FlatParameter index, the global tensor:
            the rank shards without their padding, as chunks).
        whole: id of each of rank 0's other state tensors (`step`) -> that tensor, whole.
    """

    root: Any
    numels: Mapping[int, int]
    flat: Mapping[int, tuple[int, TensorEntry]]
    whole: Mapping[int, TensorEntry]

    def shard(self, ref: Any, rank: int, world: int) -> tuple[TensorEntry, int, int, int]:
        """(the global tensor of rank 0's `ref`, where rank `rank` of `world` starts in it, how many elements it
        holds, the elements of zeros after them): FSDP1's `_get_shard` for the target."""
        if id(ref) in self.whole:
            entry = self.whole[id(ref)]
            return entry, 0, entry.numel, 0
        index, entry = self.flat[id(ref)]
        numel = self.numels[index]
        size = -(-numel // world)
        start = min(rank * size, numel)
        held = min(numel, start + size) - start
        return entry, start, held, size - held


def _state_index(path: str, where: str) -> int:
    """The FlatParameter index of an optimizer state tensor's path (`state.3.exp_avg`)."""
    parts = path.split(".")
    if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
        raise CkptctlError(f"{where}: {path} is not a per-parameter optimizer state (state.<index>.<key>)")
    return int(parts[1])


def _start(opened: TorchPickle, ref: TensorRef, where: str) -> int:
    """Where a tensor's elements start in its file."""
    found = opened.byte_range(ref)
    if found is None:
        raise CorruptCheckpoint(f"{where}: a tensor that is not one contiguous little-endian range is not supported")
    return found[0]


def plan_flat_optimizer(
    url: str,
    files: Mapping[str, int | None],
    names: Sequence[str],
    params: Sequence[tuple[str, int]],
    world: int,
) -> FlatOptimizer:
    """The FSDP1 optimizer state of a role saved on `world` ranks (the module docstring).

    Args:
        url: the role folder.
        files: file name -> size, of the role folder.
        names: the optimizer file of each source rank.
        params: the model's parameters (name, numel) in module order.
        world: the source's world size.

    Raises:
        CkptctlError: a state that is not FSDP1's FlatParameters' (ranks disagreeing on a shard's size:
            `use_orig_params`), or a wrapping `flat_numels` cannot tell.
        CorruptCheckpoint: ranks whose files differ in structure, dtype or scalar state.
    """
    opened = [open_torch_pickle(io.join(url, n), files.get(n), DTENSOR_PICKLE_GLOBALS) for n in names]
    ranks = [dict(state_tensors(o.root)) for o in opened]
    for name, held_states in zip(names, ranks, strict=True):
        if list(held_states) != list(ranks[0]):
            raise CorruptCheckpoint(f"{io.join(url, name)} holds other optimizer states than {names[0]}")
        for path, ref in held_states.items():
            if type(ref) is not TensorRef:
                raise CkptctlError(f"{io.join(url, name)}: {path} is a DTensor: FSDP1's optimizer holds plain tensors")
    plain = [{path: ref for path, ref in held.items() if type(ref) is TensorRef} for held in ranks]
    first = plain[0]
    shards: dict[int, int] = {}
    for path, ref in first.items():
        where = f"{io.join(url, names[0])}: {path}"
        shapes = {tuple(r[path].shape) for r in plain}
        if len(shapes) != 1 or {r[path].dtype for r in plain} != {ref.dtype}:
            raise CkptctlError(
                f"{where}: ranks hold pieces of different shapes or dtypes, as FSDP1 with use_orig_params does "
                "(one piece per original parameter); ckptctl reshards verl's FSDP1 default, use_orig_params=False"
            )
        if len(ref.shape) == 1:
            shards.setdefault(_state_index(path, where), ref.shape[0])
    order = sorted(shards)
    if order != list(range(len(order))):
        raise CkptctlError(f"{io.join(url, names[0])}: optimizer states of parameters {order}, not 0..n-1")
    numels = dict(zip(order, flat_numels(params, [shards[i] for i in order], world), strict=True))
    flat: dict[int, tuple[int, TensorEntry]] = {}
    whole: dict[int, TensorEntry] = {}
    for path, ref in first.items():
        name = f"optimizer.{path}"
        if len(ref.shape) == 1 and ref.shape[0] == shards.get(_state_index(path, path)):
            index = _state_index(path, path)
            numel, size = numels[index], shards[index]
            chunks = []
            for rank, (file, opened_rank) in enumerate(zip(names, opened, strict=True)):
                held = max(0, min(numel, (rank + 1) * size) - rank * size)
                if held:
                    # The first `held` elements: the rest of the piece is FSDP1's padding.
                    start = _start(opened_rank, plain[rank][path], f"{url}/{file}: {path}")
                    length = held * (ref.nbytes // size)
                    chunks.append(TensorChunk(file, start, length, (rank * size,), (held,)))
            flat[id(ref)] = (index, TensorEntry(name, Component.OPTIMIZER, ref.dtype, (numel,), tuple(chunks)))
        else:
            start = _start(opened[0], ref, f"{url}/{names[0]}: {path}")
            chunk = TensorChunk(names[0], start, ref.nbytes, (0,) * len(ref.shape), ref.shape)
            whole[id(ref)] = TensorEntry(name, Component.OPTIMIZER, ref.dtype, ref.shape, (chunk,))
    return FlatOptimizer(opened[0].root, numels, flat, whole)


def is_param(value: TensorRef | DTensorRef, world: int) -> bool:
    """Whether a model file entry is a parameter FSDP1 flattens: a DTensor when sharded, anything on one rank
    (`NO_SHARD` saves every entry plain; a plain entry of a sharded save is a buffer)."""
    return world == 1 or type(value) is DTensorRef


def param_numels(root: Any, world: int) -> list[tuple[str, int]]:
    """The (name, numel) of a model file's parameters (`is_param`), in stored (module) order."""
    return [(name, math.prod(value.shape)) for name, value in state_tensors(root) if is_param(value, world)]
