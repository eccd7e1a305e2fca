"""ByteCheckpoint's `.metadata`: parsed without bytecheckpoint or torch and without running the pickle.

`bytecheckpoint.checkpointer.meta_type.Metadata` (0.0.2) is a dataclass holding torch DCP's own metadata
(`state_dict_metadata`: `TensorStorageMetadata` with chunks, `BytesStorageMetadata`; `planner_data`), its
storage records (`storage_data`: `MetadataIndex` -> its own `_StorageInfo(relative_path, offset, length)`),
one pickled tensor header per record (`all_tensor_metadata`: the `_rebuild_tensor_v2` pickle of the shard,
whose storage bytes are what the record's range holds), `bytecheckpoint_version` and a `user_defined_dict`.
Its two classes are read with DCP's inert stand-ins (they carry the same fields), through DCP's allowlist
and validating parser (`formats.dcp_metadata`), so that what torch's parser accepts is accepted here and
nothing else; the headers are unpickled with the torch-pickle allowlist into `TensorRef` facts, on demand.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import dtype_itemsize
from ckptctl.errors import CkptctlError
from ckptctl.formats.dcp_metadata import MAX_METADATA_BYTES, DcpMetadata, DcpTensor, StorageKey, dcp_metadata_from
from ckptctl.formats.dcp_metadata_classes import DCP_METADATA_GLOBALS, DCP_STAND_INS
from ckptctl.formats.parse_cache import ParseCache
from ckptctl.formats.safe_pickle import parse_pickle, state_fields
from ckptctl.formats.torch_pickle_classes import TensorRef, load_torch_pickle
from ckptctl.io import DirEntry

__all__ = [
    "BCP_METADATA_CLASS",
    "BCP_METADATA_GLOBALS",
    "FLAT_PARAM_KEYS",
    "BcpMetadata",
    "header_problem",
    "load_bcp_metadata",
]

_MODULE = "bytecheckpoint.checkpointer.meta_type"
#: The class a ByteCheckpoint `.metadata` pickles first.
BCP_METADATA_CLASS = (_MODULE, "Metadata")

#: What a ByteCheckpoint `.metadata` may name (checked against the pickles bytecheckpoint 0.0.2 writes on
#: torch 2.13, disassembled): torch DCP's classes, and its own `Metadata` and `_StorageInfo`, which carry the
#: fields of DCP's and are read with the same inert stand-ins.
BCP_METADATA_GLOBALS: Mapping[tuple[str, str], Any] = {
    **DCP_METADATA_GLOBALS,
    BCP_METADATA_CLASS: DCP_STAND_INS["Metadata"],
    (_MODULE, "_StorageInfo"): DCP_STAND_INS["_StorageInfo"],
}

#: A pickled header of one tensor shard is a hundred-odd bytes; larger, it is no header.
_MAX_HEADER = 4096
#: The keys of `user_defined_dict` that FSDP1's decomposed (flat-parameter) saves record.
FLAT_PARAM_KEYS = frozenset({"fsdp_flat_param_meta", "fsdp_flat_param_to_fqns", "model_dict_keys"})


@dataclass(frozen=True, slots=True)
class BcpMetadata:
    """A parsed, validated ByteCheckpoint `.metadata`.

    Attributes:
        dcp: the DCP metadata it holds (entries, storage records).
        version: `bytecheckpoint_version`, as recorded.
        headers: the pickled tensor header of each storage record of a tensor chunk.
        user_keys: the keys of `user_defined_dict` (FSDP1's flat-parameter metadata, a user's own).
    """

    dcp: DcpMetadata
    version: str | None
    headers: Mapping[StorageKey, bytes] = field(repr=False)
    user_keys: tuple[str, ...] = ()

    @property
    def flat_parameters(self) -> bool:
        """Whether the model was saved as FSDP1's flat parameters (`save_decomposed_model_optimizer`)."""
        return any(key in FLAT_PARAM_KEYS for key in self.user_keys)


def _parse(root: Any, source: str, size: int) -> BcpMetadata:
    dcp = dcp_metadata_from(root, source, size)
    state = state_fields(root, source)
    version = state.get("bytecheckpoint_version")
    raw = state.get("all_tensor_metadata")
    headers: dict[StorageKey, bytes] = {}
    if type(raw) is dict:
        index_class = DCP_STAND_INS["MetadataIndex"]
        for index, header in raw.items():
            if type(index) is not index_class or type(header) is not bytes or len(header) > _MAX_HEADER:
                continue
            fields = state_fields(index, source)
            fqn, offsets = fields.get("fqn"), fields.get("offset")
            if type(fqn) is not str or type(offsets) is not tuple:
                continue
            key = (fqn, offsets)
            if key in dcp.storage:  # validated there: a header of no record describes nothing
                headers[key] = header
    user = state.get("user_defined_dict")
    return BcpMetadata(
        dcp=dcp,
        version=version if type(version) is str and len(version) <= 64 else None,
        headers=headers,
        user_keys=tuple(k for k in user if type(k) is str and len(k) <= 200) if type(user) is dict else (),
    )


#: Parsed `.metadata` files (`formats.parse_cache`: keyed by each file's version).
_cache: ParseCache[BcpMetadata] = ParseCache(4)


def load_bcp_metadata(path: str, entry: DirEntry) -> BcpMetadata:
    """Read and parse the ByteCheckpoint `.metadata` at `path` (`entry`: its listing entry), cached by version.

    Raises:
        UnsafePickle: it names a global outside `BCP_METADATA_GLOBALS`.
        CorruptCheckpoint: it does not parse or validate.
    """

    def parse() -> BcpMetadata:
        data = io.read_bytes(path, max_size=MAX_METADATA_BYTES)
        return parse_pickle(data, BCP_METADATA_GLOBALS, path, lambda root: _parse(root, path, len(data)))

    return _cache.get(path, entry, parse)


def header_problem(metadata: BcpMetadata, key: StorageKey, tensor: DcpTensor, sizes: tuple[int, ...]) -> str | None:
    """Why the stored bytes of a tensor chunk are not its elements in row-major order, or None when they are.

    ByteCheckpoint writes a shard's whole storage (it clones a view first) and pickles the shard's header
    beside the record: the header must describe a contiguous tensor of the metadata's dtype and the chunk's
    shape at the start of a storage exactly as long as the record.
    """
    record = metadata.dcp.storage[key]
    header = metadata.headers.get(key)
    if header is None:
        return "no tensor header for this record"
    try:
        ref = load_torch_pickle(header, f"tensor header of {key[0]!r}")
    except CkptctlError as exc:
        return f"its tensor header does not read: {exc.message}"
    if type(ref) is not TensorRef:
        return "its tensor header is not a tensor"
    nbytes = math.prod(sizes) * dtype_itemsize(tensor.dtype)
    if ref.dtype != tensor.dtype or ref.shape != sizes:
        return f"its header says {ref.dtype}{list(ref.shape)}, the metadata {tensor.dtype}{list(sizes)}"
    if not ref.is_contiguous or ref.storage_offset != 0:
        return "its header describes a view (strided or offset), not the row-major elements ckptctl reads"
    if ref.storage_nbytes != record.length or record.length != nbytes:
        return f"{record.length} bytes are stored for {nbytes} bytes of elements (a storage of {ref.storage_nbytes})"
    return None
