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

import contextlib
import importlib.util
import re
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ckptctl.errors import CkptctlError, ModelMismatch
from ckptctl.layouts.capabilities import ModelSpec

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
    found = _model_class(config, notes)
    if found is None:
        return None
    name, cls = found
    import torch
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    try:
        with _quiet(), torch.device("meta"), torch.no_grad():
            model = cls._from_config(cls.config_class.from_dict(dict(config)))
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
    found = _model_class(config, notes)
    if found is None:
        raise CkptctlError(f"cannot compare logits: {notes[0]}")
    name, cls = found
    import torch

    with _quiet():
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


def _model_class(config: Mapping[str, Any], notes: list[str]) -> tuple[str, Any] | None:
    """`(name, class)` of the transformers model `config["architectures"][0]` names, or None with a note."""
    architectures = config.get("architectures")
    if not (isinstance(architectures, list) and architectures and isinstance(architectures[0], str)):
        notes.append("config.json names no architecture: the tensors were not checked against a model")
        return None
    name = architectures[0]
    if not _has_transformers_5():
        notes.append(f"transformers 5 or later is not importable: the tensors were not checked against {name}")
        return None
    import transformers

    cls = getattr(transformers, name, None) if name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        notes.append(f"transformers has no model class {name} (custom code?): the tensors were not checked against it")
        return None
    return name, cls


def _has_transformers_5() -> bool:
    """Whether transformers 5 or later is importable (`model_spec` reverts its weight conversions, in
    `core_model_loading`, which 4.x has not)."""
    return importlib.util.find_spec("transformers") is not None and bool(
        importlib.util.find_spec("transformers.core_model_loading")
    )


def _same_tensor(state: Mapping[str, Any], alias: str, kept: Mapping[str, Any]) -> str | None:
    """The name `kept` holds the tied copy `alias` under (the same parameter object on the meta device)."""
    return next((name for name, value in kept.items() if value is state[alias]), None)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' warnings, log lines and progress bars off while it builds or loads, restored after."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__
