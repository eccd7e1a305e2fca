"""A Megatron GPT model of the Llama/Qwen family under Hugging Face transformers names (`convert --to hf`).

The dist-ckpt tensors are full (tensor-parallel parts are chunks of them) and a block's layers are stacked on a
leading axis. Each transformers tensor is a part of one of them, taken by index entries whose RAW chunks point
at the stored bytes (`formats.raw_chunks.row_slice`): the converter copies bytes, nothing is decoded twice.

| megatron-core (per layer `decoder.layers.{i}.`)           | transformers (`model.layers.{i}.`)                  |
|-----------------------------------------------------------|-----------------------------------------------------|
| `embedding.word_embeddings.weight`                        | `model.embed_tokens.weight`                         |
| `self_attention.linear_qkv.layer_norm_weight` (TE spec),  | `input_layernorm.weight`                            |
| `input_layernorm.weight` (local spec)                     |                                                     |
| `self_attention.linear_qkv.{weight,bias}`                 | `self_attn.{q,k,v}_proj.{weight,bias}`: per query   |
|                                                           | group its heads' query rows, then key, then value   |
| `self_attention.{q,k}_layernorm.weight` (Qwen3)           | `self_attn.{q,k}_norm.weight`                       |
| `self_attention.linear_proj.weight`                       | `self_attn.o_proj.weight`                           |
| `mlp.linear_fc1.layer_norm_weight`, `pre_mlp_layernorm.weight` | `post_attention_layernorm.weight`              |
| `mlp.linear_fc1.weight` (SwiGLU: gate rows, then up rows) | `mlp.gate_proj.weight`, `mlp.up_proj.weight`        |
| `mlp.linear_fc2.weight`                                   | `mlp.down_proj.weight`                              |
| `decoder.final_layernorm.weight`                          | `model.norm.weight`                                 |
| `output_layer.weight` (absent when embeddings are tied)   | `lm_head.weight`                                    |

Sources: Megatron-Bridge @ 067f987d `src/megatron/bridge/models/llama/llama_bridge.py` (`mapping_registry`,
`megatron_to_hf_config`), `models/qwen/qwen2_bridge.py`, `qwen3_bridge.py`, and
`models/conversion/param_mapping.py` (`split_qkv_weights`: "[q1...qn, k1, v1, q1...qn, k2, v2, ...]";
`GatedMLPMapping`: "[G; U]"); Megatron-LM @ d98e8a64 `tools/checkpoint/schema_hf.py` (`HFLMSchema`). In the
dist-ckpt, `linear_fc1` of a SwiGLU model is stored as all gate rows then all up rows whatever the tensor
parallelism (megatron-core's `apply_swiglu_sharded_factory` saves each rank's gate and up halves at their
places in the full gate and up matrices).

The model's shape comes from the Megatron-LM arguments in `common.pt`, else from the transformers config the
user gives (`--config`); the config written beside the weights is made from the arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptctl.checkpoint import Checkpoint, Component, TensorEntry
from ckptctl.contract.capabilities import HfModel
from ckptctl.errors import CkptctlError
from ckptctl.frameworks.megatron.files import COMMON
from ckptctl.frameworks.megatron.names import LAYERS, PER_LAYER, Part, Rows, cut, saved_args

__all__ = ["GptShape", "hf_config", "hf_model", "shape_from_args", "shape_from_config"]


#: Per-layer megatron-core names with one transformers counterpart taken whole.
_WHOLE = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_QKV = "self_attention.linear_qkv."
_FC1 = "mlp.linear_fc1.weight"
#: transformers' order of a layer's tensors (the order `save_pretrained` writes them in).
_LAYER_ORDER = (
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


@dataclass(frozen=True, slots=True)
class GptShape:
    """What splitting the fused tensors needs to know of the model.

    Attributes:
        layers: transformer layers.
        hidden: hidden size.
        heads: attention (query) heads.
        groups: query groups (key/value heads).
        head_dim: channels per head (`kv_channels`).
        ffn: MLP hidden size (of the gate and of the up projection each).
        tied: the output layer shares the input embeddings.
        gated: the MLP is gated (SwiGLU): `linear_fc1` holds the gate and the up projections.
    """

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    tied: bool
    gated: bool

    def qkv_rows(self) -> tuple[Rows, Rows, Rows]:
        """The rows of the fused QKV tensor holding the query, key and value projections, in their order:
        each query group holds its heads' query rows, then its key head, then its value head."""
        per_group = self.heads // self.groups
        block = (per_group + 2) * self.head_dim
        q = tuple((g * block, g * block + per_group * self.head_dim) for g in range(self.groups))
        k = tuple((end, end + self.head_dim) for _, end in q)
        v = tuple((end, end + self.head_dim) for _, end in k)
        return q, k, v


