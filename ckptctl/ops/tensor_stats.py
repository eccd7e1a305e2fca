"""How two tensors' values differ, computed block by block on numpy.

`diff` compares each pair in blocks of a few tens of thousands of elements, so that the upcast copies
and temporaries of a block stay in the CPU cache however large the tensor is. The statistics are exact
in the sense `ops.diff` documents: both sides are upcast (float64, complex128 when either side is
complex, int64 when neither is floating) before any arithmetic, so bf16 against fp32 compares the bf16
values exactly; NaN equals NaN and an infinity equals the same infinity; any other position where
either side is not finite is a mismatch, makes the largest difference infinite, and is left out of the
L2 sums.

A block of floats goes through a fast path of a few vectorised passes (difference, sums of squares,
largest difference, and a tolerance count only when the largest difference exceeds `atol`); the masked
passes that handle NaN and infinities run only on blocks whose sums say they hold one.

Blocks are the unit of everything: `compare_block` of a differing block, `norms_block` of a block both
sides hold bit for bit (it only adds to the norms), and `fold` of the blocks' results in block order.
Whoever computes the blocks (a whole tensor in one thread, or blocks streamed by many) gets the same
numbers to the last bit, as long as the blocks start at the same elements.

Bytes are decoded without torch for every dtype numpy holds, and for bfloat16 (the upper half of a
float32: a shift, exact, and without ml_dtypes, whose import alone costs more than comparing a gigabyte);
the float8 formats go through a 256-entry table that torch builds once.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlockStats",
    "ValueStats",
    "compare_block",
    "compute_dtype",
    "decode",
    "fold",
    "norms_block",
    "raw_from_bytes",
    "raw_from_tensor",
]

#: Stored dtypes numpy reads as they are (little-endian, as safetensors and torch.save store them).
_NUMPY_DTYPES = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "complex128": "<c16",
    "complex64": "<c8",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint64": "<u8",
    "uint32": "<u4",
    "uint16": "<u2",
    "uint8": "u1",
    "bool": "?",
}
#: Elements summed per row by `_sum_squares`: short rows keep BLAS on the calling thread.
_ROW = 4096


@dataclass(frozen=True, slots=True)
class ValueStats:
    """How the values of two tensors of the same shape differ (see `ops.diff.compare_values`)."""

    identical: bool
    max_abs_diff: float
    rel_l2: float
    mismatched: int
    nonfinite_mismatched: int


class BlockStats(NamedTuple):
    """What one block adds: the largest finite difference, the sums of squares (of the differences and
    of each side's values, over the positions with a finite difference), and the mismatch counts."""

    max_abs: float
    sq_diff: float
    sq_a: float
    sq_b: float
    mismatched: int
    nonfinite: int


def fold(blocks: Iterable[BlockStats]) -> ValueStats:
    """The statistics of a pair that is not bit-identical, from its blocks' results in block order."""
    max_abs = sq_diff = sq_a = sq_b = 0.0
    mismatched = nonfinite = 0
    for block in blocks:
        max_abs = max(max_abs, block.max_abs)
        sq_diff += block.sq_diff
        sq_a += block.sq_a
        sq_b += block.sq_b
        mismatched += block.mismatched
        nonfinite += block.nonfinite
    norm = math.sqrt(max(sq_a, sq_b))
    rel = math.sqrt(sq_diff) / norm if norm > 0 else (0.0 if sq_diff == 0 else math.inf)
    return ValueStats(False, math.inf if nonfinite else max_abs, rel, mismatched, nonfinite)


# --------------------------------------------------------------------------------------------------
# Decoding.
# --------------------------------------------------------------------------------------------------


def _stored(dtype: str) -> np.dtype:
    if dtype in _NUMPY_DTYPES:
        return np.dtype(_NUMPY_DTYPES[dtype])
    if dtype == "bfloat16":
        return np.dtype("<u2")
    if dtype.startswith("float8"):
        return np.dtype("u1")
    raise ValueError(f"no numpy decoding for {dtype}")


def raw_from_bytes(data: bytes | bytearray | memoryview, dtype: str) -> np.ndarray:
    """The stored elements of `data` (bfloat16 and float8 as their unsigned bit patterns), without a copy."""
    return np.frombuffer(data, dtype=_stored(dtype))


def raw_from_tensor(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements, flat, as `raw_from_bytes` gives them (a view when the tensor is contiguous)."""
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    dtype = str(flat.dtype).removeprefix("torch.")
    if dtype == "bfloat16":
        return flat.view(torch.int16).numpy().view(np.uint16)
    if dtype.startswith("float8"):
        return flat.view(torch.uint8).numpy()
    if dtype not in _NUMPY_DTYPES:
        raise ValueError(f"no numpy decoding for {dtype}")
    return flat.numpy()


@functools.cache
def compute_dtype(dtype_a: str, dtype_b: str) -> np.dtype:
    """What both sides are upcast to before they are compared."""
    if any(d.startswith("complex") for d in (dtype_a, dtype_b)):
        return np.dtype(np.complex128)
    if any(d.startswith(("float", "bfloat")) for d in (dtype_a, dtype_b)):
        return np.dtype(np.float64)
    return np.dtype(np.int64)


def decode(raw: np.ndarray, dtype: str, compute: np.dtype) -> np.ndarray:
    """Stored elements of `dtype` (as `raw_from_bytes` returns them) upcast to `compute`, exactly."""
    with np.errstate(invalid="ignore"):  # a signalling NaN stays a NaN
        if dtype == "bfloat16":
            return _bfloat16_as_float32(raw, np.empty(raw.size, dtype=np.uint32)).astype(compute)
        if dtype.startswith("float8"):
            return _float8_values(dtype)[raw].astype(compute, copy=False)
        return raw.astype(compute, copy=False)


def _bfloat16_as_float32(raw: np.ndarray, words: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns as the float32 values they are, exactly (NaN stays NaN): a bfloat16 is the
    upper half of a float32. `words`: room for them, uint32."""
    np.left_shift(raw, 16, out=words, dtype=np.uint32)
    return words.view(np.float32)


@functools.cache
def _float8_values(dtype: str) -> np.ndarray:
    """Every value of an 8-bit float format, indexed by its bit pattern."""
    import torch

    return torch.arange(256, dtype=torch.uint8).view(getattr(torch, dtype)).to(torch.float64).numpy()


# --------------------------------------------------------------------------------------------------
# Blocks.
# --------------------------------------------------------------------------------------------------


def compare_block(
    raw_a: np.ndarray, dtype_a: str, raw_b: np.ndarray, dtype_b: str, atol: float, rtol: float
) -> BlockStats:
    """Compare one block of stored elements of each side (`raw_from_bytes`/`raw_from_tensor`, same length)."""
    compute = compute_dtype(dtype_a, dtype_b)
    if compute != np.float64:
        return _masked_stats(decode(raw_a, dtype_a, compute), decode(raw_b, dtype_b, compute), atol, rtol)
    n = raw_a.size
    scratch = _scratch(n)
    d = scratch.d[:n]
    with np.errstate(all="ignore"):  # signalling NaNs, inf - inf: the masked path handles them
        x = _decode_float(raw_a, dtype_a, scratch.x[:n], scratch)
        y = _decode_float(raw_b, dtype_b, scratch.y[:n], scratch)
        np.subtract(x, y, out=d)
        np.abs(d, out=d)
        sq_a, sq_b, sq_diff = _sum_squares(x), _sum_squares(y), _sum_squares(d)
    # Sums of squares are finite exactly when every value (and difference) is: no NaN or infinity to mask
    # in this block (a sum that overflows takes the masked path too, which gives the same).
    if not (math.isfinite(sq_a) and math.isfinite(sq_b) and math.isfinite(sq_diff)):
        return _masked_stats(x, y, atol, rtol)
    top = float(d.max()) if n else 0.0
    if top <= atol:  # then every difference is within atol + rtol * |a|
        return BlockStats(top, sq_diff, sq_a, sq_b, 0, 0)
    outside = scratch.mask[:n]
    if rtol == 0:
        np.greater(d, atol, out=outside)
    else:
        limit = scratch.limit[:n]
        np.abs(x, out=limit)
        limit *= rtol
        if atol:  # adding 0 changes no limit: a pass saved in the common rtol-only case
            limit += atol
        np.greater(d, limit, out=outside)
    return BlockStats(top, sq_diff, sq_a, sq_b, int(np.count_nonzero(outside)), 0)


def _masked_stats(x: np.ndarray, y: np.ndarray, atol: float, rtol: float) -> BlockStats:
    """`compare_block` of blocks with NaN or infinities, of complex and of integer blocks: every rule
    spelled out, on fresh arrays (such blocks are rare)."""
    with np.errstate(all="ignore"):
        same = x == y
        if x.dtype != np.int64:
            same |= np.isnan(x) & np.isnan(y)
        d = np.abs(x - y).astype(np.float64, copy=False)
        d[same] = 0.0
        finite = np.isfinite(d)
        nonfinite = int(finite.size - np.count_nonzero(finite))
        d[~finite] = 0.0
        ax = _finite_abs(x, finite)
        ay = _finite_abs(y, finite)
        top = float(d.max()) if d.size else 0.0
        mismatched = int(np.count_nonzero(d > atol + rtol * ax)) + nonfinite
        return BlockStats(top, _sum_squares(d), _sum_squares(ax), _sum_squares(ay), mismatched, nonfinite)


def norms_block(raw: np.ndarray, dtype: str) -> BlockStats:
    """What a block both sides hold bit for bit adds: its values to both norms. The same numbers as
    `compare_block` of the block against itself, without the passes that would find no difference."""
    compute = compute_dtype(dtype, dtype)
    with np.errstate(all="ignore"):
        if compute == np.float64:
            n = raw.size
            scratch = _scratch(n)
            x = _decode_float(raw, dtype, scratch.x[:n], scratch)
            sq = _sum_squares(x)
            if not math.isfinite(sq):
                sq = _sum_squares(_finite_abs(x, np.ones(n, dtype=bool)))
        else:
            x = decode(raw, dtype, compute)
            sq = _sum_squares(_finite_abs(x, np.ones(x.shape, dtype=bool)))
    return BlockStats(0.0, 0.0, sq, sq, 0, 0)


def _decode_float(raw: np.ndarray, dtype: str, out: np.ndarray, scratch: _Scratch) -> np.ndarray:
    """`decode(raw, dtype, float64)` into `out`."""
    if dtype == "bfloat16":
        np.copyto(out, _bfloat16_as_float32(raw, scratch.words[: raw.size]), casting="unsafe")
    elif dtype.startswith("float8"):
        np.take(_float8_values(dtype), raw, out=out)
    else:
        np.copyto(out, raw, casting="unsafe")
    return out


def _finite_abs(x: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """`|x|` as float64 where `keep` holds and `|x|` is finite, else 0."""
    ax = np.abs(x).astype(np.float64, copy=False)
    ax[~(keep & np.isfinite(ax))] = 0.0
    return ax


def _sum_squares(v: np.ndarray) -> float:
    """The sum of `v * v` (float64 `v`), as dot products of rows of `_ROW` elements.

    One BLAS dot over the whole block would be fastest alone, but OpenBLAS spreads dots of more than
    10,000 elements over all cores, which fights the threads `diff` already runs; rows this short stay
    on the calling thread.
    """
    n = v.size
    whole = n - n % _ROW
    total = 0.0
    if whole:
        rows = v[:whole].reshape(-1, _ROW)
        total = float(np.matmul(rows[:, None, :], rows[:, :, None]).sum())  # one dot per row
    if whole < n:
        tail = v[whole:]
        total += float(np.dot(tail, tail))
    return total


class _Scratch:
    """Arrays one thread reuses for every block it compares: fresh temporaries of a block's size would
    each be mapped and faulted in by the allocator, which costs more than the arithmetic on them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.x = np.empty(size)
        self.y = np.empty(size)
        self.d = np.empty(size)
        self.limit = np.empty(size)
        self.mask = np.empty(size, dtype=bool)
        self.words = np.empty(size, dtype=np.uint32)


_THREAD = threading.local()


def _scratch(size: int) -> _Scratch:
    scratch: _Scratch | None = getattr(_THREAD, "scratch", None)
    if scratch is None or scratch.size < size:
        scratch = _THREAD.scratch = _Scratch(size)
    return scratch
