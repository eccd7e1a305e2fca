"""The model a `config.json` describes, as transformers builds it: its tensors without memory, and its logits.

`model_spec` instantiates the class `architectures[0]` names on the meta device (no memory, no weights,
no code from the checkpoint: only transformers' own classes, never `trust_remote_code`) and reads off
what transformers' own code would save and load:

- `saved`: what `save_pretrained` writes, computed by transformers' own steps on the meta state dict:
  `_keys_to_ignore_on_save` left out, tied copies removed (`remove_tied_weights_from_state_dict`), and
  the weight conversions of transformers 5 reverted (`revert_weight_conversion`: MoE experts fused in the
  model are saved one per expert).
- `state`: the model's `state_dict()` (persistent buffers only), what `dcp.load(model.state_dict())` fills.
- `tied`: each tied copy (`lm_head.weight` of a model with `tie_word_embeddings`) and the tensor it is.

`model_logits` runs a model on fixed token ids: the folder's model as `from_pretrained` loads it, or the
architecture its config names holding given tensors (loaded by `from_pretrained(state_dict=...)`, so that
transformers applies the same renaming, conversions and ties).

transformers is optional: without it (or before 5, which lacks these steps) there is no spec.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckptctl.contract.capabilities import ModelSpec
from ckptctl.errors import CkptctlError, ModelMismatch
from ckptctl.families.hf_model_class import build_on_meta, model_class, quiet

if TYPE_CHECKING:
    import torch

__all__ = ["TOKEN_IDS", "model_logits", "model_spec"]

#: The token ids logits are compared on: fixed, and inside any vocabulary of 17 tokens or more.
TOKEN_IDS = tuple(range(1, 17))


def model_spec(config: Mapping[str, Any], notes: list[str]) -> ModelSpec | None:
    """The tensors of the model `config` (a parsed config.json) describes, or None (with a note) when
    transformers is not importable or has no class for it.

    Raises:
        ModelMismatch: transformers refuses to build the model from this config (the output would not load).
    """
    found = model_class(config, notes)
    if found is None:
        return None
    name, cls = found
    import torch
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    try:
        with quiet(), torch.device("meta"), torch.no_grad():
            model = build_on_meta(cls, config)
            state = model.state_dict(keep_vars=True)
            kept = dict(state)
            for key in model._keys_to_ignore_on_save or ():
                kept.pop(key, None)
            untied = remove_tied_weights_from_state_dict(dict(kept), model)  # it deletes in place
            saved = revert_weight_conversion(model, dict(untied))
    # transformers reports a config it cannot use with ValueError, TypeError, KeyError, AttributeError, ...
    except Exception as exc:
        raise ModelMismatch(
            f"transformers cannot build {name} from config.json ({type(exc).__name__}: {_first_line(exc)})",
            "the output would not load with from_pretrained; fix the config (--config DIR), or pass "
            "--no-check-model to write it anyway",
        ) from exc
    tied = {alias: _same_tensor(state, alias, untied) for alias in state if alias in kept and alias not in untied}
    buffers = {buffer for buffer, _ in model.named_buffers()}
    # transformers ignores a leftover non-persistent buffer on load (an old `rotary_emb.inv_freq`, `position_ids`)
    transient = sorted({buffer.rpartition(".")[2] for buffer in buffers - set(state)})
    return ModelSpec(
        architecture=name,
        saved={key: tuple(value.shape) for key, value in saved.items()},
        state={key: tuple(value.shape) for key, value in state.items()},
        tied={alias: source for alias, source in tied.items() if source is not None},
        ignored_leftovers=(
            *sorted(model._keys_to_ignore_on_load_unexpected or ()),
            *(rf"(^|\.){re.escape(leaf)}$" for leaf in transient),
        ),
        ignored_missing=tuple(sorted(model._keys_to_ignore_on_load_missing or ())),
    )


def model_logits(folder: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
    """Logits on `TOKEN_IDS` of the model in `folder` as `from_pretrained` loads it, or, given `tensors`, of
    the architecture `config` names holding them (in their dtype).

    Raises:
        ModelMismatch: transformers reports missing, unexpected or mismatched tensors while loading.
        CkptctlError: transformers is not importable or has no class for the config.
    """
    notes: list[str] = []
    found = model_class(config, notes)
    if found is None:
        raise CkptctlError(f"cannot compare logits: {notes[0]}")
    name, cls = found
    import torch

    with quiet():
        if tensors is None:
            model, info = cls.from_pretrained(folder, output_loading_info=True)
        else:
            held: dict[torch.dtype, int] = {}
            for tensor in tensors.values():
                if tensor.is_floating_point():
                    held[tensor.dtype] = held.get(tensor.dtype, 0) + tensor.numel() * tensor.element_size()
            dtype = max(held, key=lambda d: held[d]) if held else torch.float32  # what most of the bytes are
            built = cls.config_class.from_dict(dict(config))
            model, info = cls.from_pretrained(
                None, config=built, state_dict=dict(tensors), dtype=dtype, output_loading_info=True
            )
    wrong = {key: sorted(info.get(key) or ()) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(wrong.values()):
        what = "the output" if tensors is None else "the source tensors"
        details = "; ".join(
            f"{key.replace('_', ' ')}: {', '.join(map(str, keys[:5]))}" for key, keys in wrong.items() if keys
        )
        raise ModelMismatch(f"transformers loads {what} into {name} with {details}")
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    ids = torch.tensor([[i for i in TOKEN_IDS if i < vocab] or [0]])
    with torch.no_grad():
        output = model.eval()(input_ids=ids)
    logits = getattr(output, "logits", None)
    if logits is None:
        raise CkptctlError(f"{name} returns no logits to compare")
    return logits.float()


def _same_tensor(state: Mapping[str, Any], alias: str, kept: Mapping[str, Any]) -> str | None:
    """The name `kept` holds the tied copy `alias` under (the same parameter object on the meta device)."""
    return next((name for name, value in kept.items() if value is state[alias]), None)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__
