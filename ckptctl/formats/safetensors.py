"""safetensors: validated header parsing without reading tensor data, and a streaming writer.

Format: 8-byte little-endian header length N, N bytes of JSON `{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the data; offsets are relative to the
end of the header. Every claim of the header is checked against the file size before anything trusts it,
so a lying header costs at most its own length in memory.

The layout rules are those of the reference reader (the `safetensors` crate's `Metadata::validate` and
`SafeTensors::read_metadata`): taken in offset order, the tensors' byte ranges start at 0, follow each
other without gaps or overlaps, and the last one ends where the file ends. A file that breaks one of them
is refused here as it is by `safetensors.safe_open` ("invalid offset", "file not fully covered").
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import dtype_itemsize
from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.documents import MAX_INT, parse_json, shown

if TYPE_CHECKING:
    import torch

#: Larger headers are refused: real ones are a few MB even for 100k tensors.
MAX_HEADER_BYTES = 100 << 20
#: One read fetches this much, so that most headers need a single (range) read.
_PREFETCH = 64 << 10

SAFETENSORS_TO_TORCH = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
TORCH_TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_TO_TORCH.items()}


@dataclass(frozen=True, slots=True)
class SafetensorsTensor:
    """A tensor record of a safetensors header; `begin`/`end` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """A parsed and validated header."""

    data_start: int
    tensors: tuple[SafetensorsTensor, ...]
    metadata: Mapping[str, str]
    file_size: int


