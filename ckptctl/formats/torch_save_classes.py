"""What the pickles of torch.save archives may name: the allowlists and stand-ins of `formats.torch_save`.

A torch.save archive's `data.pkl` rebuilds its tensors with `torch._utils._rebuild_tensor_v2/v3` from
storages named by persistent ids; the stand-ins here turn them into `TensorRebuild`/`StorageRef` facts (no
storage is read), and the numpy values of RNG states into `NumpyArray`/`NumpyScalar`. `TORCH_SAVE_GLOBALS`
serves an archive of one tensor, `OBJECT_READ_GLOBALS` a plain value that is only checked;
`formats.torch_pickle_classes` builds the whole-file allowlist on them. The engine that applies them is
`formats.safe_pickle`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptctl.checkpoint import known_dtypes
from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.safe_pickle import MAX_DIMS, SafeUnpickler, StandIn, check_growth, safe_loads
from ckptctl.formats.stdlib_classes import STDLIB_DATA_GLOBALS

__all__ = [
    "NDARRAY",
    "NUMPY_GLOBALS",
    "OBJECT_READ_GLOBALS",
    "TORCH_DTYPES",
    "TORCH_SAVE_GLOBALS",
    "DType",
    "NumpyArray",
    "NumpyDType",
    "NumpyScalar",
    "StorageRef",
    "TensorRebuild",
    "TorchSaveUnpickler",
    "TypeTag",
    "codecs_encode",
    "int_tuple",
    "load_torch_save_pickle",
    "rebuild_tensor_v2",
    "rebuild_tensor_v3",
]


class DType(str):
    """A torch dtype named by a pickle (`torch.float32` → `DType("float32")`); a name, never callable."""

    __slots__ = ()


#: Every torch dtype the data model knows, as `DType` stand-ins (torch.save and DCP metadata name them).
TORCH_DTYPES: Mapping[tuple[str, str], DType] = {("torch", name): DType(name) for name in sorted(known_dtypes())}


class TensorRebuild:
    """What `torch._utils._rebuild_tensor_v2/v3` would rebuild, as plain facts (no storage is read)."""

    __slots__ = ("dtype", "requires_grad", "shape", "storage", "storage_offset", "stride")

    def __init__(
        self,
        storage: StorageRef,
        storage_offset: int,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: str,
        requires_grad: bool,
    ) -> None:
        self.storage = storage
        self.storage_offset = storage_offset
        self.shape = shape
        self.stride = stride
        self.dtype = dtype
        self.requires_grad = requires_grad


class StorageRef:
    """A storage named by a torch.save persistent id: its record key, dtype and element count."""

    __slots__ = ("dtype", "key", "location", "numel")

    def __init__(self, key: str, dtype: str | None, location: str, numel: int) -> None:
        self.key = key
        self.dtype = dtype
        self.location = location
        self.numel = numel


def int_tuple(value: Any, what: str) -> tuple[int, ...]:
    """A size or stride handed to a stand-in, as a tuple of at most `MAX_DIMS` integers (`what` names it)."""
    # A length check before touching the elements: a hostile file may hand one huge list to many calls.
    if type(value) not in (tuple, list) or len(value) > MAX_DIMS:
        raise ValueError(f"{what} must be a short sequence of integers")
    if type(value) is list:  # tuple() of a tuple is that tuple; of a list, a copy
        check_growth(56 + 8 * len(value))
    out = tuple(value)
    for v in out:
        if type(v) is not int:
            raise ValueError(f"{what} must hold integers")
    return out


def _empty_ordered_dict(*args: Any) -> dict[str, Any]:
    """Stand-in for `collections.OrderedDict()`, which torch.save writes for a tensor's backward hooks."""
    if args:
        raise ValueError("backward hooks must be empty")
    return {}


def rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    metadata: Any = None,
) -> TensorRebuild:
    """Stand-in for `torch._utils._rebuild_tensor_v2`: a typed (legacy) storage carries the dtype."""
    if not isinstance(storage, StorageRef) or storage.dtype is None:
        raise ValueError("_rebuild_tensor_v2 needs a typed storage")
    return _tensor_rebuild(storage, storage_offset, size, stride, storage.dtype, requires_grad)


def rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> TensorRebuild:
    """Stand-in for `torch._utils._rebuild_tensor_v3`: an untyped storage plus a dtype argument."""
    if not isinstance(storage, StorageRef) or storage.dtype is not None or type(dtype) is not DType:
        raise ValueError("_rebuild_tensor_v3 needs an untyped storage and a dtype")
    return _tensor_rebuild(storage, storage_offset, size, stride, str(dtype), requires_grad)


def _tensor_rebuild(
    storage: StorageRef, storage_offset: Any, size: Any, stride: Any, dtype: str, requires_grad: Any
) -> TensorRebuild:
    if type(storage_offset) is not int or storage_offset < 0:
        raise ValueError("a storage offset must be a non-negative integer")
    shape = int_tuple(size, "a tensor size")
    strides = int_tuple(stride, "a tensor stride")
    if len(shape) != len(strides) or any(d < 0 for d in shape):
        raise ValueError("a tensor's size and stride disagree")
    return TensorRebuild(storage, storage_offset, shape, strides, dtype, bool(requires_grad))


