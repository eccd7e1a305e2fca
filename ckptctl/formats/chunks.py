"""Assembling a full tensor from its stored chunks, and checking that chunks tile a tensor.

`read_tensor` serves `verify --deep`, `diff` and `convert`: it reads only the byte ranges of the one
tensor asked for (through `ckptctl.io`, so reads are counted and work on any fsspec URL) and decodes each
chunk by its encoding. `tiling_problem` is the coverage rule `verify` and `read_tensor` share. Importing
this module does not import torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckptctl import io
from ckptctl.checkpoint import ChunkEncoding, TensorChunk, TensorEntry, dtype_itemsize
from ckptctl.errors import CorruptCheckpoint

if TYPE_CHECKING:
    import torch

__all__ = ["read_chunk", "read_tensor", "tiling_problem"]

#: Above this many grid cells the overlap check falls back to looking for duplicate chunk offsets.
_MAX_GRID_CELLS = 1 << 20

Box = tuple[tuple[int, ...], tuple[int, ...]]


def tiling_problem(shape: tuple[int, ...], boxes: Sequence[Box]) -> str | None:
    """Why the chunks `(offsets, sizes)` do not tile a tensor of `shape` exactly, or None when they do.

    Every chunk must lie inside the tensor, their volumes must add up to its element count, and no two
    may overlap. Overlaps are checked exactly on the grid the chunk boundaries define (one cell per chunk
    for the usual FSDP/TP sharding); on irregular layouts with more than about a million grid cells only
    duplicated chunks are caught.
    """
    ndim = len(shape)
    numel = math.prod(shape)
    if len(boxes) == 1:  # the common case (unsharded or replicated tensors): one comparison
        offsets, sizes = boxes[0]
        if sizes == shape and not any(offsets) and len(offsets) == ndim:
            return None
    total = 0
    nonempty: list[Box] = []
    for offsets, sizes in boxes:
        if len(offsets) != ndim or len(sizes) != ndim:
            return f"a chunk has {len(offsets)} dimensions but the tensor has {ndim}"
        for o, s, d in zip(offsets, sizes, shape, strict=True):
            if o < 0 or s < 0 or o + s > d:
                return f"chunk at {list(offsets)} of size {list(sizes)} lies outside the tensor's shape {list(shape)}"
        volume = math.prod(sizes)
        total += volume
        if volume:
            nonempty.append((offsets, sizes))
    if total < numel:
        return f"chunks cover at most {total} of {numel} elements"
    overlap = _overlap(shape, nonempty)
    if overlap is not None:
        return overlap
    if total != numel:
        return f"chunks hold {total} elements but the tensor has {numel}: some overlap"
    return None


def _overlap(shape: tuple[int, ...], boxes: list[Box]) -> str | None:
    if len(boxes) < 2:
        return None
    # Grid lines: every chunk boundary along each dimension. Each chunk covers a block of grid cells;
    # two chunks overlap exactly when they share a cell.
    lines = []
    for dim in range(len(shape)):
        cuts = sorted({0, shape[dim]} | {o[dim] for o, _ in boxes} | {o[dim] + s[dim] for o, s in boxes})
        lines.append({cut: i for i, cut in enumerate(cuts)})
    cells = sum(math.prod(lines[d][o[d] + s[d]] - lines[d][o[d]] for d in range(len(shape))) for o, s in boxes)
    if cells > _MAX_GRID_CELLS:
        seen_offsets = set()
        for offsets, _ in boxes:
            if offsets in seen_offsets:
                return f"two chunks start at {list(offsets)}"
            seen_offsets.add(offsets)
        return None
    seen: dict[tuple[int, ...], tuple[int, ...]] = {}
    for offsets, sizes in boxes:
        ranges = [range(lines[d][offsets[d]], lines[d][offsets[d] + sizes[d]]) for d in range(len(shape))]
        for cell in itertools.product(*ranges):
            other = seen.get(cell)
            if other is not None:
                return f"chunks at {list(other)} and {list(offsets)} overlap"
            seen[cell] = offsets
    return None


def read_tensor(checkpoint_url: str, entry: TensorEntry) -> torch.Tensor:
    """Read one full tensor of a checkpoint, assembling it from its chunks.

    Only this tensor's byte ranges are read. Chunks stored RAW (safetensors-style element bytes) are
    reinterpreted; TORCH_SAVE chunks (DCP items) are decoded with `torch.load(weights_only=True)`.

    Args:
        checkpoint_url: the checkpoint folder; chunk files are relative to it.
        entry: the tensor, from the checkpoint's tensor index.

    Raises:
        CorruptCheckpoint: the chunks do not tile the tensor, a range lies outside its file, or a chunk
            does not decode to its declared dtype and shape.
    """
    import torch

    problem = tiling_problem(entry.shape, [(c.offsets, c.sizes) for c in entry.chunks])
    if problem is not None:
        raise CorruptCheckpoint(f"{entry.name}: {problem}")
    # Bound what we allocate by what is really on disk before allocating it.
    sizes: dict[str, int] = {}
    for chunk in entry.chunks:
        if chunk.file not in sizes:
            sizes[chunk.file] = io.file_size(io.join(checkpoint_url, chunk.file))
        if chunk.byte_offset + chunk.byte_length > sizes[chunk.file]:
            raise CorruptCheckpoint(
                f"{entry.name}: its bytes {chunk.byte_offset}..{chunk.byte_offset + chunk.byte_length} lie outside "
                f"{chunk.file} ({sizes[chunk.file]} bytes)",
                "the file is truncated",
            )
    if len(entry.chunks) == 1 and entry.chunks[0].sizes == entry.shape:
        return read_chunk(checkpoint_url, entry, entry.chunks[0])
    out = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
    for chunk in entry.chunks:
        if chunk.numel == 0:
            continue
        region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
        out[region] = read_chunk(checkpoint_url, entry, chunk)
    return out


def read_chunk(checkpoint_url: str, entry: TensorEntry, chunk: TensorChunk) -> torch.Tensor:
    """Read and decode one chunk of `entry`, checking it has the declared dtype and the chunk's shape.

    Raises:
        CorruptCheckpoint: short read, undecodable bytes, or a dtype/shape other than declared.
    """
    from ckptctl.formats.safetensors import tensor_from_bytes

    url = io.join(checkpoint_url, chunk.file)
    where = f"{chunk.file}@{chunk.byte_offset} ({entry.name})"
    data = io.read_bytes(url, chunk.byte_offset, chunk.byte_length)
    if len(data) != chunk.byte_length:
        raise CorruptCheckpoint(
            f"{where}: expected {chunk.byte_length} bytes, read {len(data)}", "the file is truncated"
        )
    if chunk.encoding == ChunkEncoding.RAW:
        expected = chunk.numel * dtype_itemsize(entry.dtype)
        if len(data) != expected:
            raise CorruptCheckpoint(
                f"{where}: holds {len(data)} bytes but {entry.dtype}{list(chunk.sizes)} needs {expected}"
            )
        return tensor_from_bytes(data, entry.dtype, chunk.sizes)
    from ckptctl.formats.torch_save import decode_tensor

    tensor = decode_tensor(data, where)
    got_dtype = str(tensor.dtype).removeprefix("torch.")
    if got_dtype != entry.dtype or tuple(tensor.shape) != chunk.sizes:
        raise CorruptCheckpoint(
            f"{where}: decodes to {got_dtype}{list(tensor.shape)} but the metadata says {entry.dtype}{list(chunk.sizes)}"
        )
    return tensor
