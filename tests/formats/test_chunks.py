"""Chunk tiling rules and assembling tensors from raw chunks."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl import io
from ckptctl.checkpoint import ChunkEncoding, Component, TensorChunk, TensorEntry
from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.chunks import read_tensor, tiling_problem


@pytest.mark.parametrize(
    ("shape", "boxes"),
    [
        ((4, 3), [((0, 0), (4, 3))]),
        ((11, 8), [((0, 0), (6, 8)), ((6, 0), (5, 8))]),  # FSDP: uneven rows
        ((1, 12), [((0, 0), (1, 12)), ((1, 0), (0, 12))]),  # an empty shard at the end
        ((4, 6), [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))]),  # 2-D grid
        ((), [((), ())]),  # a 0-d scalar
        ((0, 5), [((0, 0), (0, 5))]),
    ],
)
def test_exact_tilings(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    assert tiling_problem(shape, boxes) is None


@pytest.mark.parametrize(
    ("shape", "boxes", "message"),
    [
        ((4, 3), [((0, 0), (2, 3))], "cover at most 6 of 12"),
        ((4, 3), [((0, 0), (3, 3)), ((3, 0), (2, 3))], "outside"),
        ((4, 3), [((0, 0), (3, 3)), ((2, 0), (1, 3)), ((3, 0), (1, 3))], "overlap"),
        ((4, 3), [((0, 0), (4, 3)), ((0, 0), (4, 3))], "overlap"),
        ((4, 3), [((0,), (4,))], "dimensions"),
        ((4, 6), [((0, 0), (4, 3)), ((0, 2), (4, 3))], "cover at most|overlap"),
    ],
)
def test_broken_tilings(
    shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], message: str
) -> None:
    problem = tiling_problem(shape, boxes)
    assert problem is not None
    assert any(m in problem for m in message.split("|")), problem


@st.composite
def grids(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """A random shape cut into a random grid of blocks (what FSDP x TP sharding produces)."""
    ndim = draw(st.integers(1, 3))
    cuts = [sorted(set(draw(st.lists(st.integers(1, 9), max_size=3)))) for _ in range(ndim)]
    shape = tuple(draw(st.integers(max(c, default=0) + 1, 12)) for c in cuts)
    edges = [[0, *c, d] for c, d in zip(cuts, shape, strict=True)]
    boxes = []
    for cell in itertools.product(*[range(len(e) - 1) for e in edges]):
        offsets = tuple(edges[d][i] for d, i in enumerate(cell))
        sizes = tuple(edges[d][i + 1] - edges[d][i] for d, i in enumerate(cell))
        boxes.append((offsets, sizes))
    return shape, boxes


@settings(max_examples=200, deadline=None)
@given(grid=grids(), data=st.data())
def test_grids_tile_and_any_damage_is_caught(grid: tuple, data: st.DataObject) -> None:
    shape, boxes = grid
    assert tiling_problem(shape, boxes) is None
    victim = data.draw(st.integers(0, len(boxes) - 1))
    assert tiling_problem(shape, boxes[:victim] + boxes[victim + 1 :]) is not None  # a hole
    assert tiling_problem(shape, [*boxes, boxes[victim]]) is not None  # a duplicate


def _raw_entry(tmp_path: Path, full: torch.Tensor, grid: list[tuple[tuple[int, int], tuple[int, int]]]) -> TensorEntry:
    chunks, blob = [], b""
    for offsets, sizes in grid:
        region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
        data = full[region].contiguous().view(torch.uint8).numpy().tobytes()
        chunks.append(TensorChunk("data.bin", len(blob), len(data), offsets, sizes, ChunkEncoding.RAW))
        blob += data
    (tmp_path / "data.bin").write_bytes(blob)
    return TensorEntry("w", Component.MODEL, "float32", tuple(full.shape), tuple(chunks))


GRID = [((0, 0), (2, 3)), ((0, 3), (2, 2)), ((2, 0), (3, 3)), ((2, 3), (3, 2))]


def test_read_tensor_assembles_raw_chunks_and_reads_only_them(tmp_path: Path) -> None:
    full = torch.randn(5, 5)
    entry = _raw_entry(tmp_path, full, GRID)
    io.READ_STATS.reset()
    assert torch.equal(read_tensor(str(tmp_path), entry), full)
    assert io.READ_STATS.bytes_read == full.numel() * 4


def test_read_tensor_refuses_a_truncated_file_before_allocating(tmp_path: Path) -> None:
    entry = _raw_entry(tmp_path, torch.randn(5, 5), GRID)
    data = (tmp_path / "data.bin").read_bytes()
    (tmp_path / "data.bin").write_bytes(data[:-4])
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        read_tensor(str(tmp_path), entry)


def test_read_tensor_refuses_incomplete_chunks(tmp_path: Path) -> None:
    entry = _raw_entry(tmp_path, torch.randn(5, 5), GRID)
    holed = TensorEntry(entry.name, entry.component, entry.dtype, entry.shape, entry.chunks[:3])
    with pytest.raises(CorruptCheckpoint, match="cover"):
        read_tensor(str(tmp_path), holed)
