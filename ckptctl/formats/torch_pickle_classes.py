"""What whole training-state torch.save files may name: the allowlist and stand-ins of `formats.torch_pickle`.

`optimizer.pt`, `scheduler.pt`, `rng_state*.pth`, `training_args.bin`, DeepSpeed `*_model_states.pt` /
`*_optim_states.pt` pickle whole objects: their tensors become `TensorRef` facts (elements left on disk),
`module.state_dict()`'s OrderedDicts `OrderedDictStandIn`s, devices and sizes plain values, and the
framework objects in them the `FrameworkObject`s their framework packages register. The torch.save pieces
come from `formats.torch_save_classes`; the engine that applies them is `formats.safe_pickle`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptctl.checkpoint import dtype_itemsize
from ckptctl.formats.safe_pickle import MAX_DIMS, Allowlist, check_growth, gc_paused, safe_loads
from ckptctl.formats.stdlib_classes import STDLIB_DATA_GLOBALS
from ckptctl.formats.torch_save_classes import (
    NDARRAY,
    NUMPY_GLOBALS,
    TORCH_SAVE_GLOBALS,
    NumpyDType,
    TensorRebuild,
    TorchSaveUnpickler,
    TypeTag,
    codecs_encode,
    rebuild_tensor_v2,
    rebuild_tensor_v3,
)

__all__ = [
    "OPAQUE_PICKLE_GLOBALS",
    "TORCH_PICKLE_EXACT",
    "TORCH_PICKLE_GLOBALS",
    "OrderedDictStandIn",
    "TensorRef",
    "load_torch_pickle",
    "rebuild_from_type_v2",
]


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor of a torch.save file as facts; its elements stay on disk until `torch_pickle.load_tensor`.

    Attributes:
        dtype: torch-style dtype name.
        shape: the tensor's shape.
        storage_key: the storage record holding its elements (`<archive>/data/<key>`).
        storage_offset: where the tensor starts in its storage, in elements.
        stride: strides in elements.
        nbytes: bytes of the tensor's own elements (`numel * itemsize`).
        storage_nbytes: bytes the whole storage holds (views share one storage).
        requires_grad: what the saved tensor said (parameters say True).
    """

    dtype: str
    shape: tuple[int, ...]
    storage_key: str
    storage_offset: int
    stride: tuple[int, ...]
    nbytes: int
    storage_nbytes: int
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_contiguous(self) -> bool:
        """Row-major without gaps, so that its elements are one byte range of the storage record."""
        step = 1
        for dim, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if dim != 1 and stride != step:  # a dimension of size 1 never steps: its stride is arbitrary
                return False
            step *= dim
        return True


def _tensor_ref(rebuilt: TensorRebuild) -> TensorRef:
    storage = rebuilt.storage
    itemsize = dtype_itemsize(rebuilt.dtype)
    storage_nbytes = storage.numel * (itemsize if storage.dtype is not None else 1)
    if any(s < 0 for s in rebuilt.stride):
        raise ValueError("a tensor has a negative stride")
    numel = math.prod(rebuilt.shape)
    if numel:
        last = rebuilt.storage_offset + sum((d - 1) * s for d, s in zip(rebuilt.shape, rebuilt.stride, strict=True))
        if (last + 1) * itemsize > storage_nbytes:
            raise ValueError("a tensor reaches outside its storage")
    return TensorRef(
        rebuilt.dtype,
        rebuilt.shape,
        storage.key,
        rebuilt.storage_offset,
        rebuilt.stride,
        numel * itemsize,
        storage_nbytes,
        rebuilt.requires_grad,
    )


def _ref_v2(*args: Any) -> TensorRef:
    """Stand-in for `torch._utils._rebuild_tensor_v2` in whole-file pickles: a `TensorRef`."""
    return _tensor_ref(rebuild_tensor_v2(*args))


def _ref_v3(*args: Any) -> TensorRef:
    """Stand-in for `torch._utils._rebuild_tensor_v3` in whole-file pickles: a `TensorRef`."""
    return _tensor_ref(rebuild_tensor_v3(*args))


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any, state: Any = None) -> TensorRef:
    """Stand-in for `torch._utils._rebuild_parameter[_with_state]`: the parameter's data, as a `TensorRef`."""
    if type(data) is not TensorRef:
        raise ValueError("a parameter must wrap a tensor")
    return data


_TENSOR_TYPES = (TypeTag("torch.Tensor"), TypeTag("torch.nn.parameter.Parameter"))


def rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> TensorRef:
    """Stand-in for `torch._tensor._rebuild_from_type_v2` (tensors with attributes, e.g. DeepSpeed's
    flat ZeRO-3 partitions carrying `ds_id`): calls only the tensor stand-ins, drops the attributes."""
    known_func = func is _ref_v2 or func is _ref_v3 or func is _rebuild_parameter
    if not known_func or not any(new_type is t for t in _TENSOR_TYPES) or type(args) is not tuple:
        raise ValueError("_rebuild_from_type_v2 may only rebuild a plain tensor")
    result: TensorRef = func(*args)
    return result


class OrderedDictStandIn(dict[Any, Any]):
    """Stand-in for `collections.OrderedDict` in whole-file pickles: a dict that also takes a BUILD state.

    `module.state_dict()` is an OrderedDict carrying a `_metadata` attribute, which pickles as BUILD; the
    state is kept in `state` (dicts keep insertion order, so nothing else is lost).
    """

    __slots__ = ("state",)

    def __init__(self, *args: Any) -> None:
        if args:
            raise ValueError("OrderedDict is rebuilt empty, then filled")
        super().__init__()

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _torch_size(dims: Any = ()) -> tuple[int, ...]:
    """Stand-in for `torch.Size(dims)`: the tuple itself (parsers check the entries).

    Kept to a type and length check because it runs for every size and chunk of every tensor.
    """
    if type(dims) is tuple and len(dims) <= MAX_DIMS:
        return dims
    raise ValueError("torch.Size needs a short tuple")


def _torch_device(kind: Any, index: Any = None) -> str:
    """Stand-in for `torch.device(...)`: its name (`cpu`, `cuda:0`)."""
    if type(kind) is not str or len(kind) > 32 or (index is not None and type(index) is not int):
        raise ValueError("torch.device needs a short name and an optional index")
    return kind if index is None else f"{kind}:{index}"


def _plain_set(items: Any = ()) -> set[Any]:
    """Stand-in for `builtins.set`/`frozenset` (protocol 0-3 pickles rebuild sets from a list)."""
    if type(items) not in (list, tuple):
        raise ValueError("a set is rebuilt from a list")
    check_growth(232 + 32 * len(items))
    return set(items)


#: What a whole training-state torch.save file may name. Tensors become `TensorRef`s, framework objects
#: `FrameworkObject`s, numpy values `NumpyArray`/`NumpyScalar`; nothing named is imported or called. These
#: are the exact entries; `TORCH_PICKLE_GLOBALS` adds the framework classes (`formats.framework_classes`).
TORCH_PICKLE_EXACT: Mapping[tuple[str, str], Any] = {
    **TORCH_SAVE_GLOBALS,
    ("torch._utils", "_rebuild_tensor_v2"): _ref_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _ref_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): rebuild_from_type_v2,
    ("torch", "Tensor"): _TENSOR_TYPES[0],
    ("torch.nn.parameter", "Parameter"): _TENSOR_TYPES[1],
    ("torch", "Size"): _torch_size,
    ("torch", "device"): _torch_device,
    ("collections", "OrderedDict"): OrderedDictStandIn,
    ("builtins", "set"): _plain_set,
    ("builtins", "frozenset"): _plain_set,
    ("_codecs", "encode"): codecs_encode,
    ("numpy", "dtype"): NumpyDType,
    ("numpy", "ndarray"): NDARRAY,
    **NUMPY_GLOBALS,
    **STDLIB_DATA_GLOBALS,
}
TORCH_PICKLE_GLOBALS: Mapping[tuple[str, str], Any] = Allowlist(TORCH_PICKLE_EXACT)
#: The same, for the generic reader of files no framework package claims (`layouts.single_file`): an unknown
#: class of a known ML library or of the standard library is read as an `OpaqueObject` (reported as
#: "unsupported class X (from P)"), so that one such value does not make the whole file unreadable; a
#: code-running global is refused as everywhere.
OPAQUE_PICKLE_GLOBALS: Mapping[tuple[str, str], Any] = Allowlist(TORCH_PICKLE_EXACT, opaque_unknown=True)


def load_torch_pickle(
    data: bytes | memoryview, source: str, allowed: Mapping[tuple[str, str], Any] = TORCH_PICKLE_GLOBALS
) -> Any:
    """Unpickle the `data.pkl` of a whole training-state torch.save file with `TORCH_PICKLE_GLOBALS` (or
    `DTENSOR_PICKLE_GLOBALS` for sharded state dicts).

    Raises:
        UnsafePickle: a global outside the allowlist (nothing of the pickle ran).
        CorruptCheckpoint: anything else that makes it unreadable.
    """
    with gc_paused():
        return safe_loads(data, allowed, source, TorchSaveUnpickler)
