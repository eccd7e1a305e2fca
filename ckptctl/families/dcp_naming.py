"""Tensor names of a DCP save as the model knows them.

torch DCP state dicts carry the key they were saved under (`model.`, `optim.`, sometimes inside one
wrapper key, AReaL's `dcp.model.`): that namespace is removed when every tensor of the component carries
it. A raw `dcp.save(model.state_dict())` of a model whose keys merely happen to start with `model.` (a
`...ForCausalLM` also holds `lm_head.weight`) keeps its names. A tied-embedding HF model saved without
`lm_head.weight` has every key under `model.`, which is why this rule applies to DCP items only. Every
layout whose tensors are DCP items gets it by default (`ckptctl.layouts.format_rules.FORMAT_NAME_RULES`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptctl.checkpoint import ChunkEncoding, TensorEntry
from ckptctl.contract.naming import NameStripper, keep_name, shared_first_segment, strip_segments
from ckptctl.families.dcp_folder import component_for_prefix

__all__ = ["dcp_namespace_stripper"]


def dcp_namespace_stripper(entries: Sequence[TensorEntry]) -> NameStripper | None:
    """How to remove the state-dict namespace from the names of `entries` (one component's tensors), or
    None when they are not all DCP items."""
    if not all(chunk.encoding is ChunkEncoding.TORCH_SAVE for e in entries for chunk in e.chunks):
        return None
    first = shared_first_segment(entries)
    if first is None:
        return keep_name
    if component_for_prefix(first) is not None:
        return strip_segments(1)
    # One wrapper key around the namespace (AReaL's `dcp.model.*`): both go when all tensors share them.
    seconds = {e.name.split(".", 2)[1] for e in entries if e.name.count(".") >= 2}
    wrapped = len(seconds) == 1 and all(e.name.count(".") >= 2 for e in entries)
    if wrapped and component_for_prefix(next(iter(seconds))) is not None:
        return strip_segments(2)
    return keep_name
