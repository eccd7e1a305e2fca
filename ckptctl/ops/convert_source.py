"""A checkpoint's layout as `convert` and `diff` read a model from it: the `ConvertSource` capability of its
framework (`contract.capabilities`), and what suits a framework that lacks a part of it.

The defaults live here, with the commands that use them, not with the layouts: a framework provides only
what it has, and `convert_source(layout)` answers every question for every layout, also one outside the
registry (a single weights file).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptctl.checkpoint import Checkpoint, TensorEntry
from ckptctl.contract.capabilities import (
    CONVERT_SOURCE,
    NO_NAME_MAP,
    Adapter,
    ConvertSource,
    HfModel,
    MasterWeights,
    ModelSpec,
    NameMap,
    NativeModel,
    default_config_folders,
)
from ckptctl.contract.naming import NameStripper
from ckptctl.errors import CkptctlError
from ckptctl.families.value_head import HeadTask
from ckptctl.layouts import Layout, capability
from ckptctl.layouts.format_rules import format_namespace_stripper

__all__ = ["Source", "convert_source"]


@dataclass(frozen=True, slots=True)
class Source:
    """One layout's `ConvertSource` with the defaults: each method is the field of that name (see
    `ConvertSource` for what it answers), or what suits a framework without it.

    Attributes:
        layout: the layout's name.
        capability: what its framework provides.
    """

    layout: str
    capability: ConvertSource

    def namespace_stripper(self, entries: Sequence[TensorEntry]) -> NameStripper:
        """Default: the rule of the storage format the tensors lie in, other names kept as stored."""
        found = self.capability.namespace_stripper
        return format_namespace_stripper(entries) if found is None else found(entries)

    def hf_name_map(
        self,
        tensors: Mapping[str, tuple[int, ...]],
        config: Mapping[str, Any] | None,
        requested: str | None,
        notes: list[str],
    ) -> NameMap | None:
        """Default: names kept (a framework whose names are transformers').

        Raises:
            CkptctlError: `requested` names a map of a framework that has none.
        """
        found = self.capability.hf_name_map
        if found is not None:
            return found(tensors, config, requested, notes)
        if requested not in (None, NO_NAME_MAP):
            raise CkptctlError(
                f"{self.layout} checkpoints have no tensor name map {requested!r}",
                f"their tensors keep their names: drop --mapping (or pass --mapping {NO_NAME_MAP})",
            )
        return None

    def hf_model(self, checkpoint: Checkpoint, config: Mapping[str, Any] | None) -> HfModel | None:
        """Default: None, the stored names and shapes are the model's own."""
        found = self.capability.hf_model
        return None if found is None else found(checkpoint, config)

    def native_model(self, checkpoint: Checkpoint) -> NativeModel | None:
        """Default: None, the stored names and shapes are the ones the framework's load gives the model."""
        found = self.capability.native_model
        return None if found is None else found(checkpoint)

    def master_weights(self, checkpoint: Checkpoint, *, required: bool, notes: list[str]) -> MasterWeights | None:
        """Default: None, the checkpoint keeps no full-precision copy apart from its model."""
        found = self.capability.master_weights
        return None if found is None else found(checkpoint, required=required, notes=notes)

    def adapter(self, checkpoint: Checkpoint) -> Adapter | None:
        """Default: None, the checkpoint holds a model."""
        found = self.capability.adapter
        return None if found is None else found(checkpoint)

    def config_folders(self, checkpoint: Checkpoint) -> Sequence[str]:
        """Default: `default_config_folders` (the checkpoint's folder, then its parent)."""
        found = self.capability.config_folders
        return default_config_folders(checkpoint) if found is None else found(checkpoint)

    def model_config(self, checkpoint: Checkpoint) -> Mapping[str, Any] | None:
        """Default: None, the checkpoint records no model config of its own."""
        found = self.capability.model_config
        return None if found is None else found(checkpoint)

    def model_spec(self, config: Mapping[str, Any], notes: list[str]) -> ModelSpec | None:
        """Default: None, the framework cannot tell."""
        found = self.capability.model_spec
        return None if found is None else found(config, notes)

    def value_head_task(self, checkpoint: Checkpoint) -> HeadTask | None:
        """Default: None, the config names what a value head converts to."""
        found = self.capability.value_head_task
        return None if found is None else found(checkpoint)

    def model_logits(self, folder: str, config: Mapping[str, Any], tensors: Mapping[str, Any] | None) -> Any:
        """The logits of the model in `folder`, as the framework's own loader computes them.

        Raises:
            CkptctlError: the framework cannot run its models (the default).
        """
        found = self.capability.model_logits
        if found is None:
            raise CkptctlError(f"{self.layout} models cannot be run to compare their logits")
        return found(folder, config, tensors)


def convert_source(layout: str | Layout) -> Source:
    """The `Source` of `layout` (a layout or its name): its framework's `ConvertSource` (`layouts.capability`),
    imported on first use, with the defaults for what it lacks (all of it for a framework that provides none)."""
    name = layout if isinstance(layout, str) else layout.name
    return Source(name, capability(layout, CONVERT_SOURCE) or ConvertSource())
