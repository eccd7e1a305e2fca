"""LoRA modules inside a PEFT-wrapped model's own state dict (see `ckptctl.contract.wrapped`).

peft 0.21.2 wraps each adapted layer in a `LoraLayer` whose state dict holds the original layer as
`base_layer`, the factors as `lora_A.<adapter>` / `lora_B.<adapter>` (`nn.Linear`s) or
`lora_embedding_A.<adapter>` / `lora_embedding_B.<adapter>` (parameters), and each module to save in a
`ModulesToSaveWrapper` holding `original_module` and `modules_to_save.<adapter>`; a `PeftModel` puts
`base_model.model.` in front of it all. So a full save of a PEFT model (FSDP or DeepSpeed module states, a
DCP save of `model.state_dict()`, verl's shards) holds, per adapted layer:

    base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight

The factors' shapes give each module's rank, but not its alpha: the scaling comes from the run's
`adapter_config.json` or verl's `lora_train_meta.json` (`settings`). The merge is the
one of adapter folders (`factors`), into the base layer's weight, written under the base
model's own name (`model.layers.0.self_attn.q_proj.weight`), as PEFT's `merge_and_unload` leaves it.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from functools import partial
from typing import Any

from ckptctl.checkpoint import TensorEntry
from ckptctl.contract.capabilities import DerivedTensor, ModelTensors
from ckptctl.contract.wrapped import GivenScaling, WrappedAdapter, WrappedModel
from ckptctl.errors import CkptctlError
from ckptctl.families.lora.adapter import ADAPTER_WEIGHTS
from ckptctl.families.lora.factors import PEFT_PREFIX, Factors, factor_problems, merged_weight, read_from
from ckptctl.families.lora.settings import ADAPTER_CONFIG, LORA_TRAIN_META, LoraSettings, parse_settings
from ckptctl.quoting import shell

__all__ = ["lora_wrapped"]

#: `lora_A.<adapter>.weight` (Linear) or `lora_embedding_A.<adapter>` (Embedding), and the B sides.
_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?:embedding_)?(?P<side>A|B)\.(?P<adapter>[^.]+)(?:\.weight)?$")
_TO_SAVE = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<param>.+)$")
_ORIGINAL = ".original_module."
_BASE_LAYER = ".base_layer."
#: LoRA parameters beside the factors that make more than `W + s·B@A` (a lora_B bias, DoRA's magnitudes).
_OTHER_LORA = re.compile(r"\.lora_(?:B\.[^.]+\.bias|magnitude_vector\.[^.]+(?:\.weight)?)$")
_HINT = (
    "pass the run's adapter_config.json (or verl's lora_train_meta.json) with --adapter-config PATH, "
    "put it beside the checkpoint, or give the scaling with --lora-alpha (and --lora-r, --lora-rslora)"
)
_GIVEN = "--lora-alpha/--lora-r"


class _Parsed:
    """The LoRA-wrapped names of one state dict."""

    def __init__(self, tensors: Mapping[str, TensorEntry]) -> None:
        halves: dict[str, dict[str, TensorEntry]] = {}
        self.embeddings: set[str] = set()
        self.adapters: set[str] = set()
        self.saved: set[str] = set()
        self.other_lora: list[str] = []
        for name, entry in tensors.items():
            found = _FACTOR.match(name)
            if found is not None:
                halves.setdefault(found.group("module"), {})[found.group("side")] = entry
                self.adapters.add(found.group("adapter"))
                if ".lora_embedding_" in name:
                    self.embeddings.add(found.group("module"))
            elif _OTHER_LORA.search(name):
                self.other_lora.append(name)
            elif saved := _TO_SAVE.match(name):
                self.saved.add(saved.group("module"))
                self.adapters.add(saved.group("adapter"))
        self.factors = {
            module: Factors(module, sides.get("A"), sides.get("B"), module in self.embeddings)
            for module, sides in halves.items()
        }
        self.prefixed = bool(tensors) and all(name.startswith(PEFT_PREFIX) for name in tensors)

    def model_name(self, module: str) -> str:
        """A module's name inside the base model (the name PEFT matches rank_pattern keys against)."""
        return module.removeprefix(PEFT_PREFIX) if self.prefixed else module


def lora_wrapped(tensors: Mapping[str, TensorEntry]) -> WrappedModel | None:
    """The LoRA adapter wrapped around the model whose tensors are `tensors`, or None.

    A state dict counts as wrapped when some module has both factors and its `base_layer.weight`: an
    adapter's own file (factors only, no base layers) is not a model.
    """
    if not any(".lora_" in name for name in tensors):
        return None
    parsed = _Parsed(tensors)
    wrapped = [m for m, pair in parsed.factors.items() if f"{m}{_BASE_LAYER}weight" in tensors and pair.a is not None]
    if not wrapped:
        return None
    ranks = sorted({pair.a.shape[0] for pair in parsed.factors.values() if pair.a is not None and pair.a.shape})
    summary: dict[str, Any] = {
        "adapters": sorted(parsed.adapters),
        "lora_modules": len(parsed.factors),
        "ranks": ranks,
        "targets": sorted({module.rpartition(".")[2] for module in parsed.factors}),
    }
    if parsed.saved:
        summary["modules_to_save"] = sorted(parsed.model_name(m) for m in parsed.saved)
    return WrappedModel(
        kind="LoRA-wrapped model (PEFT): base_layer weights with lora_A/lora_B factors beside them",
        summary=summary,
        settings_files=(ADAPTER_CONFIG, LORA_TRAIN_META),
        merge=partial(_merge, tensors, parsed),
        adapter=partial(_adapter, tensors, parsed),
    )


