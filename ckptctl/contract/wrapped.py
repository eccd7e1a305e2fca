"""Adapters trained inside a model, as the model's state dict holds them in whatever layout saved it.

A PEFT-wrapped model saved whole (by FSDP, DeepSpeed, torch DCP, verl) keeps each adapted layer's own
weight as `<module>.base_layer.weight` beside its LoRA factors `<module>.lora_A.default.weight`: a
transformers model loads none of it. Which framework wraps a model this way is a fact of tensor names, not
of the layout the tensors lie in, so the rules live in the format-family readers (`families.lora.wrapped`) and
are listed in `layouts.format_rules.WRAPPED_MODEL_RULES`: `inspect` says what it found and `convert` writes
the model under its own names with the adapter merged in. Here are the types those rules return.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptctl.contract.capabilities import ModelTensors

__all__ = ["GivenScaling", "WrappedAdapter", "WrappedModel"]


@dataclass(frozen=True, slots=True)
class GivenScaling:
    """An adapter's scaling as the user gives it (`convert --lora-alpha/--lora-r/--lora-rslora`), for a
    checkpoint that keeps no settings file beside it.

    Attributes:
        alpha: the LoRA alpha.
        r: the rank the run was configured with (checked against the factors), or None: each module's rank
            is its factors'.
        rslora: the scaling is alpha/sqrt(r) instead of alpha/r.
    """

    alpha: float
    r: int | None = None
    rslora: bool = False


@dataclass(frozen=True, slots=True)
class WrappedAdapter:
    """The adapters a wrapped model carries, as their framework's own adapter folder holds them.

    Attributes:
        tensors: the adapter's tensors by the names its framework saves them under, in stored order.
        weights_name: the file those tensors go into (safetensors).
        settings_name: the settings file written beside them.
        settings: that file's content (JSON).
    """

    tensors: ModelTensors
    weights_name: str
    settings_name: str
    settings: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class WrappedModel:
    """A model state dict whose layers carry adapters (`layouts.format_rules.find_wrapped`).

    Attributes:
        kind: what it is, for people (`LoRA-wrapped model (PEFT)`).
        summary: facts `inspect` shows (adapter names, adapted modules, ranks).
        settings_files: names of the files that hold what the state dict lacks to merge the adapter (the
            LoRA alpha), any of which `convert` looks for beside the checkpoint.
        merge: `merge(url, settings, notes, given)`: the model with the adapter merged in, by the model's own
            names and in stored order (stored entries relative to `url`, the checkpoint's folder; merged ones
            derived), given `settings`, the files of `settings_files` found (name -> parsed JSON), and the
            scaling the user gave (`GivenScaling` or None), which wins over them. It appends what a person
            should know to `notes`, and raises `CkptctlError` when it cannot merge.
        adapter: `adapter(url, settings, notes, given)`: the adapter alone, as its framework's adapter folder
            holds it (`WrappedAdapter`), with the same arguments and errors as `merge`.
    """

    kind: str
    summary: Mapping[str, Any]
    settings_files: tuple[str, ...]
    merge: Callable[[str, Mapping[str, Any], list[str], GivenScaling | None], ModelTensors] = field(repr=False)
    adapter: Callable[[str, Mapping[str, Any], list[str], GivenScaling | None], WrappedAdapter] = field(repr=False)
