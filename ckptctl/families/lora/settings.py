"""A LoRA adapter's settings: `adapter_config.json` as PEFT 0.21 writes it, or verl's `lora_train_meta.json`.

What a merge needs per adapted module is its rank `r` and its scaling, as PEFT's `LoraLayer.update_layer`
sets them (peft 0.21.2 `tuners/lora/layer.py`): `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA,
where `r` and `lora_alpha` of a module are `rank_pattern` / `alpha_pattern` entries when one of their keys
matches the module's name (`tuners/lora/model.py` `_create_and_replace`, with `utils/other.py`
`get_pattern_key`: the first key `k` for which `(.*\\.)?(k)$` matches the whole name), else `r` and
`lora_alpha`.

verl writes no `adapter_config.json` into its checkpoints but `lora_train_meta.json` =
`{"r", "lora_alpha", "task_type"}` beside the shards; it is read as the same settings without patterns.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.documents import as_real, whole_number

__all__ = ["ADAPTER_CONFIG", "LORA_TRAIN_META", "LoraSettings", "parse_settings"]

ADAPTER_CONFIG = "adapter_config.json"
LORA_TRAIN_META = "lora_train_meta.json"
#: A rank above this is no LoRA rank (the largest models have hidden sizes of a few tens of thousands).
_MAX_RANK = 1 << 20
#: Longer pattern keys are refused: real ones are module names or short regexes.
_MAX_PATTERN = 512
#: LoraConfig fields whose (non-default) value makes the adapter more than `W + s·B@A` per module, with what
#: they are for people: a merge refuses them rather than writing a model PEFT would not.
_NOT_MERGED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a LoRA bias (lora_bias)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "layer_replication": "layer replication (layer_replication)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "arrow_config": "Arrow routing (arrow_config)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "kasa_config": "KaSA (kasa_config)",
}
#: Fields shown by `inspect`, in this order.
_SHOWN = (
    "peft_type",
    "base_model_name_or_path",
    "r",
    "rank_pattern",
    "lora_alpha",
    "alpha_pattern",
    "use_rslora",
    "use_dora",
    "target_modules",
    "modules_to_save",
    "fan_in_fan_out",
    "task_type",
    "peft_version",
)


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """What a LoRA merge needs from an adapter's settings file.

    Attributes:
        source: the file they come from, for messages.
        peft_type: `LORA` (PEFT also writes `LOHA`, `IA3`, `ADALORA`, prompt-learning types, ...).
        r: the default rank.
        lora_alpha: the default alpha (int or float, as written: PEFT divides it as such).
        rank_pattern: module-name pattern -> rank.
        alpha_pattern: module-name pattern -> alpha.
        use_rslora: scaling alpha/sqrt(r) instead of alpha/r.
        fan_in_fan_out: the base layers store their weights as (in, out) (GPT-2's Conv1D).
        not_merged: the features set that a merge does not reproduce (DoRA, ...), for people.
        shown: the fields worth showing in `inspect`, as written.
    """

    source: str
    peft_type: str
    r: int
    lora_alpha: int | float
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, int | float] = field(default_factory=dict)
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    not_merged: tuple[str, ...] = ()
    shown: Mapping[str, Any] = field(default_factory=dict)

    def rank(self, module: str) -> int:
        """The rank PEFT gives the module named `module` (its name inside the base model)."""
        key = _pattern_key(tuple(self.rank_pattern), module)
        return self.rank_pattern[key] if key is not None else self.r

    def alpha(self, module: str) -> int | float:
        """The alpha PEFT gives the module named `module`."""
        key = _pattern_key(tuple(self.alpha_pattern), module)
        return self.alpha_pattern[key] if key is not None else self.lora_alpha

    def scaling(self, module: str) -> float:
        """What PEFT multiplies the module's `B @ A` by: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        r = self.rank(module)
        return self.alpha(module) / (math.sqrt(r) if self.use_rslora else r)

    def warnings(self) -> list[str]:
        """What a person should know before using the adapter (an alpha of 0 makes it do nothing)."""
        found = []
        if self.lora_alpha == 0 and not self.alpha_pattern:
            found.append(
                f"{self.source}: lora_alpha is 0, so every module's scaling is 0 and the adapter has no effect "
                "(PEFT applies W + 0·B@A): merged or loaded, the model is the base model"
            )
        elif zero := sorted(k for k, v in self.alpha_pattern.items() if v == 0):
            found.append(f"{self.source}: alpha_pattern gives {', '.join(zero[:5])} an alpha of 0: no effect there")
        return found

    def check_mergeable(self) -> None:
        """Raises CkptctlError when merging `W + s·B@A` into the base would not give the model PEFT gives."""
        if self.peft_type != "LORA":
            raise CkptctlError(
                f"{self.source}: peft_type is {self.peft_type}; ckptctl merges LoRA adapters only",
                "merge it with PEFT: PeftModel.from_pretrained(base, ADAPTER).merge_and_unload().save_pretrained(OUT)",
            )
        if self.not_merged:
            raise CkptctlError(
                f"{self.source}: the adapter uses {', '.join(self.not_merged)}, which ckptctl does not merge "
                "(the merged weights would not be what PEFT computes)",
                "merge it with PEFT: PeftModel.from_pretrained(base, ADAPTER).merge_and_unload().save_pretrained(OUT)",
            )


def parse_settings(doc: Any, source: str) -> LoraSettings:
    """The settings of a parsed `adapter_config.json` or `lora_train_meta.json` (`source` names which).

    Raises:
        CorruptCheckpoint: not an object, or a rank, alpha or pattern that is not what PEFT writes.
    """
    if not isinstance(doc, dict):
        raise CorruptCheckpoint(f"{source}: not a JSON object")
    peft_type = doc.get("peft_type", "LORA" if source.endswith(LORA_TRAIN_META) else None)
    if not isinstance(peft_type, str):
        raise CorruptCheckpoint(f"{source}: no peft_type (PEFT writes one into every adapter_config.json)")
    shown = {key: doc[key] for key in _SHOWN if doc.get(key) not in (None, {}, [])}
    if peft_type != "LORA":
        return LoraSettings(source, peft_type, 1, 0, shown=shown)
    r = whole_number(doc.get("r", 8), source, "r", minimum=1, maximum=_MAX_RANK)
    alpha = _alpha(doc.get("lora_alpha", 8), source, "lora_alpha")
    rank_pattern = {
        key: whole_number(value, source, f"rank_pattern[{key!r}]", minimum=1, maximum=_MAX_RANK)
        for key, value in _patterns(doc, "rank_pattern", source).items()
    }
    alpha_pattern = {
        key: _alpha(value, source, f"alpha_pattern[{key!r}]")
        for key, value in _patterns(doc, "alpha_pattern", source).items()
    }
    not_merged = tuple(what for key, what in _NOT_MERGED.items() if doc.get(key) not in (None, False, [], {}, ""))
    return LoraSettings(
        source=source,
        peft_type=peft_type,
        r=r,
        lora_alpha=alpha,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        use_rslora=doc.get("use_rslora") is True,
        fan_in_fan_out=doc.get("fan_in_fan_out") is True,
        not_merged=not_merged,
        shown=shown,
    )


def _alpha(value: Any, source: str, name: str) -> int | float:
    """An alpha as written (an int stays an int: PEFT divides it as such), checked to be a finite number."""
    if as_real(value) is None:
        raise CorruptCheckpoint(f"{source}: {name} must be a finite number, not {str(value)[:40]!r}")
    alpha: int | float = value
    return alpha


def _patterns(doc: Mapping[str, Any], name: str, source: str) -> dict[str, Any]:
    found = doc.get(name) or {}
    if not isinstance(found, dict):
        raise CorruptCheckpoint(f"{source}: {name} must be an object of module pattern -> value")
    for key in found:
        if len(key) > _MAX_PATTERN:
            raise CorruptCheckpoint(f"{source}: a {name} key is longer than {_MAX_PATTERN} characters")
        try:
            _compiled(key)
        except re.error as exc:
            raise CorruptCheckpoint(f"{source}: {name} key {key[:80]!r} is not a regular expression ({exc})") from exc
    return found


@cache
def _compiled(key: str) -> re.Pattern[str]:
    return re.compile(rf"(.*\.)?({key})$")


def _pattern_key(keys: tuple[str, ...], name: str) -> str | None:
    """PEFT's `get_pattern_key`: the first key whose pattern matches `name` from its start, or None."""
    for key in keys:
        if _compiled(key).match(name):
            return key
    return None