def _settings(found: Mapping[str, Any], given: GivenScaling | None, parsed: _Parsed) -> LoraSettings:
    """The scaling the user gave, else the settings file found.

    Raises:
        CkptctlError: neither: the factors' shapes give each module's rank but never its alpha.
    """
    if given is not None:
        _refuse_conv1d(parsed)
        ranks = {parsed.model_name(m): pair.a.shape[0] for m, pair in parsed.factors.items() if pair.a is not None}
        r = given.r if given.r is not None else Counter(ranks.values()).most_common(1)[0][0]
        # Without --lora-r each module's rank is its factors' (as PEFT's rank_pattern made them).
        pattern = {} if given.r is not None else {re.escape(m): rank for m, rank in ranks.items() if rank != r}
        alpha = int(given.alpha) if float(given.alpha).is_integer() else given.alpha
        return LoraSettings(_GIVEN, "LORA", r, alpha, rank_pattern=pattern, use_rslora=given.rslora)
    if ADAPTER_CONFIG in found:
        return parse_settings(found[ADAPTER_CONFIG], ADAPTER_CONFIG)
    if LORA_TRAIN_META in found:
        _refuse_conv1d(parsed)  # verl's file does not say whether the layers are transposed either
        return parse_settings(found[LORA_TRAIN_META], LORA_TRAIN_META)
    raise CkptctlError(
        "the checkpoint holds LoRA factors but not their scaling (lora_alpha is kept in adapter_config.json, "
        "which was not found beside it)",
        _HINT,
    )


#: The modules of transformers' `Conv1D` (GPT-2 and its kin), which store their weights as (in, out): PEFT
#: merges their LoRA transposed (`fan_in_fan_out`, set from the model when the adapter was made).
_CONV1D_MODULES = frozenset({"c_attn", "c_proj", "c_fc", "q_attn"})


def _refuse_conv1d(parsed: _Parsed) -> None:
    """Refuse settings that cannot say `fan_in_fan_out` for a model whose adapted layers are `Conv1D`:
    for a square layer the shapes fit either way, and the wrong one writes wrong weights without a word.

    Raises:
        CkptctlError: an adapted module is one of GPT-2's Conv1D layers.
    """
    conv1d = sorted({m.rpartition(".")[2] for m in parsed.factors} & _CONV1D_MODULES)
    if conv1d:
        raise CkptctlError(
            f"the adapted layers {', '.join(conv1d)} are GPT-2-style Conv1D layers, which PEFT merges transposed "
            "(fan_in_fan_out); only the run's adapter_config.json says so",
            "pass the run's adapter_config.json with --adapter-config PATH, or put it beside the checkpoint",
        )


def _checked(
    parsed: _Parsed, url: str, found: Mapping[str, Any], given: GivenScaling | None, notes: list[str]
) -> tuple[LoraSettings, dict[str, Factors]]:
    """The settings of the one adapter the model carries and its factors by the base model's module names.

    Raises:
        CkptctlError: more than one adapter, no settings, settings PEFT would not merge as `W + s·B@A`
            (DoRA, ...), or factors that do not fit each other or the settings.
    """
    if len(parsed.adapters) > 1:
        raise CkptctlError(
            f"the model carries adapters {', '.join(sorted(parsed.adapters))}; ckptctl merges one",
            "merge them with PEFT (add_weighted_adapter, then merge_and_unload)",
        )
    if parsed.other_lora:
        raise CkptctlError(
            f"{parsed.other_lora[0]} is a LoRA parameter ckptctl does not merge (DoRA or a LoRA bias)",
            "merge it with PEFT's merge_and_unload()",
        )
    settings = _settings(found, given, parsed)
    settings.check_mergeable()
    named = {parsed.model_name(module): pair for module, pair in parsed.factors.items()}
    broken = [p for p in factor_problems(named, settings) if p.severity == "error"]
    if broken:
        raise CkptctlError(broken[0].message, f"run `{shell('ckptctl', 'verify', url)}`")
    if given is not None and found:
        notes.append(f"the scaling given by {_GIVEN} is used, not that of {', '.join(found)}")
    notes += settings.warnings()
    return settings, named


