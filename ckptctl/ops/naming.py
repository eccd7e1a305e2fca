"""Tensor names as a model knows them: the namespace a save adds is removed, then the user's renames apply
(`convert --to hf` maps a framework's own names to transformers' in between).

`convert` (which writes the model's names into its output) and `diff` (which matches the tensors of
two checkpoints, possibly of different layouts) share these rules, so that a sharded training save and
the model exported from it name every tensor alike. Which namespace a save adds (the key the state was
saved under, the prefixes of training wrappers) is a fact of the layout that wrote it and of the storage
format it keeps tensors in: its `ConvertSource.namespace_stripper` says how to remove it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from ckptctl.checkpoint import TensorEntry
from ckptctl.contract.naming import keep_name
from ckptctl.errors import CkptctlError
from ckptctl.ops.convert_source import convert_source

__all__ = [
    "Renames",
    "apply_renames",
    "compile_renames",
    "namespace_stripper",
    "normalise_name",
    "normalised_names",
    "parse_rename",
]

#: Compiled `(pattern, replacement)` substitutions, applied in order.
Renames = tuple[tuple[re.Pattern[str], str], ...]


def parse_rename(text: str) -> tuple[str, str]:
    """`PATTERN=REPL` (split at the last `=`, so that patterns may hold lookaheads) with a valid regex.

    Raises:
        ValueError: no `=`, or the pattern does not compile.
    """
    pattern, sep, replacement = text.rpartition("=")
    if not sep or not pattern:
        raise ValueError(f"{text!r} is not PATTERN=REPL")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from exc
    return pattern, replacement


def compile_renames(renames: Iterable[tuple[str, str]]) -> Renames:
    """Compile `(pattern, replacement)` pairs (as `parse_rename` returns them)."""
    return tuple((re.compile(pattern), replacement) for pattern, replacement in renames)


def apply_renames(name: str, renames: Renames) -> str:
    """`name` after every substitution of `renames`, in order."""
    for pattern, replacement in renames:
        name = pattern.sub(replacement, name)
    return name


def namespace_stripper(
    layout: str, entries: Sequence[TensorEntry], explicit: str | None = None
) -> Callable[[str], str]:
    """How to remove the state-dict namespace from the names of `entries` (one component of one checkpoint).

    Args:
        layout: the checkpoint's layout name.
        entries: the tensors whose names are being normalised (one component's).
        explicit: a prefix to remove instead of detecting one; `""` keeps names as stored.
    """
    if explicit is not None:
        return lambda name: name.removeprefix(explicit)
    if not entries:
        return keep_name
    return convert_source(layout).namespace_stripper(entries)


def normalise_name(name: str, strip: Callable[[str], str], renames: Renames = ()) -> str:
    """One name with its namespace removed (`strip`, from `namespace_stripper`) and `renames` applied."""
    return apply_renames(strip(name), renames)


def normalised_names(
    layout: str,
    entries: Sequence[TensorEntry],
    strip_prefix: str | None = None,
    renames: Renames = (),
    *,
    verb: str = "named",
    mapped: Mapping[str, str] | None = None,
) -> dict[str, TensorEntry]:
    """The tensors of one component keyed by their normalised names, in stored order.

    Args:
        layout: the checkpoint's layout name.
        entries: the tensors of one component.
        strip_prefix: a prefix to remove instead of detecting the namespace; `""` keeps names as stored.
        renames: substitutions applied after the namespace is removed.
        verb: what happens to a tensor under its new name, for the collision error (`named`, `written as`).
        mapped: names (namespace removed) -> the names a framework's name map gives them, before `renames`.

    Raises:
        CkptctlError: two tensors get the same name, or a name becomes empty.
    """
    strip = namespace_stripper(layout, entries, strip_prefix)
    named: dict[str, TensorEntry] = {}
    for entry in entries:
        name = strip(entry.name)
        name = apply_renames(mapped.get(name, name) if mapped else name, renames)
        if not name:
            raise CkptctlError(f"{entry.name!r} has no name left after prefix removal and renaming")
        other = named.get(name)
        if other is not None:
            raise CkptctlError(
                f"{other.name!r} and {entry.name!r} would both be {verb} {name!r}", "adjust --strip-prefix or --rename"
            )
        named[name] = entry
    return named