def _int(mapping: Mapping[str, Any], key: str) -> int | None:
    value = mapping.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def shape_from_args(args: Mapping[str, Any]) -> GptShape | None:
    """The shape Megatron-LM's arguments describe (None when they lack a size)."""
    layers, hidden, heads = _int(args, "num_layers"), _int(args, "hidden_size"), _int(args, "num_attention_heads")
    ffn = _int(args, "ffn_hidden_size")
    if layers is None or hidden is None or heads is None or ffn is None:
        return None
    groups = _int(args, "num_query_groups") if args.get("group_query_attention") else heads
    return GptShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        groups=groups or heads,
        head_dim=_int(args, "kv_channels") or hidden // heads,
        ffn=ffn,
        tied=not args.get("untie_embeddings_and_output_weights", False),
        gated=bool(args.get("swiglu", False)),
    )


def shape_from_config(config: Mapping[str, Any]) -> GptShape | None:
    """The shape a transformers `config.json` of the Llama/Qwen family describes (None when it lacks a size)."""
    layers, hidden = _int(config, "num_hidden_layers"), _int(config, "hidden_size")
    heads, ffn = _int(config, "num_attention_heads"), _int(config, "intermediate_size")
    if layers is None or hidden is None or heads is None or ffn is None:
        return None
    return GptShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        groups=_int(config, "num_key_value_heads") or heads,
        head_dim=_int(config, "head_dim") or hidden // heads,
        ffn=ffn,
        tied=bool(config.get("tie_word_embeddings", False)),
        gated=config.get("hidden_act", "silu") == "silu",
    )


def hf_config(args: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """The transformers `config.json` of the model Megatron-LM's arguments describe (as Megatron-Bridge's
    bridges write it): Qwen3 with per-head query/key norms, Qwen2 with QKV biases, else Llama.

    Raises:
        CkptctlError: the arguments describe a model outside the family (no RoPE, no RMSNorm, no SwiGLU,
            linear biases, experts).
    """
    unsupported = [
        why
        for why, ok in (
            ("its position embeddings are not RoPE", args.get("position_embedding_type", "rope") == "rope"),
            ("its norms are not RMSNorm", args.get("normalization", "RMSNorm") == "RMSNorm"),
            ("its MLP is not SwiGLU", bool(args.get("swiglu", False))),
            ("its linear layers have biases", not args.get("add_bias_linear", False)),
            ("it has experts (MoE)", not args.get("num_experts")),
        )
        if not ok
    ]
    shape = shape_from_args(args)
    if unsupported or shape is None:
        raise CkptctlError(
            f"ckptctl converts Megatron GPT models of the Llama/Qwen family, and this one's {COMMON} says "
            + ("; ".join(unsupported) if unsupported else "nothing of its size"),
            "convert with Megatron-Bridge (AutoBridge.export_ckpt) instead",
        )
    if args.get("qk_layernorm"):
        architecture, model_type = "Qwen3ForCausalLM", "qwen3"
    elif args.get("add_qkv_bias"):
        architecture, model_type = "Qwen2ForCausalLM", "qwen2"
    else:
        architecture, model_type = "LlamaForCausalLM", "llama"
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": _int(args, "padded_vocab_size") or _int(args, "vocab_size"),
        "hidden_size": shape.hidden,
        "intermediate_size": shape.ffn,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.groups,
        "head_dim": shape.head_dim,
        "max_position_embeddings": _int(args, "max_position_embeddings") or _int(args, "seq_length"),
        "rms_norm_eps": args.get("norm_epsilon", 1e-5),
        "rope_theta": float(args.get("rotary_base", 10000)),
        "tie_word_embeddings": shape.tied,
        "hidden_act": "silu",
        "torch_dtype": dtype,
    }
    if model_type == "llama":
        config["attention_bias"] = False
        config["mlp_bias"] = False
    if args.get("use_rope_scaling"):
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(args.get("rope_scaling_factor", 8.0)),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    return config


def hf_model(checkpoint: Checkpoint, config: Mapping[str, Any] | None) -> HfModel:
    """The checkpoint's model under transformers names, and the config its arguments describe (see the module).

    Args:
        checkpoint: a Megatron dist-ckpt checkpoint.
        config: the transformers config the user gave, for the shape when `common.pt` records no arguments.

    Raises:
        CkptctlError: no shape known, shapes that disagree, a tensor without a transformers counterpart, or
            bytes that cannot be sliced (chunks stored non-contiguously, or on an object store).
    """
    args = saved_args(checkpoint)
    model = {e.name: e for e in checkpoint.tensors(Component.MODEL)}
    notes: list[str] = []
    generated = None
    if args is not None:
        generated = hf_config(args, next(iter(model.values())).dtype if model else "float32")
        notes.append(f"config.json made from the Megatron-LM arguments in {COMMON} ({generated['architectures'][0]})")
    shape = _shape(checkpoint.url, args, config)
    entries = list(cut(checkpoint.url, _parts(model, shape, notes)))
    return HfModel(tuple(entries), generated, tuple(notes))