def _merge(
    tensors: Mapping[str, TensorEntry],
    parsed: _Parsed,
    url: str,
    found: Mapping[str, Any],
    notes: list[str],
    given: GivenScaling | None = None,
) -> ModelTensors:
    """The model with the adapter merged into its base layers, by the base model's names (`WrappedModel.merge`).

    Raises:
        CkptctlError: as `_checked`, or names that collide once unwrapped.
    """
    settings, named = _checked(parsed, url, found, given, notes)
    read = read_from(url)
    model: dict[str, TensorEntry | DerivedTensor] = {}
    origin: dict[str, str] = {}
    for name, entry in tensors.items():
        out = _unwrapped(name, parsed)
        if out is None:
            continue
        module = out.removesuffix(".weight")
        if out.endswith(".weight") and name.endswith(f"{_BASE_LAYER}weight") and module in named:
            item: TensorEntry | DerivedTensor = merged_weight(named[module], entry, settings, read, read, out)
        else:
            item = entry
        if out in model:
            raise CkptctlError(f"{origin[out]!r} and {name!r} would both be written as {out!r}")
        model[out], origin[out] = item, name
    notes.append(
        f"merged the LoRA factors of {len(named)} module(s) into their base weights ({settings.source} gives the "
        "scaling); --lora adapter writes the adapter alone, --lora keep the tensors as stored"
    )
    return model


def _adapter(
    tensors: Mapping[str, TensorEntry],
    parsed: _Parsed,
    url: str,
    found: Mapping[str, Any],
    notes: list[str],
    given: GivenScaling | None = None,
) -> WrappedAdapter:
    """The adapter as `PeftModel.save_pretrained` writes it (`WrappedModel.adapter`).

    peft 0.21.2 `utils/save_and_load.py` `get_peft_model_state_dict`: the adapter's own tensors (`lora_A`,
    `lora_B`, `lora_embedding_A/B`, a module to save's trained copy) under the `PeftModel`'s names with the
    adapter name removed (`...q_proj.lora_A.weight`, `...lm_head.weight`), and an adapted embedding's
    `base_layer.weight` (saved when an embedding is targeted), into `adapter_model.safetensors`; the settings
    into `adapter_config.json`: the run's own when it was found, else made from what is known.

    Raises:
        CkptctlError: as `_checked`.
    """
    settings, named = _checked(parsed, url, found, given, notes)
    out: dict[str, TensorEntry | DerivedTensor] = {}
    for name, entry in tensors.items():
        factor = _FACTOR.match(name)
        saved = _TO_SAVE.match(name)
        if factor is not None:
            module, side = parsed.model_name(factor.group("module")), factor.group("side")
            suffix = f"lora_embedding_{side}" if factor.group("module") in parsed.embeddings else f"lora_{side}.weight"
            key = f"{module}.{suffix}"
        elif saved is not None:
            key = f"{parsed.model_name(saved.group('module'))}.{saved.group('param')}"
        elif name.endswith(f"{_BASE_LAYER}weight") and name.removesuffix(f"{_BASE_LAYER}weight") in parsed.embeddings:
            key = parsed.model_name(name)
        else:
            continue
        out[f"{PEFT_PREFIX}{key}"] = entry
    if given is None and ADAPTER_CONFIG in found:
        config = dict(found[ADAPTER_CONFIG])
    else:
        config = _made_config(settings, sorted(named), sorted(parsed.model_name(m) for m in parsed.saved), found)
        notes.append(f"adapter_config.json made from {settings.source} and the factors found (targets, ranks)")
    notes.append(
        f"wrote the LoRA adapter of {len(named)} module(s) as a PEFT adapter folder: load it with "
        "PeftModel.from_pretrained(BASE, DST)"
    )
    return WrappedAdapter(out, ADAPTER_WEIGHTS[0], ADAPTER_CONFIG, config)


def _made_config(
    settings: LoraSettings, targets: list[str], to_save: list[str], found: Mapping[str, Any]
) -> dict[str, Any]:
    """An adapter_config.json PEFT's `LoraConfig` loads: the adapted modules by their full names (PEFT
    matches a list entry against the end of a module's name), each module's rank and alpha as the merge
    takes them, and verl's task_type when its lora_train_meta.json gave the settings."""
    meta = found.get(LORA_TRAIN_META)
    task_type = meta.get("task_type") if isinstance(meta, dict) else None
    return {
        "peft_type": "LORA",
        "task_type": task_type if isinstance(task_type, str) else None,
        "r": settings.r,
        "lora_alpha": settings.lora_alpha,
        "rank_pattern": dict(settings.rank_pattern),
        "alpha_pattern": dict(settings.alpha_pattern),
        "use_rslora": settings.use_rslora,
        "fan_in_fan_out": settings.fan_in_fan_out,
        "target_modules": targets,
        "modules_to_save": to_save or None,
        "bias": "none",
        "inference_mode": True,
    }


def _unwrapped(name: str, parsed: _Parsed) -> str | None:
    """The base model's name of a stored tensor, or None for the factors and the replaced original modules."""
    if _FACTOR.match(name) or _ORIGINAL in name:
        return None
    saved = _TO_SAVE.match(name)
    if saved is not None:
        name = f"{saved.group('module')}.{saved.group('param')}"
    elif _BASE_LAYER in name:
        head, _, tail = name.rpartition(_BASE_LAYER)
        name = f"{head}.{tail}"
    return parsed.model_name(name)
