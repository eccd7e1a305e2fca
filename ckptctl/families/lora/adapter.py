"""A LoRA adapter as PEFT saves it in a folder (`adapter_config.json` beside the adapter's weights): what
`inspect` shows of it, what `verify` checks, and its merge into a base model (`ConvertSource.adapter`). The PEFT
adapter folder layout and the Trainer's `checkpoint-N/` of a PEFT model read their adapters with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import Problem, ProblemKind, TensorEntry
from ckptctl.errors import CkptctlError
from ckptctl.families.lora.factors import adapter_factors, factor_problems, merged_weight, read_from
from ckptctl.families.lora.settings import ADAPTER_CONFIG, LoraSettings, parse_settings
from ckptctl.formats.documents import read_json
from ckptctl.quoting import shell

if TYPE_CHECKING:  # built where an adapter is merged: a scan that meets one (`hf_trainer`, `peft`) needs none
    from ckptctl.contract.capabilities import Adapter, DerivedTensor, ModelTensors

__all__ = ["ADAPTER_WEIGHTS", "adapter_metadata", "adapter_problems", "lora_adapter"]

#: The adapter's weights, in the order PEFT's `load_peft_weights` prefers them.
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_MERGE_HINT = "merge it with PEFT: PeftModel.from_pretrained(base, ADAPTER).merge_and_unload().save_pretrained(OUT)"


def lora_adapter(url: str, tensors: Callable[[], Sequence[TensorEntry]]) -> Adapter:
    """The LoRA adapter whose `adapter_config.json` lies in the folder `url` and whose tensors are
    `tensors()` (chunks relative to `url`), merged as PEFT's `merge_and_unload` merges it (see `_merge`)."""
    from ckptctl.contract.capabilities import Adapter

    try:
        base = _settings(url).shown.get("base_model_name_or_path")
    except CkptctlError:
        base = None
    return Adapter("LoRA", base if isinstance(base, str) else None, partial(_merge, url, tensors))


def adapter_metadata(url: str, has_config: bool, tensors: Callable[[], Sequence[TensorEntry]]) -> dict[str, Any]:
    """What `inspect` shows of the adapter in the folder `url` whose tensors are `tensors()`: its settings
    (when `has_config`), scaling, warnings, LoRA modules, ranks and the base tensors it replaces."""
    metadata: dict[str, Any] = {}
    try:
        settings = _settings(url) if has_config else None
    except CkptctlError as exc:
        metadata["error"] = exc.message
        settings = None
    if settings is not None:
        metadata["adapter"] = dict(settings.shown)
        if settings.peft_type == "LORA":
            metadata["scaling"] = _scaling_summary(settings)
        if warnings := settings.warnings():
            metadata["warnings"] = warnings
    try:
        factors, others, _ = adapter_factors(tensors())
    except CkptctlError:
        return metadata  # verify says why the weights do not read
    metadata["lora_modules"] = len(factors)
    ranks = sorted({pair.a.shape[0] for pair in factors.values() if pair.a is not None and pair.a.shape})
    if ranks:
        metadata["ranks"] = ranks
    if others:
        metadata["replaces"] = sorted(others)
    return metadata


def adapter_problems(url: str, has_config: bool, tensors: Sequence[TensorEntry], weights: str) -> list[Problem]:
    """What is wrong with the adapter in the folder `url` whose tensors (from the file `weights`) are
    `tensors`: adapter_config.json missing or not parsing, no LoRA factors, factor pairs and ranks that do not
    fit (`factor_problems`); an alpha of 0 is a warning: such an adapter loads and does nothing."""
    problems: list[Problem] = []
    settings = None
    if not has_config:
        problems.append(Problem(ProblemKind.MISSING_FILE, ADAPTER_CONFIG, f"{ADAPTER_CONFIG} is missing"))
    else:
        try:
            settings = _settings(url)
        except CkptctlError as exc:
            problems.append(Problem(ProblemKind.BAD_METADATA, ADAPTER_CONFIG, exc.message))
    if not tensors:
        return problems
    factors, _, _ = adapter_factors(tensors)
    if not factors and settings is not None and settings.peft_type == "LORA":
        problems.append(Problem(ProblemKind.MISSING_FILE, weights, f"{weights} holds no LoRA factors"))
    problems += factor_problems(factors, settings)
    if settings is not None:
        problems += [
            Problem(ProblemKind.BAD_METADATA, ADAPTER_CONFIG, warning, severity="warning")
            for warning in settings.warnings()
        ]
    return problems


