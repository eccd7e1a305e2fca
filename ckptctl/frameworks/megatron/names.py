"""The model's own tensor names and shapes: what megatron-core's `dist_checkpointing.load` hands to the model.

A `GPTModel`'s `sharded_state_dict()` (megatron-core 0.16.1) saves its layers under other keys than the model's
`state_dict()` names, and `dist_checkpointing.load` of that same sharded state dict gives the model back one
tensor per layer under its own names (which `model.load_state_dict` then takes):

- the layers are stacked: `TransformerBlock.sharded_state_dict` (`transformer/transformer_block.py`) replaces the
  prefix `decoder.layers.{i}.` by `decoder.layers.` and puts the global layer number on a new leading axis of
  `num_layers` (`sharded_pp_offset = [(0, global_layer_offset, num_layers)]`), unless the layers differ (MoE
  every few layers, heterogeneous blocks), when each keeps its prefix `decoder.layers.{global}.`;
- before that, `TransformerLayer.sharded_state_dict` (`transformer/transformer_layer.py`) applies its spec's
  `sharded_state_dict_keys_map` (`dist_checkpointing.utils.apply_prefix_mapping`): the local spec
  (`models/gpt/gpt_layer_specs.py` `get_gpt_layer_local_spec`, without multi-latent attention) saves
  `input_layernorm.*` as `self_attention.linear_qkv.layer_norm_*` and `pre_mlp_layernorm.*` as
  `mlp.linear_fc1.layer_norm_*`, the names Transformer Engine's fused layers have, so that either spec loads the
  other's saves. The Transformer Engine spec's own map names only modules of its op fuser, which Megatron-LM
  never builds: its keys are its names.

Which spec a run used is in Megatron-LM's arguments (NVIDIA/Megatron-LM `gpt_builders.py` `gpt_builder`:
`--spec` a custom one, else `--transformer-impl`, `transformer_engine` by default). A layer slice of a stacked
tensor is a byte range of each stored chunk (the layer axis is outermost), so the model's tensors stay a byte
copy of the stored ones (`formats.raw_chunks.row_slice`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptctl.checkpoint import Checkpoint, Component, TensorEntry
from ckptctl.contract.capabilities import NativeModel
from ckptctl.errors import CkptctlError
from ckptctl.formats.raw_chunks import ChunkLocator, row_slice
from ckptctl.frameworks.megatron.files import COMMON, read_common

__all__ = ["LAYERS", "PER_LAYER", "Part", "Rows", "cut", "native_model", "saved_args", "spec_keys"]

#: The stacked layers' key prefix (`TransformerBlock.sharded_state_dict`).
LAYERS = "decoder.layers."
#: A layer that kept its own prefix (the layers of the block differ).
PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
#: `get_gpt_layer_local_spec`'s `sharded_state_dict_keys_map`: the model's names (left) saved as (right).
LOCAL_SPEC_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}

Rows = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Part:
    """One tensor of the model: the rows (None: all) of one layer (None: the whole tensor) of a stored tensor."""

    name: str
    source: TensorEntry
    layer: int | None
    rows: Rows | None


def cut(url: str, parts: Iterable[Part]) -> Iterator[TensorEntry]:
    """Each part as an entry of its own: a slice's RAW chunks point at the stored bytes (`row_slice`).

    Raises:
        CkptctlError: a chunk is not one local byte range (a torch.save record on an object store).
    """
    with ChunkLocator(url) as locator:
        for part in parts:
            if part.layer is None and part.rows is None:  # whole: any stored form reads, also remote
                yield replace(part.source, name=part.name)
                continue
            prefix = () if part.layer is None else (part.layer,)
            try:
                yield row_slice(part.source, part.name, prefix, part.rows, locator)
            except ValueError as exc:
                raise CkptctlError(
                    f"{url}: cannot take {part.name} out of {part.source.name}: {exc}",
                    "convert from a local copy of the checkpoint",
                ) from exc


def saved_args(checkpoint: Checkpoint) -> Mapping[str, Any] | None:
    """Megatron-LM's arguments in `common.pt` (None: megatron-core alone saved no arguments)."""
    common = read_common(checkpoint.url) if COMMON in checkpoint.files else {}
    recorded = common.get("args")
    return recorded if isinstance(recorded, dict) else None


