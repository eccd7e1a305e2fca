"""What a torch DCP `.metadata` may name: the allowlist and stand-ins of `formats.dcp_metadata`.

torch/distributed/checkpoint/metadata.py and filesystem.py define the classes a `.metadata` pickles; each
becomes an inert `StandIn` that keeps the state BUILD hands it, for the parser to read and validate. The
engine that applies the allowlist is `formats.safe_pickle`.
"""

from __future__ import annotations

import operator
import posixpath
import sys
from collections.abc import Mapping
from typing import Any

from ckptctl.formats.safe_pickle import StandIn, check_growth, stand_in_class
from ckptctl.formats.torch_save_classes import TORCH_DTYPES

__all__ = ["DCP_METADATA_GLOBALS", "DCP_STAND_INS"]

#: Bounds on what a path stand-in accepts (a checkpoint id is a path, not a payload).
_MAX_PATH_PARTS = 256
_MAX_PATH_CHARS = 4096

_DCP_MODULE = "torch.distributed.checkpoint.metadata"
_PLANNER_MODULE = "torch.distributed.checkpoint.planner"

#: The classes a `.metadata` pickles, (module, name), each read as a `StandIn` that keeps its BUILD state.
_CLASSES = (
    (_DCP_MODULE, "Metadata"),
    (_DCP_MODULE, "TensorStorageMetadata"),
    (_DCP_MODULE, "BytesStorageMetadata"),
    (_DCP_MODULE, "ChunkStorageMetadata"),
    (_DCP_MODULE, "TensorProperties"),
    (_DCP_MODULE, "StorageMeta"),
    (_DCP_MODULE, "MetadataIndex"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # A decentralized save (megatron-core's `save_state_dict_async_plan`) keeps every rank's save plan in the
    # metadata (`Metadata.all_local_plans`), to check on its next save that the plans are unchanged. They
    # repeat what the storage records say (names, offsets, sizes); the parser reads none of them.
    (_PLANNER_MODULE, "SavePlan"),
    (_PLANNER_MODULE, "WriteItem"),
    (_PLANNER_MODULE, "TensorWriteData"),
)

#: The stand-in class of each, by the class's name (`formats.dcp_metadata` checks objects against them).
DCP_STAND_INS: Mapping[str, type[StandIn]] = {
    name: stand_in_class(f"{name.lstrip('_')}StandIn", StandIn, stands_for=name) for _, name in _CLASSES
}


def _posix_path(*parts: Any) -> str:
    """Stand-in for `pathlib.PosixPath(*parts)`: the path as a string (nothing touches the filesystem)."""
    if len(parts) > _MAX_PATH_PARTS or not all(type(p) is str for p in parts):
        raise ValueError("a path must be made of a few strings")
    chars = sum(len(p) for p in parts)
    if chars > _MAX_PATH_CHARS:
        raise ValueError("a path is longer than any real one")
    check_growth(64 + chars + len(parts))
    return posixpath.join(*parts) if parts else "."


#: What a torch DCP `.metadata` may name, checked against the pickles torch 2.13 writes (FSDP2 and
#: single-process saves) and megatron-core 0.16's decentralized saves (disassembled with pickletools). Each
#: maps to an inert stand-in.
DCP_METADATA_GLOBALS: Mapping[tuple[str, str], Any] = {
    **{(module, name): DCP_STAND_INS[name] for module, name in _CLASSES},
    # REDUCE(_MEM_FORMAT_ENCODING, (0,)) and REDUCE(_get_layout, ("torch.strided",)) run for every tensor,
    # so their stand-ins are C builtins that only accept what they should and build nothing:
    # operator.index() of an int is that int (int() would also parse a 4,000-digit string into a new
    # object on every call), and sys.intern() takes exact strings only; parsers check the values.
    (_DCP_MODULE, "_MEM_FORMAT_ENCODING"): operator.index,
    # An enum member, rebuilt as REDUCE(WriteItemType, (value,)): the value is all it is.
    (_PLANNER_MODULE, "WriteItemType"): operator.index,
    # torch.Size runs three times per tensor: `() + dims` is C that accepts exact tuples only and returns
    # them as they are (no copy, so a memoised tuple cannot be amplified); the parser checks the entries
    # and the length of each distinct one.
    ("torch", "Size"): ().__add__,
    ("torch.serialization", "_get_layout"): sys.intern,
    # StorageMeta.checkpoint_id is the save's pathlib.Path; Python 3.13 pickles it from pathlib._local.
    ("pathlib", "PosixPath"): _posix_path,
    ("pathlib._local", "PosixPath"): _posix_path,
    **TORCH_DTYPES,
}