def _shape(url: str, args: Mapping[str, Any] | None, config: Mapping[str, Any] | None) -> GptShape:
    """The model's shape from the arguments, else from the given config; both must agree when both say."""
    recorded = shape_from_args(args) if args is not None else None
    given = shape_from_config(config) if config is not None else None
    if recorded is not None and given is not None and recorded != given:
        raise CkptctlError(
            f"the --config model ({given}) is not the one {COMMON} describes ({recorded})",
            "pass the config of this model, or leave --config out",
        )
    shape = recorded or given
    if shape is None:
        raise CkptctlError(
            f"{url}: {COMMON} records no model arguments, so the fused QKV and MLP tensors cannot be split",
            "pass --config DIR with the model's transformers config.json (verl keeps it in model/huggingface/ "
            "beside model/dist_ckpt/)",
        )
    return shape


def _parts(model: Mapping[str, TensorEntry], shape: GptShape, notes: list[str]) -> list[Part]:
    layers: dict[int, dict[str, Part]] = {}
    top: dict[str, Part] = {}
    unmapped = []
    for name, entry in model.items():
        if name in _TOP:
            if name == "output_layer.weight" and shape.tied:
                notes.append("output_layer.weight left out: the embeddings are tied (transformers ties lm_head)")
                continue
            top[_TOP[name]] = Part(_TOP[name], entry, None, None)
            continue
        per_layer = PER_LAYER.match(name)
        found: list[tuple[int, str, int | None]]
        if per_layer is not None:
            found = [(int(per_layer.group(1)), per_layer.group(2), None)]
        elif name.startswith(LAYERS):
            if len(entry.shape) < 1 or entry.shape[0] != shape.layers:
                raise CkptctlError(f"{name} stacks {entry.shape[:1]} layers, but the model has {shape.layers}")
            found = [(i, name[len(LAYERS) :], i) for i in range(shape.layers)]
        else:
            unmapped.append(name)
            continue
        for layer, suffix, index in found:
            mapped = _layer_parts(layer, suffix, entry, index, shape)
            if mapped is None:
                unmapped.append(name)
                break
            layers.setdefault(layer, {}).update((p.name.split(".", 3)[3], p) for p in mapped)
    if unmapped:
        shown = ", ".join(unmapped[:4]) + (", ..." if len(unmapped) > 4 else "")
        raise CkptctlError(
            f"{len(unmapped)} tensor(s) have no transformers counterpart in the Llama/Qwen family: {shown}",
            "convert with Megatron-Bridge (AutoBridge.export_ckpt), or pass --to dcp to keep Megatron's names",
        )
    missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in top]
    if not shape.tied and "lm_head.weight" not in top:
        missing.append("lm_head.weight (output_layer.weight)")
    if missing or sorted(layers) != list(range(shape.layers)):
        raise CkptctlError(f"the checkpoint lacks {', '.join(missing) or 'some layers'} of the model it describes")
    ordered = [top["model.embed_tokens.weight"]]
    for layer in range(shape.layers):
        ordered += [layers[layer][key] for key in _LAYER_ORDER if key in layers[layer]]
    ordered.append(top["model.norm.weight"])
    if "lm_head.weight" in top:
        ordered.append(top["lm_head.weight"])
    return ordered


def _layer_parts(layer: int, suffix: str, entry: TensorEntry, index: int | None, shape: GptShape) -> list[Part] | None:
    """The transformers tensors one layer's megatron tensor makes (None: it has no counterpart)."""
    prefix = f"model.layers.{layer}."
    rows_dim = 1 if index is not None else 0
    if suffix in _WHOLE:
        return [Part(prefix + _WHOLE[suffix], entry, index, None)]
    if suffix in (_QKV + "weight", _QKV + "bias"):
        kind = suffix.rpartition(".")[2]
        q, k, v = shape.qkv_rows()
        expected = v[-1][1]
        if len(entry.shape) <= rows_dim or entry.shape[rows_dim] != expected:
            raise CkptctlError(f"{entry.name} has {entry.shape} but {shape} makes {expected} fused QKV rows")
        return [
            Part(f"{prefix}self_attn.{proj}_proj.{kind}", entry, index, rows)
            for proj, rows in (("q", q), ("k", k), ("v", v))
        ]
    if suffix == _FC1:
        if not shape.gated:
            return None
        if len(entry.shape) <= rows_dim or entry.shape[rows_dim] != 2 * shape.ffn:
            raise CkptctlError(
                f"{entry.name} has {entry.shape} but a SwiGLU MLP of {shape.ffn} makes {2 * shape.ffn} rows"
            )
        return [
            Part(prefix + "mlp.gate_proj.weight", entry, index, ((0, shape.ffn),)),
            Part(prefix + "mlp.up_proj.weight", entry, index, ((shape.ffn, 2 * shape.ffn),)),
        ]
    return None
