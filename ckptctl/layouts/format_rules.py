"""The rules of the shared format families that apply to a checkpoint by its tensors alone, whatever layout
holds them: the namespace a storage format puts before the model's own names, and adapters wrapped around a
model's layers. Registries like the layout registry (names imported on first use, tried in order), kept here
rather than in the contract because they name the readers (`ckptctl.families`) that the contract sits below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from ckptctl.checkpoint import TensorEntry
from ckptctl.contract.naming import NameStripper, keep_name
from ckptctl.contract.wrapped import WrappedModel

__all__ = ["FORMAT_NAME_RULES", "WRAPPED_MODEL_RULES", "find_wrapped", "format_namespace_stripper"]

#: The name rules of the storage formats several layouts keep tensors in ("module:function", imported
#: on first use), tried in order: each returns a `NameStripper` when every tensor lies in its format's
#: files, else None. A layout built on one of these formats gets its rule without naming it.
FORMAT_NAME_RULES = (
    "ckptctl.families.dcp_naming:dcp_namespace_stripper",
    "ckptctl.families.zero_tag.naming:wrapper_stripper",
)

#: The rules that find adapters wrapped around a model's layers (`contract.wrapped`): each takes a component's
#: tensors by name and returns a `WrappedModel`, or None when it finds none.
WRAPPED_MODEL_RULES = ("ckptctl.families.lora.wrapped:lora_wrapped",)


def _rule(spec: str) -> Callable[[Any], Any]:
    """The function a "module:function" spec names, its module imported on first use."""
    module, _, name = spec.partition(":")
    rule: Callable[[Any], Any] = getattr(importlib.import_module(module), name)
    return rule


def format_namespace_stripper(entries: Sequence[TensorEntry]) -> NameStripper:
    """The rule of the storage format every tensor of `entries` lies in (`FORMAT_NAME_RULES`), or the
    names as stored when none applies."""
    for spec in FORMAT_NAME_RULES:
        found = _rule(spec)(entries)
        if found is not None:
            return cast(NameStripper, found)
    return keep_name


def find_wrapped(tensors: Mapping[str, TensorEntry]) -> WrappedModel | None:
    """The adapters wrapped around the model whose tensors are `tensors` (name -> entry), or None."""
    for spec in WRAPPED_MODEL_RULES:
        found = _rule(spec)(tensors)
        if found is not None:
            return cast(WrappedModel, found)
    return None