class _TypedStorageTag:
    """A legacy `torch.FloatStorage`-style class named in a torch.save persistent id (its dtype)."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: str | None) -> None:
        self.dtype = dtype


# Legacy storage class names torch.save writes, for the dtypes the data model knows
# (torch/storage.py `_dtype_to_storage_type_map`); newer dtypes use UntypedStorage + a dtype argument.
_LEGACY_STORAGES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}


def codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """Stand-in for `_codecs.encode`, which protocol-2 pickles use to carry bytes (numpy's raw data; a DCP
    bytes item holding bytes, like each rank's pickled data-loader state in torchtitan's saves)."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise ValueError("_codecs.encode is only allowed for latin-1 bytes")
    check_growth(33 + len(text))
    return text.encode("latin-1")


#: What the `data.pkl` of a torch.save archive holding one plain tensor may name (for `raw_record`;
#: decoding tensors goes through torch's own `weights_only` unpickler instead).
TORCH_SAVE_GLOBALS: Mapping[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): rebuild_tensor_v3,
    ("collections", "OrderedDict"): _empty_ordered_dict,
    ("torch.storage", "UntypedStorage"): _TypedStorageTag(None),
    ("_codecs", "encode"): codecs_encode,
    **{("torch", name): _TypedStorageTag(dtype) for name, dtype in _LEGACY_STORAGES.items()},
    **TORCH_DTYPES,
}


class TypeTag:
    """A class a pickle names only to say what type to rebuild (`torch.Tensor`, `numpy.ndarray`)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


#: The numpy array class, which a pickled array names to `_reconstruct` as the type to rebuild.
NDARRAY = TypeTag("numpy.ndarray")


class NumpyDType(StandIn):
    """Stand-in for `numpy.dtype(name, align, copy)`: the type name (its BUILD state is kept as is)."""

    __slots__ = ("name",)
    stands_for = "numpy.dtype"

    def __init__(self, name: Any, align: Any = False, copy: Any = False) -> None:
        if type(name) is not str or len(name) > 64:
            raise ValueError("numpy.dtype needs a short type name")
        self.name = name


class NumpyArray(StandIn):
    """Stand-in for a numpy array (`numpy.core.multiarray._reconstruct` + BUILD): keeps the BUILD state
    `(version, shape, dtype, is_fortran, raw bytes)` without interpreting it."""

    __slots__ = ()
    stands_for = "numpy.ndarray"


def _np_reconstruct(subtype: Any, shape: Any, dtype: Any) -> NumpyArray:
    if subtype is not NDARRAY:
        raise ValueError("only plain numpy arrays are rebuilt")
    return NumpyArray()


class NumpyScalar:
    """Stand-in for `numpy.core.multiarray.scalar(dtype, bytes)` (numpy scalars in RNG states)."""

    __slots__ = ("data", "dtype")

    def __init__(self, dtype: Any, data: Any = None) -> None:
        if type(dtype) is not NumpyDType or (data is not None and type(data) is not bytes):
            raise ValueError("numpy scalar needs a dtype and its bytes")
        self.dtype = dtype
        self.data = data


#: The numpy functions a pickled array or scalar names, as stand-ins.
NUMPY_GLOBALS = {
    key: value
    for core in ("numpy.core", "numpy._core")  # numpy 1.x and 2.x pickle under different module names
    for key, value in {
        (f"{core}.multiarray", "_reconstruct"): _np_reconstruct,
        (f"{core}.multiarray", "scalar"): NumpyScalar,
    }.items()
}

#: What a torch.save archive of a plain value (a DCP bytes item) may name when it is read to check it, not
#: rebuilt (`torch_save.read_object_archive`, which `verify` uses): `TORCH_SAVE_GLOBALS`, and the numpy
#: values RNG states hold (Megatron's `rng_state` items keep `np.random.get_state()`, an array pickled with
#: protocol 2, whose bytes come through `_codecs.encode`) as inert stand-ins.
OBJECT_READ_GLOBALS: Mapping[tuple[str, str], Any] = {
    **TORCH_SAVE_GLOBALS,
    ("numpy", "dtype"): NumpyDType,
    ("numpy", "ndarray"): NDARRAY,
    ("_codecs", "encode"): codecs_encode,
    **NUMPY_GLOBALS,
    **STDLIB_DATA_GLOBALS,
}


class TorchSaveUnpickler(SafeUnpickler):
    """Resolves torch.save's `('storage', type, key, location, numel)` persistent ids to `StorageRef`s."""

    def persistent_load(self, pid: Any) -> Any:
        if (
            type(pid) is tuple
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _TypedStorageTag)
            and type(pid[2]) is str
            and type(pid[3]) is str
            and type(pid[4]) is int
            and pid[4] >= 0
        ):
            return StorageRef(pid[2], pid[1].dtype, pid[3], pid[4])
        raise CorruptCheckpoint(f"{self._source}: unexpected persistent id in a torch.save archive")


def load_torch_save_pickle(
    data: bytes | memoryview, source: str, allowed: Mapping[tuple[str, str], Any] = TORCH_SAVE_GLOBALS
) -> Any:
    """Unpickle the `data.pkl` of a torch.save archive into `TensorRebuild`/`StorageRef` facts.

    Args:
        data: the pickle.
        source: its name, for messages.
        allowed: `TORCH_SAVE_GLOBALS`, or `OBJECT_READ_GLOBALS` for a value that is only read.
    """
    return safe_loads(data, allowed, source, TorchSaveUnpickler)
