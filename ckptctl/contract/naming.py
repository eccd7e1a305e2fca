"""What the frameworks' namespace strippers (`ConvertSource.namespace_stripper`) share: the name rules of the
storage formats layouts build on, and ways a tensor name loses the namespace a save put in front of the model's
own name (`ckptctl.ops.naming` applies them). Which format's rule applies to a checkpoint's tensors is the
registry's to say (`layouts.format_rules.format_namespace_stripper`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ckptctl.checkpoint import TensorEntry

__all__ = [
    "NameStripper",
    "keep_name",
    "shared_first_segment",
    "strip_segments",
]

#: Turns a stored tensor name into the model's own name.
NameStripper = Callable[[str], str]


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