def spec_keys(args: Mapping[str, Any] | None, notes: list[str]) -> Mapping[str, str]:
    """The `sharded_state_dict_keys_map` of the layer spec the arguments build (`gpt_builder`), model name
    prefix -> saved key prefix; appends to `notes` where the spec is not known."""
    if args is None:
        notes.append(
            f"{COMMON} records no Megatron-LM arguments: layer names as megatron-core's Transformer Engine spec "
            "has them (Megatron-LM's default, and verl's, NeMo's); a model of the local spec names "
            "the norms input_layernorm and pre_mlp_layernorm: add --rename "
            "'self_attention\\.linear_qkv\\.layer_norm_=input_layernorm.' --rename "
            "'mlp\\.linear_fc1\\.layer_norm_=pre_mlp_layernorm.'"
        )
        return {}
    custom = args.get("spec")
    if custom:
        notes.append(f"the run built its layers from a custom spec ({custom}): its names are kept as saved")
        return {}
    if args.get("transformer_impl", "transformer_engine") != "local" or args.get("multi_latent_attention"):
        return {}
    return LOCAL_SPEC_KEYS


def _model_suffix(suffix: str, keys: Mapping[str, str]) -> str:
    """A layer's tensor name as the model has it, from its saved key (the inverse of `apply_prefix_mapping`)."""
    for model, saved in keys.items():
        if suffix.startswith(saved):
            return model + suffix[len(saved) :]
    return suffix


def native_model(checkpoint: Checkpoint) -> NativeModel:
    """The checkpoint's model as `dist_checkpointing.load` gives it to a `GPTModel` of the spec the run used
    (see the module): one tensor per layer under the model's `state_dict()` names, the tensor-parallel parts
    merged, in the model's order (embeddings, the layers in order, then the rest).

    Raises:
        CkptctlError: the stacked tensors disagree on the layer count (with each other or the arguments), or
            their bytes cannot be sliced (chunks stored non-contiguously, or on an object store).
    """
    notes: list[str] = []
    args = saved_args(checkpoint)
    keys = spec_keys(args, notes)
    model = list(checkpoint.tensors(Component.MODEL))
    recorded = args.get("num_layers") if args is not None else None
    stacked = {e.shape[0] for e in model if e.name.startswith(LAYERS) and not PER_LAYER.match(e.name) and e.shape}
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        stacked.add(recorded)
    if len(stacked) > 1:
        raise CkptctlError(
            f"{checkpoint.url}: the stacked layers disagree on their number ({sorted(stacked)})",
            "verify the checkpoint (ckptctl verify); --to dcp keeps megatron-core's keys as saved",
        )
    layers: dict[int, list[Part]] = {}
    before: list[Part] = []
    after: list[Part] = []
    for entry in model:
        per_layer = PER_LAYER.match(entry.name)
        if per_layer is not None:
            layer = int(per_layer.group(1))
            name = f"{LAYERS}{layer}.{_model_suffix(per_layer.group(2), keys)}"
            layers.setdefault(layer, []).append(Part(name, entry, None, None))
        elif entry.name.startswith(LAYERS) and entry.shape:
            suffix = _model_suffix(entry.name[len(LAYERS) :], keys)
            for layer in range(entry.shape[0]):
                layers.setdefault(layer, []).append(Part(f"{LAYERS}{layer}.{suffix}", entry, layer, None))
        else:
            (before if entry.name.startswith("embedding.") else after).append(Part(entry.name, entry, None, None))
    ordered = before + [p for layer in sorted(layers) for p in layers[layer]] + after
    return NativeModel(tuple(cut(checkpoint.url, ordered)), tuple(notes))
