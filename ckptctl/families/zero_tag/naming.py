"""Tensor names of a DeepSpeed module as the model knows them.

DeepSpeed modules carry the prefixes of the wrappers the model was trained in: `module.` (DDP),
`_orig_mod.` (torch.compile), ..., and OpenRLHF's `Actor`, which holds the HF model as `self.model`
(every name then starts `model.`, and some `model.model.` or `model.lm_head.`): those are removed. Every
layout whose model lies in DeepSpeed rank files gets `wrapper_stripper` by default
(`ckptctl.layouts.format_rules.FORMAT_NAME_RULES`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptctl.checkpoint import TensorEntry
from ckptctl.contract.naming import NameStripper
from ckptctl.families.zero_tag.names import is_rank_file

__all__ = ["WRAPPER_PREFIXES", "wrapper_prefix", "wrapper_stripper"]

#: Prefixes training wrappers add to every parameter name.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_forward_module.", "_fsdp_wrapped_module.")


def wrapper_stripper(entries: Sequence[TensorEntry]) -> NameStripper | None:
    """How to remove the training wrappers' prefix from the names of `entries` (one component's tensors),
    or None when they do not all lie in DeepSpeed rank files or carry no such prefix."""
    chunks = [chunk for e in entries for chunk in e.chunks]
    if not chunks or not all(is_rank_file(chunk.file) for chunk in chunks):
        return None
    prefix = wrapper_prefix([e.name for e in entries])
    if not prefix:
        return None
    return lambda name: name.removeprefix(prefix)


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
