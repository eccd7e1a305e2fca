"""Standard-library values that training-state pickles carry, read as data: the allowlist entries of
`formats.torch_pickle_classes` (whole-file pickles) and `formats.torch_save_classes`' object reads.

Frameworks put plain standard-library values into what they torch.save: a `datetime.timedelta` (a timeout,
an elapsed time: Composer's `Timestamp` state, HF Trainer's elapsed times), a `datetime.datetime` (a save
time), `pathlib` paths (torchtune's and Lightning's output folders), `argparse.Namespace` (Megatron-LM's and
many scripts' arguments) and enum members of the standard library (`http.HTTPStatus`, `signal.Signals`).
None of them runs code when rebuilt: the datetime types are immutable values built from ints or their packed
bytes, a path is kept as its string, a namespace and an enum member as inert stand-ins holding their fields or
value. Each stand-in checks the types of what the pickle hands it, so a hostile file gets a
`CorruptCheckpoint`, never an object of another kind.
"""

from __future__ import annotations

import datetime
import ntpath
import posixpath
from collections.abc import Callable, Mapping
from decimal import Decimal
from fractions import Fraction
from typing import Any

from ckptctl.formats.safe_pickle import FrameworkObject, check_growth, stand_in_class

__all__ = ["STDLIB_DATA_GLOBALS", "StdlibObject"]

#: Longest text a path or number stand-in copies (real paths and numbers are far shorter).
_MAX_TEXT = 1 << 16
_INTS = (int,)
_NUMBERS = (int, float)


def _checked(args: tuple[Any, ...], kinds: tuple[type, ...], most: int) -> tuple[Any, ...]:
    if len(args) > most or any(type(a) not in kinds for a in args):
        raise ValueError(f"expected at most {most} values of {', '.join(k.__name__ for k in kinds)}")
    return args


def _timedelta(*args: Any) -> datetime.timedelta:
    """`datetime.timedelta(days, seconds, microseconds)`: its pickle's REDUCE arguments."""
    return datetime.timedelta(*_checked(args, _NUMBERS, 7))


def _timezone(offset: Any, name: Any = None) -> datetime.timezone:
    """`datetime.timezone(offset[, name])`: the offset a `timedelta` its pickle rebuilt first."""
    if type(offset) is not datetime.timedelta or (name is not None and (type(name) is not str or len(name) > 64)):
        raise ValueError("a timezone is an offset and an optional short name")
    return datetime.timezone(offset) if name is None else datetime.timezone(offset, name)


def _packed(kind: Callable[..., Any], size: int) -> Callable[..., Any]:
    """The constructor of a datetime type whose pickle hands it its packed bytes (and a timezone), or ints."""

    def build(*args: Any) -> Any:
        if args and type(args[0]) is bytes:
            if len(args[0]) != size or len(args) > 2 or (len(args) == 2 and not isinstance(args[1], datetime.tzinfo)):
                raise ValueError(f"a packed {kind.__name__} is {size} bytes and an optional timezone")
            return kind(*args)
        tz = args[-1] if args and isinstance(args[-1], datetime.tzinfo) else None
        plain = _checked(args[:-1] if tz is not None else args, _INTS, 8)
        return kind(*plain, tzinfo=tz) if tz is not None else kind(*plain)

    return build


def _date(*args: Any) -> datetime.date:
    if args and type(args[0]) is bytes:
        if len(args) != 1 or len(args[0]) != 4:
            raise ValueError("a packed date is 4 bytes")
        return datetime.date(args[0])  # type: ignore[arg-type,call-arg]  # the pickle's own packed form
    return datetime.date(*_checked(args, _INTS, 3))


def _path(join: Callable[..., str]) -> Callable[..., str]:
    """A `pathlib` path class: its pickle hands it the path's parts; kept as the joined string."""

    def build(*parts: Any) -> str:
        if any(type(p) is not str for p in parts):
            raise ValueError("a path is rebuilt from strings")
        length = sum(len(p) + 1 for p in parts)
        if length > _MAX_TEXT:
            raise ValueError("a path longer than any real one")
        check_growth(64 + length)
        return join(*parts) if parts else "."

    return build


def _text_number(kind: Callable[[str], Any]) -> Callable[..., Any]:
    """`decimal.Decimal` / `fractions.Fraction` from the text its pickle carries."""

    def build(value: Any = "0") -> Any:
        if type(value) is not str or len(value) > 128:
            raise ValueError(f"a {kind.__name__} is rebuilt from a short string")
        return kind(value)

    return build


class StdlibObject(FrameworkObject):
    """An object of a plain standard-library class (an `argparse.Namespace`, an enum member): its fields
    (BUILD) or its value (an enum member's REDUCE), as a `FrameworkObject` holds them."""

    __slots__ = ()


def _inert(qualified: str) -> type[StdlibObject]:
    return stand_in_class("StdlibObject", StdlibObject, stands_for=qualified)


#: Standard-library enums whose members training states have been seen to pickle (by value, as inert stand-ins).
_STDLIB_ENUMS = (
    ("http", "HTTPStatus"),
    ("signal", "Signals"),
    ("re", "RegexFlag"),
    ("inspect", "_ParameterKind"),
    ("socket", "AddressFamily"),
    ("socket", "SocketKind"),
    ("uuid", "SafeUUID"),
    ("ssl", "TLSVersion"),
    ("enum", "FlagBoundary"),
)

_PATHS: tuple[tuple[str, Callable[..., str]], ...] = (
    *(("PurePath", posixpath.join), ("PurePosixPath", posixpath.join), ("PosixPath", posixpath.join)),
    *(("Path", posixpath.join), ("PureWindowsPath", ntpath.join), ("WindowsPath", ntpath.join)),
)

#: Standard-library globals read as data (module, name) -> stand-in. `pathlib._local` is where Python 3.13
#: defines the path classes; protocol-0 pickles of datetime values name the same classes.
STDLIB_DATA_GLOBALS: Mapping[tuple[str, str], Any] = {
    ("datetime", "timedelta"): _timedelta,
    ("datetime", "timezone"): _timezone,
    ("datetime", "datetime"): _packed(datetime.datetime, 10),
    ("datetime", "time"): _packed(datetime.time, 6),
    ("datetime", "date"): _date,
    ("decimal", "Decimal"): _text_number(Decimal),
    ("fractions", "Fraction"): _text_number(Fraction),
    **{(module, name): _path(join) for module in ("pathlib", "pathlib._local") for name, join in _PATHS},
    ("argparse", "Namespace"): _inert("argparse.Namespace"),
    ("types", "SimpleNamespace"): _inert("types.SimpleNamespace"),
    **{(module, name): _inert(f"{module}.{name}") for module, name in _STDLIB_ENUMS},
}
