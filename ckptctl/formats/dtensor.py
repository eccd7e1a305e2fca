"""DTensors of a sharded state dict saved with torch.save: where each rank's local shard lies in the global tensor.

An FSDP2 (or FSDP1 with a device mesh) `SHARDED_STATE_DICT` pickles every parameter as a DTensor: the rank's
local tensor plus a `DTensorSpec` (device mesh, one placement per mesh dimension, the global shape). The
allowlisting unpickler rebuilds it as a `DTensorRef` (`formats.dtensor_classes`); `dtensor_facts` validates the
spec's stand-ins into `DTensorFacts`, and `DTensorFacts.local_box` says which part of the global tensor the
local shard is, following DTensor's own rule (`torch/distributed/tensor/_utils.py`
`compute_local_shape_and_global_offset`, `placement_types.py` `Shard._local_shard_size_and_offset`): on each
mesh dimension, in mesh order, `Shard(d)` splits what is left of tensor dimension `d` into `torch.chunk`
pieces (ceil-sized, the last ones short or empty) and the rank keeps the piece of its coordinate there;
`Replicate()` keeps it all, so the ranks that differ only in replicated mesh dimensions hold the same bytes
and the merge takes it from one of them (`is_primary`), never concatenating copies.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.dtensor_classes import DTENSOR_STAND_INS, DTENSOR_TUPLES, DTensorRef, PlacementStandIn
from ckptctl.formats.safe_pickle import MAX_DIMS, state_fields
from ckptctl.formats.torch_pickle import refs_of
from ckptctl.formats.torch_pickle_classes import TensorRef

__all__ = ["DTensorFacts", "Placement", "dtensor_facts", "state_tensors"]

#: More ranks than any mesh has; bounds the arithmetic on a hostile mesh.
_MAX_MESH = 1 << 24


@dataclass(frozen=True, slots=True)
class Placement:
    """How a DTensor lies on one mesh dimension: `Shard(dim)` (kind "shard") or `Replicate()` ("replicate")."""

    kind: str
    dim: int | None = None

    def __str__(self) -> str:
        return f"Shard({self.dim})" if self.kind == "shard" else "Replicate()"


@dataclass(frozen=True, slots=True)
class DTensorFacts:
    """A DTensor's sharding, validated.

    Attributes:
        dtype: torch-style dtype name.
        shape: the global tensor's shape.
        local: the saving rank's shard (data on disk).
        placements: one per mesh dimension.
        mesh_shape: the device mesh's shape.
        mesh_dim_names: its dimension names (`("fsdp",)`, `("ddp", "fsdp")`), empty when unnamed.
        coordinate: the saving rank's coordinate in the mesh, when the pickle records it.
    """

    dtype: str
    shape: tuple[int, ...]
    local: TensorRef
    placements: tuple[Placement, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    coordinate: tuple[int, ...] | None

    def local_box(self, coordinate: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) of the shard of the rank at `coordinate` in the global tensor.

        Raises:
            CorruptCheckpoint: the coordinate is outside the mesh.
        """
        if len(coordinate) != len(self.mesh_shape) or any(
            not 0 <= c < n for c, n in zip(coordinate, self.mesh_shape, strict=True)
        ):
            raise CorruptCheckpoint(f"rank coordinate {coordinate} is outside the device mesh {self.mesh_shape}")
        offsets = [0] * len(self.shape)
        sizes = list(self.shape)
        for placement, n, c in zip(self.placements, self.mesh_shape, coordinate, strict=True):
            if placement.kind != "shard":
                continue
            d = placement.dim
            assert d is not None
            chunk = -(-sizes[d] // n)  # torch.chunk: ceil-sized pieces, the last ones short or empty
            start = min(c * chunk, sizes[d])
            offsets[d] += start
            sizes[d] = max(0, min(sizes[d], (c + 1) * chunk) - start)
        return tuple(offsets), tuple(sizes)

    def is_primary(self, coordinate: tuple[int, ...]) -> bool:
        """Whether the rank at `coordinate` is the one whose copy of a replicated shard is taken: coordinate 0
        on every mesh dimension the tensor is replicated over."""
        return all(c == 0 for p, c in zip(self.placements, coordinate, strict=True) if p.kind == "replicate")


def dtensor_facts(ref: DTensorRef, source: str) -> DTensorFacts:
    """Validate a pickled DTensor's spec.

    Raises:
        CorruptCheckpoint: the spec is malformed or disagrees with the local tensor.
        CkptctlError: a placement whose merge ckptctl does not do (`Partial`, `_StridedShard`, a shard
            order other than mesh order).
    """
    spec = state_fields(ref.spec, source)
    mesh = spec.get("mesh")
    if type(mesh) is not DTENSOR_STAND_INS["DeviceMesh"]:
        raise CorruptCheckpoint(f"{source}: a DTensor's spec has no device mesh")
    mesh_state = state_fields(mesh, source)
    mesh_shape = _mesh_shape(mesh_state, source)
    # `_mesh_dim_names` since torch 2.9's layout rework, `mesh_dim_names` before.
    names = mesh_state.get("_mesh_dim_names", mesh_state.get("mesh_dim_names"))
    if names is None:
        names = ()
    if type(names) is not tuple or not all(type(n) is str and len(n) <= 64 for n in names):
        raise CorruptCheckpoint(f"{source}: a device mesh's dimension names are not strings")
    if names and len(names) != len(mesh_shape):
        raise CorruptCheckpoint(f"{source}: a device mesh names {len(names)} of its {len(mesh_shape)} dimensions")
    coordinate = mesh_state.get("_coordinate_on_dim")
    if coordinate is not None and (
        type(coordinate) not in (tuple, list)
        or len(coordinate) != len(mesh_shape)
        or not all(type(c) is int and 0 <= c < n for c, n in zip(coordinate, mesh_shape, strict=True))
    ):
        raise CorruptCheckpoint(f"{source}: a device mesh records a coordinate outside it")
    placements = _placements(spec.get("placements"), len(ref.shape), source)
    if len(placements) != len(mesh_shape):
        raise CorruptCheckpoint(f"{source}: a DTensor has {len(placements)} placements on a {len(mesh_shape)}-D mesh")
    _check_shard_order(spec.get("shard_order"), source)
    meta = spec.get("tensor_meta")
    if type(meta) is DTENSOR_TUPLES["TensorMeta"] and (
        type(meta[0]) not in (tuple, list) or tuple(meta[0]) != ref.shape
    ):
        raise CorruptCheckpoint(f"{source}: a DTensor's tensor_meta disagrees with its size")
    return DTensorFacts(
        ref.dtype,
        ref.shape,
        ref.local,
        placements,
        mesh_shape,
        names,
        tuple(coordinate) if coordinate is not None else None,
    )


def _mesh_shape(state: dict[str, Any], source: str) -> tuple[int, ...]:
    """The mesh's shape: from its `_layout` (torch >= 2.9: one `_FlatLayout` per dimension, whose shape's
    product is the dimension's size), else from its `mesh` tensor's shape (older torch)."""
    layout = state.get("_layout")
    if type(layout) is DTENSOR_STAND_INS["_MeshLayout"]:
        axes = state_fields(layout, source).get("axes")
        if type(axes) is not tuple or not 0 < len(axes) <= MAX_DIMS:
            raise CorruptCheckpoint(f"{source}: a device mesh layout has no axes")
        shape = []
        for axis in axes:
            sizes = state_fields(axis, source).get("shape") if type(axis) is DTENSOR_STAND_INS["_FlatLayout"] else None
            if type(sizes) is not tuple or len(sizes) > MAX_DIMS or not all(type(s) is int and s > 0 for s in sizes):
                raise CorruptCheckpoint(f"{source}: a device mesh layout axis has no shape")
            shape.append(math.prod(sizes))
    else:
        tensor = state.get("mesh")
        if type(tensor) is not TensorRef or not tensor.shape:
            raise CorruptCheckpoint(f"{source}: a device mesh has neither a layout nor a mesh tensor")
        shape = list(tensor.shape)
    if math.prod(shape) > _MAX_MESH or not all(n > 0 for n in shape):
        raise CorruptCheckpoint(f"{source}: a device mesh of shape {tuple(shape)} is larger than any real one")
    return tuple(shape)


def _placements(value: Any, ndim: int, source: str) -> tuple[Placement, ...]:
    if type(value) is not tuple or not value or len(value) > MAX_DIMS:
        raise CorruptCheckpoint(f"{source}: a DTensor's placements are not a tuple")
    found = []
    for item in value:
        if not isinstance(item, PlacementStandIn):
            raise CorruptCheckpoint(f"{source}: a DTensor placement is not a placement")
        if item.kind == "Replicate":
            found.append(Placement("replicate"))
            continue
        if item.kind != "Shard":
            raise CkptctlError(
                f"{source}: a DTensor placed as {item.kind} cannot be merged by ckptctl (Shard and Replicate only)",
                "gather it with the framework's own tools",
            )
        dim = state_fields(item, source).get("dim")
        if type(dim) is not int or not -ndim <= dim < ndim:
            raise CorruptCheckpoint(f"{source}: a Shard placement names no dimension of the tensor")
        found.append(Placement("shard", dim % ndim))
    return tuple(found)


def _check_shard_order(value: Any, source: str) -> None:
    """DTensor's default order (each tensor dimension sharded over its mesh dimensions in mesh order) is the one
    `local_box` follows; another order (torch's `shard_order`) is refused rather than merged wrongly."""
    if value is None:
        return
    if type(value) is not tuple or len(value) > MAX_DIMS:
        raise CorruptCheckpoint(f"{source}: a DTensor's shard order is not a tuple")
    for entry in value:
        if type(entry) is not DTENSOR_TUPLES["ShardOrderEntry"]:
            raise CorruptCheckpoint(f"{source}: a DTensor's shard order holds something else")
        mesh_dims = entry[1]
        if type(mesh_dims) is not tuple or not all(type(d) is int for d in mesh_dims):
            raise CorruptCheckpoint(f"{source}: a DTensor's shard order entry names no mesh dimensions")
        if list(mesh_dims) != sorted(mesh_dims):
            raise CkptctlError(
                f"{source}: a DTensor sharded over mesh dimensions in the order {mesh_dims} cannot be merged by "
                "ckptctl (mesh order only)",
                "gather it with the framework's own tools",
            )


def state_tensors(root: Any, prefix: str = "") -> Iterator[tuple[str, TensorRef | DTensorRef]]:
    """Every tensor and DTensor of a sharded state dict (nested dicts and lists) with its dotted path, in stored
    order (`model.layers.0.mlp.up_proj.weight`; `state.0.exp_avg` in an optimizer's), under the bounds of
    `torch_pickle.refs_of`: a hostile file cannot make the paths add up to gigabytes.

    Raises:
        CorruptCheckpoint: nesting deeper than any real state dict, or paths longer than any real one's.
    """
    return refs_of(root, (TensorRef, DTensorRef), prefix)
