"""JSON and TOML documents as checkpoints and run folders hold them, read so that no content can crash us.

Every JSON or TOML file ckptctl reads (manifests, configs, indexes, `trainer_state.json`, the frameworks'
info files, encoded state trees, `ckptctl.toml`) goes through here, because the standard parsers fail in
ways their callers rarely expect: nesting a few thousand levels deep raises `RecursionError`, an integer
of 5,000 digits raises a plain `ValueError`, and `Infinity` parses into a float that `int()` refuses with
`OverflowError`. Here:

- a document is read only from a regular file of at most `MAX_JSON_BYTES` (or what the caller allows),
- a parse error of any kind, and nesting deeper than `MAX_DEPTH`, become a `CorruptCheckpoint` naming
  the file,
- `whole_number` and `real_number` turn a field that must be a count (a step, a size, a world size) or a
  measurement (an epoch) into a checked value, or a `CorruptCheckpoint` naming the file and the field.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ckptctl import io
from ckptctl.errors import CorruptCheckpoint

__all__ = [
    "MAX_DEPTH",
    "MAX_INT",
    "MAX_JSON_BYTES",
    "MAX_TOML_BYTES",
    "as_real",
    "as_whole",
    "parse_json",
    "parse_toml",
    "read_json",
    "read_toml",
    "real_number",
    "shown",
    "whole_number",
]

#: The largest JSON document read by default: far above any config, index or trainer state that a real
#: run writes (the index of a 90k-tensor model is 9 MB), small enough that parsing it stays within memory.
MAX_JSON_BYTES = 64 << 20
#: The largest TOML document read (policy files are a few lines).
MAX_TOML_BYTES = 1 << 20
#: Nesting deeper than this is refused: real documents nest a dozen levels at most, and code that walks a
#: parsed document recursively must never meet one deep enough to exhaust the stack.
MAX_DEPTH = 200
#: The largest whole number a count may hold (steps, sizes and world sizes are 64-bit everywhere else).
MAX_INT = 2**63 - 1


def parse_json(data: bytes | str, source: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse a JSON document (NaN and Infinity allowed, as Python's json module writes them).

    Args:
        data: the document.
        source: the file it came from, for messages.
        max_depth: the deepest nesting of arrays and objects accepted.

    Raises:
        CorruptCheckpoint: not UTF-8, not JSON, an integer too long to convert, or nested too deeply.
    """
    text = data if isinstance(data, str) else _text(data, source)
    try:
        doc = json.loads(text)
    except RecursionError as exc:
        raise _too_deep(source, max_depth) from exc
    except ValueError as exc:  # JSONDecodeError, and the int() limit on digits (not a JSONDecodeError)
        raise CorruptCheckpoint(f"{source}: not valid JSON ({_short(str(exc), 200)})") from exc
    if _deeper_than(doc, max_depth):
        raise _too_deep(source, max_depth)
    return doc


def read_json(url: str, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """Read and parse the JSON file at `url` (a regular file of at most `max_bytes`).

    Raises:
        CheckpointNotFound: there is no such file.
        CorruptCheckpoint: not a regular file, too large, or what `parse_json` refuses.
        StorageError: the file cannot be read.
    """
    text = _text(io.read_bytes(url, max_size=max_bytes), url)  # the bytes are freed before parsing
    return parse_json(text, url, max_depth=max_depth)


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """Parse a TOML document.

    Raises:
        CorruptCheckpoint: not TOML, an integer too long to convert, or nested too deeply.
    """
    import tomllib  # few checkpoints hold TOML: its parser is imported by what reads one (DESIGN §5)

    try:
        doc = tomllib.loads(text)
    except RecursionError as exc:
        raise _too_deep(source, MAX_DEPTH) from exc
    except ValueError as exc:  # TOMLDecodeError, and the int() limit on digits
        raise CorruptCheckpoint(f"{source} is not valid TOML: {_short(str(exc), 200)}") from exc
    if _deeper_than(doc, MAX_DEPTH):
        raise _too_deep(source, MAX_DEPTH)
    return doc


def read_toml(url: str, *, max_bytes: int = MAX_TOML_BYTES) -> dict[str, Any]:
    """Read and parse the TOML file at `url` (a regular UTF-8 file of at most `max_bytes`).

    Raises:
        CheckpointNotFound: there is no such file.
        CorruptCheckpoint: not a regular file, too large, not UTF-8, or what `parse_toml` refuses.
    """
    return parse_toml(io.read_text(url, max_size=max_bytes), url)


def as_whole(value: Any, *, minimum: int = 0, maximum: int = MAX_INT) -> int | None:
    """`value` as an int in [minimum, maximum], or None when it is not one (for fields read leniently).

    A float is accepted when it is a whole number (`30.0`); a bool, a string, a fraction, NaN or an
    infinity is not.
    """
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        number = int(value)
    return number if number is not None and minimum <= number <= maximum else None


def as_real(value: Any) -> float | None:
    """`value` as a finite float (an int is accepted), or None when it is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        return None
    return number if math.isfinite(number) else None


def whole_number(value: Any, source: str, field: str, *, minimum: int = 0, maximum: int = MAX_INT) -> int:
    """`value` as an int in [minimum, maximum] (see `as_whole`), for fields that must hold one.

    Args:
        value: what the document holds.
        source: the file, for messages.
        field: the field's name in the document, for messages.
        minimum: the smallest value accepted.
        maximum: the largest value accepted.

    Raises:
        CorruptCheckpoint: not a whole number in range.
    """
    number = as_whole(value, minimum=minimum, maximum=maximum)
    if number is None:
        raise CorruptCheckpoint(
            f"{source}: {field} must be a whole number from {minimum} to {maximum}, not {shown(value)}"
        )
    return number


def real_number(value: Any, source: str, field: str) -> float:
    """`value` as a finite float (see `as_real`), for fields that must hold one.

    Raises:
        CorruptCheckpoint: not a finite number.
    """
    number = as_real(value)
    if number is None:
        raise CorruptCheckpoint(f"{source}: {field} must be a finite number, not {shown(value)}")
    return number


def _text(data: bytes, source: str) -> str:
    try:
        return data.decode(json.detect_encoding(data))  # UTF-8, or UTF-16/32 with a BOM, as json.loads accepts
    except UnicodeDecodeError as exc:
        raise CorruptCheckpoint(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def _deeper_than(doc: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels (iterative: the check itself cannot
    exhaust the stack)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict | list):
            continue
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def _too_deep(source: str, limit: int) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        f"{source}: nested more than {limit} levels deep",
        "no real document nests so deep; the file is damaged or hostile",
    )


def shown(value: Any) -> str:
    """A value for a message, shortened: a hostile field may hold an integer of thousands of digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return _short(repr(value) if not isinstance(value, dict | list) else type(value).__name__, 60)


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
