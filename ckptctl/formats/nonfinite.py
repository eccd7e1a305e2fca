"""Counting NaN and Inf values in raw little-endian element bytes, with numpy and without torch.

A float is not finite exactly when its bits match a pattern under a mask: the exponent all ones for the
IEEE formats (fp64, fp32, fp16, bf16, float8 e5m2), the one NaN encoding of float8 e4m3fn (`S.1111.111`,
it has no infinity), and `0x80` for the `fnuz` float8 formats (no infinity, no negative zero). So a block
of a tensor's bytes is checked with two vectorised integer operations, in the block's own memory; torch is
neither imported (it costs seconds and hundreds of MiB) nor needed for dtypes numpy lacks (bf16, float8).
The floats numpy has are checked by its `isfinite`, one pass (twice as fast as the mask).
"""

from __future__ import annotations

import numpy as np

__all__ = ["counts_non_finite", "non_finite"]

#: Floats numpy knows: their own `isfinite`.
_NATIVE = {"float64": "<f8", "float32": "<f4", "float16": "<f2"}
#: dtype -> (unsigned integer type of its width, mask, pattern of a non-finite value under the mask).
_PATTERNS: dict[str, tuple[str, int, int]] = {
    "float64": ("<u8", 0x7FF0_0000_0000_0000, 0x7FF0_0000_0000_0000),
    "float32": ("<u4", 0x7F80_0000, 0x7F80_0000),
    "float16": ("<u2", 0x7C00, 0x7C00),
    "bfloat16": ("<u2", 0x7F80, 0x7F80),
    "float8_e5m2": ("u1", 0x7C, 0x7C),
    "float8_e4m3fn": ("u1", 0x7F, 0x7F),
    "float8_e4m3fnuz": ("u1", 0xFF, 0x80),
    "float8_e5m2fnuz": ("u1", 0xFF, 0x80),
    "float8_e8m0fnu": ("u1", 0xFF, 0xFF),
}


def counts_non_finite(dtype: str) -> bool:
    """Whether values of `dtype` can be NaN or Inf (floats; integers and bools never are)."""
    return dtype in _PATTERNS


def non_finite(data: bytes | bytearray | memoryview, dtype: str) -> int:
    """How many values of `dtype` in `data` (a whole number of little-endian elements) are NaN or Inf.

    Raises:
        KeyError: `dtype` is not a float (see `counts_non_finite`).
    """
    native = _NATIVE.get(dtype)
    if native is not None:
        floats = np.frombuffer(data, dtype=native)
        return int(floats.size - np.count_nonzero(np.isfinite(floats)))
    kind, mask, pattern = _PATTERNS[dtype]
    values = np.frombuffer(data, dtype=kind)
    return int(np.count_nonzero((values & values.dtype.type(mask)) == pattern))