def parse_header(prefix: bytes, file_size: int, source: str) -> SafetensorsHeader:
    """Parse a header from the first bytes of a file, validating every offset against `file_size`.

    Args:
        prefix: at least the first 8 + header-length bytes of the file.
        file_size: the real size of the file.
        source: the file's name, for messages.

    Raises:
        CorruptCheckpoint: anything that does not hold (short file, bad JSON, offsets outside the file,
            byte lengths that disagree with shape and dtype, records that overlap or leave gaps, bytes
            after the last record).
    """
    if file_size < 8 or len(prefix) < 8:
        raise CorruptCheckpoint(f"{source}: too short for a safetensors file ({file_size} bytes)")
    (header_len,) = struct.unpack("<Q", prefix[:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
        raise CorruptCheckpoint(
            f"{source}: header claims {header_len} bytes but the file has {file_size}",
            "the file is truncated or not safetensors",
        )
    if len(prefix) < 8 + header_len:
        raise ValueError("prefix shorter than the header; read more first")
    # parse_json turns every failure of the JSON parser (an integer of 5,000 digits, nesting that exhausts
    # the stack) into a CorruptCheckpoint naming the file
    raw = parse_json(prefix[8 : 8 + header_len], source)
    if not isinstance(raw, dict):
        raise CorruptCheckpoint(f"{source}: header is not a JSON object")
    data_start = 8 + header_len
    metadata = raw.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptCheckpoint(f"{source}: __metadata__ must map strings to strings")
    tensors = []
    for name, rec in raw.items():
        tensors.append(_validate_record(name, rec, data_start, file_size, source))
    _check_coverage(tensors, data_start, file_size, source)
    return SafetensorsHeader(data_start, tuple(tensors), metadata, file_size)


def _check_coverage(tensors: list[SafetensorsTensor], data_start: int, file_size: int, source: str) -> None:
    """The reference reader's rules: in offset order, each tensor starts where the previous one ended (the
    first at data offset 0), and the last ends at the end of the file."""
    hint = "safetensors itself refuses this file; it was not written by a safetensors writer, or was altered"
    end, previous = data_start, None
    for tensor in sorted(tensors, key=lambda t: (t.begin, t.end)):
        if tensor.begin != end:
            where = "after the start of the data" if previous is None else f"after {previous!r}"
            what = (
                f"a gap of {tensor.begin - end} bytes"
                if tensor.begin > end
                else f"{end - tensor.begin} bytes of overlap"
            )
            raise CorruptCheckpoint(f"{source}: invalid offset for tensor {tensor.name!r}: {what} {where}", hint)
        end, previous = tensor.end, tensor.name
    if end != file_size:
        raise CorruptCheckpoint(
            f"{source}: {file_size - end} bytes after the last tensor: the data section is not fully covered",
            hint,
        )


def _validate_record(name: str, rec: Any, data_start: int, file_size: int, source: str) -> SafetensorsTensor:
    if not isinstance(rec, dict):
        raise CorruptCheckpoint(f"{source}: entry {name!r} is not an object")
    # a hostile header may put any JSON value in any field (a list where a name belongs is unhashable): every
    # field's type is checked before it is used, and shown shortened
    raw_dtype = rec.get("dtype")
    dtype = SAFETENSORS_TO_TORCH.get(raw_dtype) if isinstance(raw_dtype, str) else None
    if dtype is None:
        raise CorruptCheckpoint(f"{source}: tensor {name!r} has unknown dtype {shown(raw_dtype)}")
    shape = rec.get("shape")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CorruptCheckpoint(f"{source}: tensor {name!r} has an invalid shape {shown(shape)}")
    offsets = rec.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(map(_is_count, offsets))
        or offsets[0] > offsets[1]
    ):
        raise CorruptCheckpoint(f"{source}: tensor {name!r} has invalid data_offsets {shown(offsets)}")
    expected = math.prod(shape) * dtype_itemsize(dtype)
    if offsets[1] - offsets[0] != expected:
        raise CorruptCheckpoint(
            f"{source}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes but {dtype}{shape} needs {expected}"
        )
    begin, end = data_start + offsets[0], data_start + offsets[1]
    if end > file_size:
        raise CorruptCheckpoint(
            f"{source}: tensor {name!r} ends at byte {end} but the file has {file_size}", "the file is truncated"
        )
    return SafetensorsTensor(name, dtype, tuple(shape), begin, end)


def _is_count(value: Any) -> bool:
    """A dimension or an offset: an int (not a bool) from 0 to 2**63 - 1, as the format's u64/usize fields; a
    zero-sized tensor may claim a dimension of any size, which must still fit torch's int64 shapes."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT


def read_header(url: str, file_size: int | None = None) -> SafetensorsHeader:
    """Read and validate the header of a safetensors file with one or two (range) reads."""
    size = io.file_size(url) if file_size is None else file_size
    prefix = io.read_bytes(url, 0, min(size, _PREFETCH))
    if len(prefix) >= 8:
        (header_len,) = struct.unpack("<Q", prefix[:8])
        if 8 + header_len <= min(size, 8 + MAX_HEADER_BYTES) and len(prefix) < 8 + header_len:
            prefix += io.read_bytes(url, len(prefix), 8 + header_len - len(prefix))
    return parse_header(prefix, size, url)


@dataclass(frozen=True, slots=True)
class WrittenFile:
    """Size and blake3 digest of a file as it was written."""

    size: int
    blake3: str


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy when it is already contiguous."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def build_header(
    entries: Iterable[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str] | None = None
) -> bytes:
    """The header bytes (length prefix included) for tensors written in the given order.

    Args:
        entries: (name, torch-style dtype, shape) per tensor, in the order their data will follow.
        metadata: the `__metadata__` strings.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype_itemsize(dtype)
        header[name] = {
            "dtype": TORCH_TO_SAFETENSORS[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)  # the spec recommends 8-byte alignment of the data section
    return struct.pack("<Q", len(body)) + body


def write_file(
    path: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None, *, fsync: bool = True
) -> WrittenFile:
    """Write a local safetensors file, hashing while writing, and fsync it (unless not `fsync`: then the
    caller fsyncs it, with the other files of the same commit).

    Tensors may share storage (tied weights): each is written in full under its own name, which is
    what the format requires. Returns the size and digest so that the manifest needs no second read.
    """
    from ckptctl.formats.digest import HashingWriter  # blake3 and the sweep: for writers, not readers (DESIGN §5)

    names = list(tensors)
    entries = [(n, str(tensors[n].dtype).removeprefix("torch."), tuple(tensors[n].shape)) for n in names]
    with open(path, "wb") as raw:
        out = HashingWriter(raw)
        out.write(build_header(entries, metadata))
        for name in names:
            data = tensor_bytes(tensors[name])
            if len(data):
                out.write(data)
        raw.flush()
        if fsync:
            os.fsync(raw.fileno())
    return WrittenFile(out.size, out.hexdigest())


def read_tensors(url: str, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Load tensors (all, or the named ones) from a safetensors file into CPU memory, validated first."""

    header = read_header(url)
    wanted = None if names is None else set(names)
    out: dict[str, torch.Tensor] = {}
    for rec in header.tensors:
        if wanted is not None and rec.name not in wanted:
            continue
        out[rec.name] = tensor_from_bytes(io.read_bytes(url, rec.begin, rec.end - rec.begin), rec.dtype, rec.shape)
    return out


def tensor_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor owning a copy of `data` interpreted as `dtype` and `shape`."""
    import torch

    torch_dtype = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch_dtype).reshape(shape)
