"""torchtitan's model tensors as transformers names and lays them out (`convert --to hf`).

torchtitan's models are its own code: `tok_embeddings.weight`, `layers.0.attention.qkv_linear.wq.weight`,
`feed_forward.w1/w2/w3`, `attention_norm`, `ffn_norm`, `norm`, `lm_head` (`output` before torchtitan
moved to `lm_head`; `attention.wq` before the `qkv_linear` module). The maps here are those of torchtitan
0.3.0's own conversion, `torchtitan/models/llama3/state_dict_adapter.py` and
`torchtitan/models/qwen3/state_dict_adapter.py` (`StateDictAdapter.from_hf_map`, `to_hf`), reimplemented
on names only:

- Llama 3 computes rotary embeddings on interleaved pairs of each head's q/k rows (complex numbers),
  transformers on its two halves: `Llama3StateDictAdapter._permute` reorders the rows of `wq` and `wk`
  per head, `w.view(n_heads, head_dim // 2, 2, dim).transpose(1, 2)`. Here that is a row order, applied
  when the tensor is written.
- Qwen 3 computes them on halves (`CosSinRoPE`) like transformers: names only. Its MoE experts are grouped
  tensors that torchtitan splits per expert; they are not mapped (the model check names them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ckptctl.contract.capabilities import NO_NAME_MAP, NameMap
from ckptctl.errors import CkptctlError

__all__ = ["MAPPINGS", "hf_name_map", "rope_rows"]

#: torchtitan name -> transformers name, `{}` for the layer number (Llama3StateDictAdapter.from_hf_map).
_LLAMA3 = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention.qkv_linear.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.qkv_linear.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.qkv_linear.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "output.weight": "lm_head.weight",
}
#: Qwen3StateDictAdapter.from_hf_map (dense layers): Llama's names and the per-head q/k norms.
_QWEN3 = {
    **_LLAMA3,
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}
#: The q/k weights whose rows Llama 3's conversion reorders.
_ROPE_ROWS = frozenset(
    {
        "layers.{}.attention.qkv_linear.wq.weight",
        "layers.{}.attention.qkv_linear.wk.weight",
        "layers.{}.attention.wq.weight",
        "layers.{}.attention.wk.weight",
    }
)

#: `--mapping` values: map name -> (names, whether q/k rows are reordered).
MAPPINGS: Mapping[str, tuple[Mapping[str, str], bool]] = {"llama3": (_LLAMA3, True), "qwen3": (_QWEN3, False)}
#: config.json `model_type` -> the map its torchtitan model takes.
_BY_MODEL_TYPE = {"llama": "llama3", "qwen3": "qwen3"}
_LAYER = re.compile(r"^layers\.(\d+)\.")


def rope_rows(rows: int, head_dim: int) -> tuple[int, ...]:
    """The order transformers holds the q or k rows of `rows // head_dim` heads in, as source rows:
    torchtitan keeps each head's rotary pairs interleaved (row 2i, 2i+1), transformers its first and
    second halves (`Llama3StateDictAdapter._permute`: output row (h, j, i) is source row (h, i, j))."""
    half = head_dim // 2
    return tuple(h * head_dim + 2 * i + j for h in range(rows // head_dim) for j in range(2) for i in range(half))


def _abstract(name: str) -> tuple[str, str | None]:
    match = _LAYER.match(name)
    if match is None:
        return name, None
    return "layers.{}." + name[match.end() :], match.group(1)


def looks_like_torchtitan(names: Sequence[str]) -> bool:
    """Whether these model names are torchtitan's own (its embedding and layer names)."""
    return "tok_embeddings.weight" in names or any(
        _abstract(n)[0] in _LLAMA3 and n.startswith("layers.") for n in names
    )


def hf_name_map(
    shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any] | None, requested: str | None
) -> NameMap | None:
    """The map of torchtitan's model tensors (name -> shape) to transformers', chosen by `requested` or
    else by the config's `model_type`.

    Raises:
        CkptctlError: an unknown map, a config of another model type, or a Llama map without a config to
            take the head size from.
    """
    if requested == NO_NAME_MAP:
        return None
    if requested is not None and requested not in MAPPINGS:
        raise CkptctlError(
            f"torchtitan has no tensor name map {requested!r}",
            f"choose one of {', '.join(MAPPINGS)} (or {NO_NAME_MAP} to keep torchtitan's names)",
        )
    names = list(shapes)
    mapping = requested or _chosen(names, config)
    if mapping is None:
        return None
    table, reorders = MAPPINGS[mapping]
    head_dim = _head_dim(config, mapping) if reorders else 0
    mapped: dict[str, str] = {}
    rows: dict[str, tuple[int, ...]] = {}
    for name in names:
        abstract, layer = _abstract(name)
        target = table.get(abstract)
        if target is None:
            continue
        hf_name = target.format(layer) if layer is not None else target
        mapped[name] = hf_name
        if reorders and abstract in _ROPE_ROWS:
            count = shapes[name][0] if shapes.get(name) else 0
            if count % head_dim:
                raise CkptctlError(
                    f"{name} has {count} rows, not a whole number of heads of {head_dim} (config.json's head size)",
                    "pass the config.json of this model with --config",
                )
            rows[hf_name] = rope_rows(count, head_dim)
    return NameMap(mapping, mapped, rows)


def _chosen(names: Sequence[str], config: Mapping[str, Any] | None) -> str | None:
    model_type = config.get("model_type") if config is not None else None
    if isinstance(model_type, str):
        found = _BY_MODEL_TYPE.get(model_type)
        if found is None:
            raise CkptctlError(
                f"config.json says model_type {model_type!r}, for which ckptctl knows no map of torchtitan's names",
                f"choose one with --mapping ({', '.join(MAPPINGS)}), or --mapping {NO_NAME_MAP} to keep them",
            )
        return found
    if not looks_like_torchtitan(names):
        return None
    if any(_abstract(n)[0] in ("layers.{}.attention.q_norm.weight",) for n in names):
        return "qwen3"  # names alone tell Qwen 3 (per-head q/k norms), which needs no head size
    raise CkptctlError(
        "torchtitan's Llama q/k rows are reordered for transformers by head, and there is no config.json to take "
        "the head size from",
        f"pass the folder of the model's config.json with --config (or --mapping {NO_NAME_MAP} to keep "
        "torchtitan's names and row order)",
    )


def _head_dim(config: Mapping[str, Any] | None, mapping: str) -> int:
    if config is None:
        raise CkptctlError(
            f"the {mapping} map reorders q/k rows by head and needs the model's config.json for the head size",
            "pass its folder with --config",
        )
    head_dim = config.get("head_dim")
    heads = config.get("num_attention_heads")
    hidden = config.get("hidden_size")
    if type(head_dim) is not int:
        head_dim = hidden // heads if type(hidden) is int and type(heads) is int and heads > 0 else None
    if head_dim is None or head_dim <= 0 or head_dim % 2:
        raise CkptctlError(
            "config.json gives no even head size (head_dim, or hidden_size / num_attention_heads)",
            "pass the config.json of this model with --config",
        )
    return head_dim
