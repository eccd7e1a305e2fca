"""What sharded state dicts may pickle besides a training file's: the DTensor allowlist of `formats.dtensor`.

FSDP2 (and FSDP1 with a device mesh) sharded state dicts, as verl saves them, pickle every parameter as a
DTensor. The stand-ins here rebuild one as a `DTensorRef` (the local shard a `TensorRef`, its spec inert
stand-ins); `formats.dtensor` reads the facts off them. `DTENSOR_PICKLE_GLOBALS` is the whole-file allowlist
of `formats.torch_pickle_classes` plus these; the engine that applies it is `formats.safe_pickle`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ckptctl.formats.safe_pickle import Allowlist, StandIn, stand_in_class
from ckptctl.formats.torch_pickle_classes import TORCH_PICKLE_EXACT, TensorRef, rebuild_from_type_v2
from ckptctl.formats.torch_save_classes import DType, TypeTag, int_tuple

__all__ = [
    "DTENSOR_PICKLE_GLOBALS",
    "DTENSOR_STAND_INS",
    "DTENSOR_TUPLES",
    "DTensorRef",
    "NamedTupleStandIn",
    "PlacementStandIn",
    "WrapperSubclass",
]

# torch pickles a DTensor as `_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor, dtype, size,
# stride, storage_offset, layout, device, requires_grad), (None, {"_local_tensor": tensor, "_spec": spec}))`
# (`torch/_tensor.py` `__reduce_ex__` of a wrapper subclass, `torch/distributed/tensor/_api.py` DTensor's
# `__slots__`); the spec is a `DTensorSpec` dataclass (mesh, placements, tensor_meta, shard_order) built by
# NEWOBJ + BUILD, its mesh a `DeviceMesh` whose state holds `_layout` (`_MeshLayout` of `_FlatLayout`s, torch
# >= 2.9), `_mesh_dim_names`, `_coordinate_on_dim` (the saving rank's place) and a rank-map tensor. Each
# becomes an inert stand-in below; `formats.dtensor` reads the facts off them.


class PlacementStandIn(StandIn):
    """`Shard(dim)`, `_StridedShard(dim, split_factor)`, `Replicate()` or `Partial(reduce_op)`: its kind and
    the fields BUILD gives it."""

    __slots__ = ()
    kind: ClassVar[str] = ""


class NamedTupleStandIn(tuple[Any, ...]):
    """A NamedTuple rebuilt by NEWOBJ with its fields (`TensorMeta(shape, stride, dtype)`,
    `ShardOrderEntry(tensor_dim, mesh_dims)`): the plain tuple of them, its length checked."""

    fields: ClassVar[int] = 0

    def __new__(cls, *args: Any) -> NamedTupleStandIn:
        if len(args) != cls.fields:
            raise ValueError(f"{cls.__name__} takes {cls.fields} fields")
        return super().__new__(cls, args)


_SPEC = "torch.distributed.tensor._dtensor_spec"
_MESH_LAYOUT = "torch.distributed._mesh_layout"

#: The classes of a DTensor's spec that NEWOBJ + BUILD make, (module, name): each a `StandIn` keeping its state.
_SPEC_OBJECTS = (
    (_SPEC, "DTensorSpec"),
    ("torch.distributed.device_mesh", "DeviceMesh"),
    (_MESH_LAYOUT, "_MeshLayout"),
    (_MESH_LAYOUT, "_FlatLayout"),
)
#: The NamedTuples of a DTensor's spec, (module, name, fields): NEWOBJ builds each from that many fields.
_SPEC_TUPLES = (
    (_SPEC, "TensorMeta", 3),  # (shape, stride, dtype)
    (_SPEC, "ShardOrderEntry", 2),  # (tensor_dim, mesh_dims)
)

#: The stand-in class of each spec object and NamedTuple, by the class's name (`formats.dtensor` checks the
#: unpickled objects against them).
DTENSOR_STAND_INS: Mapping[str, type[StandIn]] = {
    name: stand_in_class(f"{name.lstrip('_')}StandIn", StandIn, stands_for=f"{module}.{name}")
    for module, name in _SPEC_OBJECTS
}
DTENSOR_TUPLES: Mapping[str, type[NamedTupleStandIn]] = {
    name: stand_in_class(f"{name}StandIn", NamedTupleStandIn, fields=fields) for _, name, fields in _SPEC_TUPLES
}


class WrapperSubclass:
    """What `torch._utils._rebuild_wrapper_subclass(DTensor, ...)` rebuilds: the global tensor's facts,
    before `_rebuild_from_type_v2` hands it its state."""

    __slots__ = ("dtype", "requires_grad", "shape", "stride")

    def __init__(self, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...], requires_grad: bool) -> None:
        self.dtype = dtype
        self.shape = shape
        self.stride = stride
        self.requires_grad = requires_grad


class DTensorRef:
    """A pickled DTensor as facts: the global tensor's, its local shard (a `TensorRef`, data left on disk)
    and its unchecked `DTensorSpec` stand-in (`formats.dtensor.dtensor_facts` validates it)."""

    __slots__ = ("dtype", "local", "shape", "spec")

    def __init__(self, dtype: str, shape: tuple[int, ...], local: TensorRef, spec: Any) -> None:
        self.dtype = dtype
        self.shape = shape
        self.local = local
        self.spec = spec


_DTENSOR = TypeTag("torch.distributed.tensor.DTensor")


def _rebuild_wrapper_subclass(
    cls: Any, dtype: Any, size: Any, stride: Any, storage_offset: Any, layout: Any, device: Any, requires_grad: Any
) -> WrapperSubclass:
    """Stand-in for `torch._utils._rebuild_wrapper_subclass`, for DTensors only."""
    if cls is not _DTENSOR or type(dtype) is not DType or type(storage_offset) is not int:
        raise ValueError("_rebuild_wrapper_subclass rebuilds only a DTensor")
    shape = int_tuple(size, "a DTensor size")
    strides = int_tuple(stride, "a DTensor stride")
    if len(shape) != len(strides) or any(d < 0 for d in shape):
        raise ValueError("a DTensor's size and stride disagree")
    return WrapperSubclass(str(dtype), shape, strides, bool(requires_grad))


def _rebuild_dtensor_or_tensor(func: Any, new_type: Any, args: Any, state: Any) -> TensorRef | DTensorRef:
    """`torch._tensor._rebuild_from_type_v2` where DTensors may appear: a DTensor becomes a `DTensorRef` from
    its slots' state; anything else as `_rebuild_from_type_v2`."""
    if func is not _rebuild_wrapper_subclass:
        return rebuild_from_type_v2(func, new_type, args, state)
    if new_type is not _DTENSOR or type(args) is not tuple:
        raise ValueError("_rebuild_wrapper_subclass rebuilds only a DTensor")
    wrapper = _rebuild_wrapper_subclass(*args)
    if type(state) is not tuple or len(state) != 2 or state[0] is not None or type(state[1]) is not dict:
        raise ValueError("a DTensor's state must be its slots")
    local, spec = state[1].get("_local_tensor"), state[1].get("_spec")
    if type(local) is not TensorRef or type(spec) is not DTENSOR_STAND_INS["DTensorSpec"]:
        raise ValueError("a DTensor needs a local tensor and a DTensorSpec")
    if local.dtype != wrapper.dtype:
        raise ValueError("a DTensor's local tensor has another dtype")
    return DTensorRef(wrapper.dtype, wrapper.shape, local, spec)


