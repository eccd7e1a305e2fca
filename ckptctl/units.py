"""Sizes and ages as people write them (`500GB`, `2GiB`, `7d`, `1d12h`), parsed and formatted.

Shared by `convert --max-shard-size` and the retention rules (`max_total_size`, `older_than`, `--grace`).
KB/MB/GB/... are powers of 10 (as transformers' `max_shard_size` and disk vendors count), KiB/MiB/GiB/...
powers of 2. This module imports nothing heavy, so that `ckptctl prune` works where torch is not installed.
"""

from __future__ import annotations

import re
from datetime import timedelta

__all__ = ["MAX_AGE", "MAX_SIZE", "format_age", "format_size", "parse_age", "parse_size"]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
#: The largest size accepted: more than any storage holds, and still a 64-bit byte count.
MAX_SIZE = 8 << 60
#: The longest age accepted: longer than any run lasts, short enough that `now - age` is still a date.
MAX_AGE = timedelta(days=1000 * 365)
#: A size written with more digits than this is above `MAX_SIZE` whatever its unit (and too long for the
#: exact arithmetic of `Fraction` to be cheap).
_MAX_DIGITS = 40
_AGE_UNITS = {"w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}
_AGE_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")


def parse_size(text: str, *, minimum: int = 0) -> int:
    """Bytes from `500GB`, `1.5TiB`, `20KB` or `123456`.

    Args:
        text: the size as written.
        minimum: the smallest size accepted (`1` where an empty size makes no sense, as a shard size).

    Raises:
        ValueError: not a size, or one below `minimum` or above `MAX_SIZE`.
    """
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{_shown(text)} is not a size (examples: 500GB, 2TiB, 800MB, 20KB, 1000000)")
    if len(m.group(1)) > _MAX_DIGITS:
        raise ValueError(f"{_shown(text)}: the size must be at most 8EiB")
    from fractions import Fraction  # imported here: it pulls in decimal, a cost to every command at start-up

    value = int(Fraction(m.group(1)) * _SIZE_UNITS[unit])
    if value < minimum:
        raise ValueError(f"{_shown(text)}: the size must be at least {format_size(minimum)}")
    if value > MAX_SIZE:
        raise ValueError(f"{_shown(text)}: the size must be at most 8EiB")
    return value


def format_size(n: int) -> str:
    """A byte count in the largest unit that writes it exactly (`500GB`, `2GiB`), else in bytes."""
    for unit in ("PB", "PiB", "TB", "TiB", "GB", "GiB", "MB", "MiB", "kB", "KiB"):
        scale = _SIZE_UNITS[unit.lower()]
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def human_bytes(n: int | None) -> str:
    """A byte count as a person reads it (`1.2 MiB`), `-` for None."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def parse_age(text: str) -> timedelta:
    """A duration from `7d`, `12h`, `30m`, `45s`, `2w`, combinations such as `1d12h`, or `0`.

    Raises:
        ValueError: not a duration, or one longer than `MAX_AGE`.
    """
    compact = text.strip().lower().replace(" ", "")
    if compact == "0":
        return timedelta(0)
    if not compact or _AGE_PART.sub("", compact):
        raise ValueError(f"{_shown(text)} is not an age (examples: 7d, 12h, 30m, 1d12h)")
    seconds = sum(float(n) * _AGE_UNITS[u] for n, u in _AGE_PART.findall(compact))
    if not seconds <= MAX_AGE.total_seconds():  # also catches the infinity of a number with 400 digits
        raise ValueError(f"{_shown(text)}: an age must be at most {MAX_AGE.days // 365} years")
    return timedelta(seconds=seconds)


def format_age(age: timedelta) -> str:
    """`7d`, `1d12h`, `30m`, `0s`."""
    seconds = round(age.total_seconds())
    parts = []
    for unit in ("d", "h", "m", "s"):
        count, seconds = divmod(seconds, _AGE_UNITS[unit])
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"


def _shown(text: str) -> str:
    """`text` quoted for a message, shortened: an absurd option value may be thousands of characters."""
    return repr(text) if len(text) <= 60 else repr(text[:57] + "...")
