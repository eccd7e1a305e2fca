"""A critic's or reward model's value head, and the transformers model that holds it.

RL frameworks train value models (PPO's critic) and reward models as a language model's body with a linear head
of one output on its hidden states in place of `lm_head`:

- AReaL (`areal/engine/fsdp_engine.py`, `FSDPEngine._create_llm_actor_or_critic`: `is_critic`) and verl
  (`verl/utils/model.py`, `load_valuehead_model`) build it as `AutoModelForTokenClassification` with
  `num_labels=1`: `score.weight` [1, H] and `score.bias` [1]. Both save the base causal LM's config beside it
  (`architectures: ["...ForCausalLM"]`: AReaL's `_save_model_to_hf` writes `model_config` over the model's, verl's
  checkpoint manager saves the config the critic was loaded with), so transformers would load a causal LM with a
  random `lm_head`.
- OpenRLHF (`openrlhf/models/model.py`, `get_llm_for_sequence_regression`) builds its own `CriticModel` or
  `RewardModel`: the base model under its `base_model_prefix` and `{value_head_prefix}.weight` [1, H] without a
  bias (`value_head_prefix`: `score` by default, `value_head` in older releases), saved with `architectures:
  ["CriticModel"]` or `["RewardModel"]`.

`find_value_head` tells such a model from its tensors and config, and gives the config of the transformers class
that computes the same values from the same tensors: `{Base}ForTokenClassification` (one value per token: a
critic) or `{Base}ForSequenceClassification` (one value per sequence, at its last token: a reward model), with
`num_labels=1`, the head named `score` as transformers names it (and `token_classification_bias: false` for a
head without a bias).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptctl.contract.capabilities import HeadTask

__all__ = ["HeadTask", "ValueHead", "find_value_head"]


#: The names frameworks give the head (OpenRLHF's `value_head_prefix`: `score`, formerly `value_head`).
_HEAD_PREFIXES = ("score", "value_head")
#: The name transformers' classification models give it.
_HF_HEAD = "score"
#: A transformers class name: its model family and its task.
_CLASS = re.compile(r"^(\w+?)For(CausalLM|TokenClassification|SequenceClassification)$")
#: Classes frameworks save under names of their own, and what they compute.
_OWN_CLASSES = {"CriticModel": HeadTask.TOKEN, "RewardModel": HeadTask.SEQUENCE}


@dataclass(frozen=True, slots=True)
class ValueHead:
    """A value head found in a model, and how the converted model holds it.

    Attributes:
        task: what the converted model computes.
        architecture: the transformers class the output's config names (`Qwen2ForTokenClassification`).
        names: stored name -> transformers name, for the head's tensors (`value_head.weight` -> `score.weight`).
        config: the output's config.json: the source's, naming `architecture` with one label.
        changed: whether `config` differs from the source's config.
    """

    task: HeadTask
    architecture: str
    names: Mapping[str, str]
    config: Mapping[str, Any]
    changed: bool


def find_value_head(
    tensors: Mapping[str, tuple[int, ...]],
    config: Mapping[str, Any] | None,
    default: HeadTask | None,
    notes: list[str],
) -> ValueHead | None:
    """The value head of a model, or None when it has none (or its model cannot be told; then with a note).

    Args:
        tensors: the model's tensors (name -> shape) as the output names them.
        config: the config.json the output gets.
        default: what the framework's own code builds from a value head when the config names no task (its
            base causal LM's class, as AReaL and verl save it); None: the task is taken from the head (a bias
            is transformers' token classification head), else left undecided.
        notes: where to append what the user should know.
    """
    if "lm_head.weight" in tensors or config is None:
        return None
    prefix = next((p for p in _HEAD_PREFIXES if _is_head(tensors.get(f"{p}.weight"), config)), None)
    if prefix is None:
        return None
    has_bias = tensors.get(f"{prefix}.bias") == (1,)
    architectures = config.get("architectures")
    named = architectures[0] if isinstance(architectures, list) and architectures else None
    named = named if isinstance(named, str) else None
    match = _CLASS.match(named) if named is not None else None
    task = _OWN_CLASSES.get(named or "")
    if task is None and match is not None and match.group(2) != "CausalLM":
        task = HeadTask(f"For{match.group(2)}")
    task = task or default or (HeadTask.TOKEN if has_bias else None)
    if task is None:
        notes.append(
            f"the model has a value head ({prefix}.weight) and config.json names {named or 'no class'}: pass a config "
            "naming its ...ForTokenClassification (a critic) or ...ForSequenceClassification (a reward model) with "
            "--config"
        )
        return None
    architecture = f"{match.group(1)}{task.value}" if match is not None else _class_of(config, task)
    if architecture is None:
        notes.append(
            f"the model has a value head ({prefix}.weight), and transformers names no {task.value} class for "
            f"model_type {config.get('model_type')!r}: config.json was left as it is"
        )
        return None
    made = dict(config)
    made["architectures"] = [architecture]
    made["id2label"] = {"0": "LABEL_0"}
    made["label2id"] = {"LABEL_0": 0}
    made.pop("num_labels", None)
    if task is HeadTask.TOKEN and not has_bias:
        made["token_classification_bias"] = False
    if "value_head_prefix" in made:  # OpenRLHF's loader takes the head's name from the config
        made["value_head_prefix"] = _HF_HEAD
    if config.get("normalize_reward") is True:
        notes.append(
            "OpenRLHF normalizes this model's values ((value - mean) / std, from config.json); transformers' "
            f"{architecture} returns them as the head computes them"
        )
    names = {f"{prefix}.{part}": f"{_HF_HEAD}.{part}" for part in ("weight", "bias") if f"{prefix}.{part}" in tensors}
    return ValueHead(task, architecture, names, made, made != dict(config))


def _is_head(shape: tuple[int, ...] | None, config: Mapping[str, Any]) -> bool:
    """A [1, hidden_size] weight (the hidden size from the config, or its text config's)."""
    if shape is None or len(shape) != 2 or shape[0] != 1:
        return False
    text = config.get("text_config")
    hidden = config.get("hidden_size", text.get("hidden_size") if isinstance(text, dict) else None)
    return hidden is None or shape[1] == hidden


def _class_of(config: Mapping[str, Any], task: HeadTask) -> str | None:
    """transformers' class of `task` for the config's `model_type` (a config naming a framework's own class)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return None
    names = (
        modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES
        if task is HeadTask.TOKEN
        else modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    )
    found = names.get(model_type)
    return found if isinstance(found, str) else None