def _torch_layout(name: Any) -> str:
    """Stand-in for `torch.serialization._get_layout(name)`: the name (`torch.strided`)."""
    if name != "torch.strided":
        raise ValueError("only strided tensors are read")
    return name


_PLACEMENTS = "torch.distributed.tensor.placement_types"
_DTENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_dtensor_or_tensor,
    ("torch.serialization", "_get_layout"): _torch_layout,
    **{(module, name): DTENSOR_STAND_INS[name] for module, name in _SPEC_OBJECTS},
    **{(module, name): DTENSOR_TUPLES[name] for module, name, _ in _SPEC_TUPLES},
    **{
        (module, name): stand_in_class("PlacementStandIn", PlacementStandIn, kind=name, stands_for=name)
        for module in (_PLACEMENTS, "torch.distributed._tensor.placement_types")
        for name in ("Shard", "_StridedShard", "Replicate", "Partial")
    },
    # The DTensor class itself, under its public and its pre-2.4 module.
    ("torch.distributed.tensor", "DTensor"): _DTENSOR,
    ("torch.distributed.tensor._api", "DTensor"): _DTENSOR,
    ("torch.distributed._tensor.api", "DTensor"): _DTENSOR,
}

#: `TORCH_PICKLE_GLOBALS` plus DTensors (`DTensorRef`s): for files of sharded state dicts (verl's per-rank
#: `model_world_size_W_rank_R.pt`). Kept apart so that readers of other training files keep refusing a DTensor.
DTENSOR_PICKLE_GLOBALS: Mapping[tuple[str, str], Any] = Allowlist({**TORCH_PICKLE_EXACT, **_DTENSOR_GLOBALS})
