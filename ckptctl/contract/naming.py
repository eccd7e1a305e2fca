"""What the frameworks' namespace strippers (`ConvertSource.namespace_stripper`) share: the name rules of the
storage formats layouts build on, and ways a tensor name loses the namespace a save put in front of the model's
own name (`ckptctl.ops.naming` applies them)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

from ckptctl.checkpoint import TensorEntry

__all__ = [
    "FORMAT_NAME_RULES",
    "NameStripper",
    "format_namespace_stripper",
    "keep_name",
    "shared_first_segment",
    "strip_segments",
]

#: Turns a stored tensor name into the model's own name.
NameStripper = Callable[[str], str]

#: The name rules of the storage formats several layouts keep tensors in ("module:function", imported
#: on first use), tried in order: each returns a `NameStripper` when every tensor lies in its format's
#: files, else None. A layout built on one of these formats gets its rule without naming it, like the
#: layout registry in `ckptctl.layouts`.
FORMAT_NAME_RULES = (
    "ckptctl.families.dcp_naming:dcp_namespace_stripper",
    "ckptctl.families.zero_tag.naming:wrapper_stripper",
)


def format_namespace_stripper(entries: Sequence[TensorEntry]) -> NameStripper:
    """The rule of the storage format every tensor of `entries` lies in (`FORMAT_NAME_RULES`), or the
    names as stored when none applies."""
    for spec in FORMAT_NAME_RULES:
        module, _, name = spec.partition(":")
        rule: Callable[[Sequence[TensorEntry]], NameStripper | None] = getattr(importlib.import_module(module), name)
        found = rule(entries)
        if found is not None:
            return found
    return keep_name


def keep_name(name: str) -> str:
    """The name as stored (the names are the model's own)."""
    return name


def strip_segments(count: int) -> NameStripper:
    """Remove the first `count` dotted segments of a name (a name with no more segments is kept)."""

    def strip(name: str) -> str:
        parts = name.split(".", count)
        return parts[count] if len(parts) > count and parts[count] else name

    return strip


def shared_first_segment(entries: Sequence[TensorEntry]) -> str | None:
    """The first dotted segment every name of `entries` has in common, or None."""
    firsts = {e.name.partition(".")[0] for e in entries if "." in e.name}
    if len(firsts) != 1 or any("." not in e.name for e in entries):
        return None
    return next(iter(firsts))
