"""Tensor names as a model knows them: the namespace a save adds is removed, then the user's renames apply.

`convert` (which writes the model's names into an HF folder) and `diff` (which matches the tensors of
two checkpoints, possibly of different layouts) share these rules, so that a DCP save and its HF export
name every tensor alike:

- native checkpoints name tensors `<entry>.<key>`, where `<entry>` is the key of the saved state
  (`model.layers.0.w` for `state["model"]`): the entry name is removed when every tensor of the
  component carries the same one;
- torch DCP state dicts carry the key they were saved under (`model.`, `optim.`, sometimes inside one
  wrapper key, AReaL's `dcp.model.`): that namespace is removed when every tensor of the component
  carries it. A raw `dcp.save(model.state_dict())` of a model whose keys merely happen to start with
  `model.` (a `...ForCausalLM` also holds `lm_head.weight`) keeps its names;
- DeepSpeed modules carry the prefixes of the wrappers the model was trained in: `module.` (DDP),
  `_orig_mod.` (torch.compile), ..., and OpenRLHF's `Actor`, which holds the HF model as `self.model`
  (every name then starts `model.`, and some `model.model.` or `model.lm_head.`): those are removed;
- everything else (HF folders, the Trainer's model files) already uses the model's own names. A
  tied-embedding HF model saved without `lm_head.weight` has every key under `model.`, which is why the
  DCP rule is never applied to them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

from ckptctl.checkpoint import ChunkEncoding, TensorEntry
from ckptctl.errors import CkptctlError

__all__ = [
    "Renames",
    "apply_renames",
    "compile_renames",
    "namespace_stripper",
    "normalise_name",
    "normalised_names",
    "parse_rename",
    "wrapper_prefix",
]

#: Compiled `(pattern, replacement)` substitutions, applied in order.
Renames = tuple[tuple[re.Pattern[str], str], ...]

#: Prefixes training wrappers add to every parameter name.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_forward_module.", "_fsdp_wrapped_module.")
_DEEPSPEED_FILE = re.compile(r"(?:^|/)(?:bf16_)?(?:zero_pp_rank_\d+_)?mp_rank_\d+_(?:model|optim)_states\.pt$")


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
        return _identity
    if layout == "native":
        first = _shared_first_segment(entries)
        return _identity if first is None else _strip_segments(1)
    chunks = [chunk for e in entries for chunk in e.chunks]
    if all(chunk.encoding is ChunkEncoding.TORCH_SAVE for chunk in chunks):
        return _dcp_stripper(entries)
    if chunks and all(_DEEPSPEED_FILE.search(chunk.file) for chunk in chunks):
        prefix = wrapper_prefix([e.name for e in entries])
        if prefix:
            return lambda name: name.removeprefix(prefix)
    return _identity


def wrapper_prefix(names: Sequence[str]) -> str:
    """The prefix every name carries because the model was wrapped for training (`module.`, `_orig_mod.`,
    ..., possibly nested), plus OpenRLHF's `Actor` wrapper `model.` when some names then start with
    `model.model.` or `model.lm_head.`; "" when there is none."""
    prefix = ""
    actor_seen = False
    while names:
        rest = [name[len(prefix) :] for name in names]
        wrapper = next((w for w in WRAPPER_PREFIXES if all(n.startswith(w) for n in rest)), None)
        if (
            wrapper is None
            and not actor_seen
            and all(n.startswith("model.") for n in rest)
            and any(n.startswith(("model.model.", "model.lm_head.")) for n in rest)
        ):
            wrapper, actor_seen = "model.", True
        if wrapper is None:
            break
        prefix += wrapper
    return prefix


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
) -> dict[str, TensorEntry]:
    """The tensors of one component keyed by their normalised names, in stored order.

    Args:
        layout: the checkpoint's layout name.
        entries: the tensors of one component.
        strip_prefix: a prefix to remove instead of detecting the namespace; `""` keeps names as stored.
        renames: substitutions applied after the namespace is removed.
        verb: what happens to a tensor under its new name, for the collision error (`named`, `written as`).

    Raises:
        CkptctlError: two tensors get the same name, or a name becomes empty.
    """
    strip = namespace_stripper(layout, entries, strip_prefix)
    named: dict[str, TensorEntry] = {}
    for entry in entries:
        name = normalise_name(entry.name, strip, renames)
        if not name:
            raise CkptctlError(f"{entry.name!r} has no name left after prefix removal and renaming")
        other = named.get(name)
        if other is not None:
            raise CkptctlError(
                f"{other.name!r} and {entry.name!r} would both be {verb} {name!r}", "adjust --strip-prefix or --rename"
            )
        named[name] = entry
    return named


def _identity(name: str) -> str:
    return name


def _strip_segments(count: int) -> Callable[[str], str]:
    def strip(name: str) -> str:
        parts = name.split(".", count)
        return parts[count] if len(parts) > count and parts[count] else name

    return strip


def _shared_first_segment(entries: Sequence[TensorEntry]) -> str | None:
    firsts = {e.name.partition(".")[0] for e in entries if "." in e.name}
    if len(firsts) != 1 or any("." not in e.name for e in entries):
        return None
    return next(iter(firsts))


def _dcp_stripper(entries: Sequence[TensorEntry]) -> Callable[[str], str]:
    from ckptctl.frameworks.dcp.layout import component_for_prefix

    first = _shared_first_segment(entries)
    if first is None:
        return _identity
    if component_for_prefix(first) is not None:
        return _strip_segments(1)
    # One wrapper key around the namespace (AReaL's `dcp.model.*`): both go when all tensors share them.
    seconds = {e.name.split(".", 2)[1] for e in entries if e.name.count(".") >= 2}
    wrapped = len(seconds) == 1 and all(e.name.count(".") >= 2 for e in entries)
    if wrapped and component_for_prefix(next(iter(seconds))) is not None:
        return _strip_segments(2)
    return _identity
