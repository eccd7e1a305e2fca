"""The block casts `convert --dtype` does without torch give torch's own results, bit for bit."""

from __future__ import annotations

import pytest
import torch

from ckptctl.formats.safetensors_stream import cast_block

PAIRS = [
    ("float32", "bfloat16"),
    ("float32", "float16"),
    ("bfloat16", "float32"),
    ("float16", "float32"),
    ("bfloat16", "float16"),
    ("float16", "bfloat16"),
    ("float64", "bfloat16"),
]


def _every_kind_of_value(dtype: torch.dtype) -> torch.Tensor:
    """Random bit patterns (subnormals, huge values, rounding ties included) plus the special values."""
    generator = torch.Generator().manual_seed(0)
    bits = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16}.get(dtype, torch.int16)
    info = torch.iinfo(bits)
    patterns = torch.randint(info.min, info.max, (200_000,), dtype=bits, generator=generator).view(dtype)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 65504.0, 65520.0, 1e-45, 3.4e38])
    # Exact ties between two bf16 values: the low 16 bits of a float32 are 0x8000.
    ties = (torch.arange(1, 1000, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    return torch.cat([patterns, special.to(dtype), ties.to(dtype)])


@pytest.mark.parametrize(("source", "target"), PAIRS)
def test_a_block_cast_equals_torchs_cast(source: str, target: str) -> None:
    values = _every_kind_of_value(getattr(torch, source))
    expected = values.to(getattr(torch, target))
    out = torch.empty_like(expected)
    cast_block(
        memoryview(values.view(torch.uint8).numpy()),
        source,
        memoryview(out.view(torch.uint8).numpy()),
        target,
        len(values),
    )
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(out), nan)
    # NaNs stay NaNs with their sign; their payload bits are the only thing torch may spell otherwise
    assert torch.equal(out[~nan].view(torch.uint8), expected[~nan].view(torch.uint8))