def _settings(url: str) -> LoraSettings:
    """The adapter's settings (adapter_config.json).

    Raises:
        CkptctlError: the file is missing, does not parse, or holds values PEFT never writes.
    """
    source = io.join(url, ADAPTER_CONFIG)
    return parse_settings(read_json(source), source)


def _scaling_summary(settings: LoraSettings) -> str:
    """What PEFT multiplies B @ A by, for people: the default, and whether patterns change it."""
    formula = "lora_alpha/sqrt(r)" if settings.use_rslora else "lora_alpha/r"
    patterns = (
        " (rank_pattern/alpha_pattern change it per module)" if settings.rank_pattern or settings.alpha_pattern else ""
    )
    return f"{formula} = {settings.scaling(''):.6g}{patterns}"


def _merge(
    url: str,
    tensors: Callable[[], Sequence[TensorEntry]],
    base_url: str,
    base: Mapping[str, TensorEntry],
    notes: list[str],
) -> ModelTensors:
    """The base model's tensors with the adapter merged in (`Adapter.merge`).

    Each adapted module's weight becomes `W + scaling·B@A` (`factors`); each other tensor of
    the adapter (a `modules_to_save` copy: `lm_head.weight`, `embed_tokens.weight`) replaces the base tensor
    of its name, cast to the base tensor's dtype as PEFT's loading copies it into the base module's copy.

    Raises:
        CkptctlError: not a LoRA adapter PEFT merges as `W + s·B@A` (DoRA, other PEFT types, ...), factors
            that do not fit each other or the base, or a tensor the base model lacks.
    """
    from ckptctl.contract.capabilities import DerivedTensor

    settings = _settings(url)
    settings.check_mergeable()
    factors, others, extra = adapter_factors(tensors())
    if extra:
        raise CkptctlError(
            f"{url} holds {extra[0]}, a LoRA parameter ckptctl does not merge (adapter_config.json does not "
            "say it uses DoRA or a LoRA bias)",
            _MERGE_HINT,
        )
    broken = [p for p in factor_problems(factors, settings) if p.severity == "error"]
    if broken:
        raise CkptctlError(f"{url}: {broken[0].message}", f"run `{shell('ckptctl', 'verify', url)}`")
    if not factors:
        raise CkptctlError(f"{url} holds no LoRA factors to merge")
    notes += settings.warnings()
    read_base, read_adapter = read_from(base_url), read_from(url)
    merged: dict[str, TensorEntry | DerivedTensor] = dict(base)
    for name, entry in others.items():
        target = base.get(name)
        if target is None or target.shape != entry.shape:
            held = "has no such tensor" if target is None else f"holds it as {list(target.shape)}"
            raise CkptctlError(
                f"the adapter holds {name} {list(entry.shape)} (a modules_to_save copy or a saved embedding layer) "
                f"but the base model {held}",
                "pass the base model the adapter was trained on (a resized vocabulary needs the resized base)",
            )
        merged[name] = DerivedTensor(name, target.dtype, target.shape, partial(_cast_copy, read_adapter, entry, target))
    for module, pair in factors.items():
        name = f"{module}.weight"
        target = base.get(name)
        if target is None:
            raise CkptctlError(
                f"the adapter adapts {module}, but the base model {base_url} has no {name}",
                "pass the base model the adapter was trained on (adapter_config.json's base_model_name_or_path)",
            )
        # A layer the adapter saved whole (an adapted embedding) is what PEFT loads and merges into.
        own = others.get(name)
        weight, read_weight = (own, read_adapter) if own is not None else (target, read_base)
        merged[name] = merged_weight(pair, weight, settings, read_weight, read_adapter, name, target.dtype)
    kept = (
        f"; {len(others)} tensor(s) of the adapter replace the base's ({', '.join(list(others)[:3])})" if others else ""
    )
    notes.append(f"merged the LoRA factors of {len(factors)} module(s) into {base_url}{kept}")
    return merged


def _cast_copy(read: Any, entry: TensorEntry, like: TensorEntry) -> Any:
    import torch

    tensor = read(entry)
    return tensor.to(getattr(torch, like.dtype)) if entry.dtype != like.dtype else tensor
