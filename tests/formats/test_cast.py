"""The block casts `convert --dtype` does without torch round to nearest even, bit for bit.

Between float32, float16 and bfloat16 that is torch's own cast on every CPU, so torch is the reference.
From float64 it is not: torch's CPU kernel for float64 -> bfloat16 may round through float32 (two roundings;
seen with CPU capability AVX512, where 1 value in 200,000 differs), so the reference there is an exact
rounding computed from the float64 value itself, the same on any CPU.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
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
]

#: bfloat16's smallest normal exponent (frexp's convention: 2**-126 is 0.5 * 2**-125) and significand bits.
_BF16_MIN_EXPONENT = -125
_BF16_SIGNIFICAND_BITS = 8


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


def _correctly_rounded_bfloat16(values: np.ndarray) -> np.ndarray:
    """float64 -> bfloat16 rounded once, to nearest even, from the float64 value: scale by a power of two
    (exact) so that bfloat16's last significand bit is the units place (subnormals share the smallest
    normal quantum), round to an integer with `rint` (exact, ties to even), scale back. The result is a
    bfloat16 value (or +-inf past the largest), so the final casts round nothing."""
    _, exponent = np.frexp(values)
    quantum = np.maximum(exponent, _BF16_MIN_EXPONENT) - _BF16_SIGNIFICAND_BITS
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = np.ldexp(np.rint(np.ldexp(values, -quantum)), quantum)
        return rounded.astype(np.float32).astype(ml_dtypes.bfloat16)


def test_float64_to_bfloat16_rounds_once_to_nearest_even() -> None:
    """`convert --dtype bfloat16` of a float64 source rounds each value once (not through float32)."""
    values = _every_kind_of_value(torch.float64).numpy()
    expected = _correctly_rounded_bfloat16(values)
    out = np.empty(len(values), dtype=ml_dtypes.bfloat16)
    cast_block(memoryview(values.view(np.uint8)), "float64", memoryview(out.view(np.uint8)), "bfloat16", len(values))
    nan = np.isnan(values)
    assert np.array_equal(np.isnan(out.astype(np.float32)), nan)
    assert np.array_equal(out.view(np.uint16)[~nan], expected.view(np.uint16)[~nan])


def test_the_float64_reference_catches_double_rounding() -> None:
    """The reference is not the float32 path: a value just above a bfloat16 midpoint, which float32 rounds
    onto the midpoint and a second rounding then takes to even, rounds up here."""
    midpoint = 1.0 + 2.0**-8  # halfway between bfloat16's 1.0 and 1.0078125
    value = np.array([midpoint + 2.0**-40])  # float32 rounds this to the midpoint itself
    assert float(np.float32(value[0])) == midpoint
    assert float(_correctly_rounded_bfloat16(value)[0]) == 1.0 + 2.0**-7
    assert float(np.float32(value[0]).astype(ml_dtypes.bfloat16)) == 1.0  # two roundings land on even
