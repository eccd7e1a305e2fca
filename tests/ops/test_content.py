"""verify's content pass: NaN/Inf counted exactly however the pass cuts a tensor's bytes into parts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.io.sweep import Span, Sweep
from ckptctl.ops.content import _ChunkBytes


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("content")


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(["float32", "float64", "float16"]),
    nan_at=st.sets(st.integers(0, 999), max_size=30),
    skew=st.integers(0, 7),
    block=st.sampled_from([5, 64, 1 << 20]),
    piece=st.sampled_from([13, 1000, 1 << 20]),
)
def test_non_finite_values_are_counted_across_cuts(
    folder: Path, dtype: str, nan_at: set[int], skew: int, block: int, piece: int
) -> None:
    values = np.arange(1000, dtype=dtype)
    for i in nan_at:
        values[i] = np.inf if i % 2 else np.nan
    path = folder / f"{dtype}-{skew}"
    path.write_bytes(b"x" * skew + values.tobytes())  # elements start at an odd offset of the file
    sink = _ChunkBytes(dtype, finite=True)
    Sweep([Span(str(path), skew, skew + values.nbytes, sink)], block=block, large_block=block, piece=piece).run(2)
    assert sink.error is None
    assert sink.bad() == len(nan_at)
