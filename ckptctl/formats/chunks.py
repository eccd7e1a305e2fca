"""Assembling a full tensor from its stored chunks, and checking that chunks tile a tensor.

`read_tensor` serves `verify --deep`, `diff` and `convert`: it reads only the byte ranges of the one
tensor asked for (through `ckptctl.io`, so reads are counted and work on any fsspec URL) and decodes each
chunk by its encoding. `tiling_problem` is the coverage rule `verify` and `read_tensor` share. Importing
this module does not import torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from ckptctl import io
from ckptctl.checkpoint import ChunkEncoding, Problem, ProblemKind, TensorChunk, TensorEntry, dtype_itemsize
from ckptctl.errors import CkptctlError, CorruptCheckpoint

if TYPE_CHECKING:
    import torch

__all__ = [
    "coverage_problems",
    "entry_tiling_problem",
    "flat_range_boxes",
    "index_coverage_problems",
    "read_chunk",
    "read_tensor",
    "tiling_problem",
]

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


def entry_tiling_problem(entry: TensorEntry) -> str | None:
    """`tiling_problem` of a tensor index entry's chunks."""
    return tiling_problem(entry.shape, [(c.offsets, c.sizes) for c in entry.chunks])


def coverage_problems(index: Iterable[TensorEntry]) -> list[Problem]:
    """A `coverage` problem for each tensor whose chunks do not tile it exactly."""
    found = ((entry.name, entry_tiling_problem(entry)) for entry in index)
    return [Problem(ProblemKind.COVERAGE, name, problem) for name, problem in found if problem is not None]


def index_coverage_problems(index: Callable[[], Iterable[TensorEntry]], path: str) -> list[Problem]:
    """`coverage_problems` of the tensor index `index()` builds from files that passed their own checks, or
    one `coverage` problem at `path` saying why it cannot be built (the files do not describe whole tensors)."""
    try:
        entries = index()
    except CkptctlError as exc:
        return [Problem(ProblemKind.COVERAGE, path, exc.message)]
    return coverage_problems(entries)


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


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[Box, int]]:
    """The elements `start:stop` of a row-major tensor of `shape`, as boxes that are each contiguous.

    Flat-partitioned states (DeepSpeed ZeRO's fp32 partitions, FSDP1's flat parameters) cut tensors at
    arbitrary element positions; a cut range is a partial row, whole rows and a partial row again, one
    level down for each dimension. So every range is at most `2 * ndim - 1` boxes, each of which is one
    contiguous run of the range.

    Returns:
        `((offsets, sizes), first)` per box, in order, where `first` is the box's first element as a flat
        index into the full tensor (its position within the range is `first - start`).
    """
    if start >= stop:
        return []
    if not shape:
        return [(((), ()), 0)]
    inner = math.prod(shape[1:])
    first_row, end_row = start // inner, -(-stop // inner)
    if end_row - first_row == 1 and (start % inner or stop % inner):  # inside one row: one level down
        return [
            (((first_row, *offsets), (1, *sizes)), first_row * inner + first)
            for (offsets, sizes), first in flat_range_boxes(shape[1:], start % inner, stop - first_row * inner)
        ]
    boxes: list[tuple[Box, int]] = []
    row = first_row
    if start % inner:  # the partial first row
        boxes += flat_range_boxes(shape, start, (row + 1) * inner)
        row += 1
    full_end = stop // inner
    if full_end > row:  # whole rows
        boxes.append((((row, *(0,) * (len(shape) - 1)), (full_end - row, *shape[1:])), row * inner))
    if stop % inner:  # the partial last row
        boxes += flat_range_boxes(shape, full_end * inner, stop)
    return boxes


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

    problem = entry_tiling_problem(entry)
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
