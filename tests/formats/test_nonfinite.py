"""NaN/Inf counted from raw bytes agrees with torch.isfinite on every float dtype, for every bit pattern."""

from __future__ import annotations

import pytest
import torch

from ckptctl.checkpoint import dtype_itemsize
from ckptctl.formats.nonfinite import counts_non_finite, non_finite

FLOATS = [
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e5m2",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
]


@pytest.mark.parametrize("dtype", FLOATS)
def test_agrees_with_torch(dtype: str) -> None:
    size = dtype_itemsize(dtype)
    if size <= 2:  # every bit pattern of the type
        raw = torch.arange(1 << (8 * size), dtype=torch.int32).to(torch.int16 if size == 2 else torch.uint8)
        data = raw.numpy().tobytes()
    else:  # random patterns, and the special values
        specials = torch.tensor(
            [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40], dtype=getattr(torch, dtype)
        )
        data = (
            torch.randint(0, 256, (1 << 16,), dtype=torch.uint8).numpy().tobytes()
            + specials.view(torch.uint8).numpy().tobytes()
        )
    values = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype))
    # torch has no isfinite for float8 types: upcast (NaN and Inf stay what they are).
    expected = int(values.numel() - torch.isfinite(values.float() if size == 1 else values).sum())
    assert non_finite(data, dtype) == expected > 0


def test_integers_are_never_counted() -> None:
    assert not any(counts_non_finite(d) for d in ("int64", "int8", "uint8", "bool", "complex64"))
    assert all(counts_non_finite(d) for d in FLOATS)
