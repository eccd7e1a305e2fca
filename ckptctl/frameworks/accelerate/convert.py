"""What `convert` and `diff` read from accelerate's `save_state` folders beyond their tensor index
(`ConvertSource`): the DeepSpeed plugin's master weights, the model's names, where its config lies."""

from __future__ import annotations

from collections.abc import Sequence

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, TensorEntry
from ckptctl.contract.capabilities import ConvertSource, MasterWeights
from ckptctl.contract.naming import NameStripper, keep_name
from ckptctl.families.zero_tag.master_weights import checkpoint_master_weights
from ckptctl.families.zero_tag.naming import wrapper_prefix
from ckptctl.frameworks.accelerate.layout import SaveStateParts, auto_checkpoint_match
from ckptctl.layouts.format_rules import format_namespace_stripper

__all__ = ["SOURCE"]


def _master_weights(checkpoint: Checkpoint, *, required: bool, notes: list[str]) -> MasterWeights | None:
    """The fp32 master weights of the DeepSpeed tag (`pytorch_model/`), when the plugin was DeepSpeed."""
    tag = SaveStateParts.of(io.list_dir(checkpoint.url)).ds_tags.get(0)
    prefix = None if tag is None else f"{tag}/"
    return checkpoint_master_weights(checkpoint, prefix, required=required, notes=notes)


def _config_folders(checkpoint: Checkpoint) -> Sequence[str]:
    """The folder, its parent, and for `checkpoints/checkpoint_N` the project folder above (where a
    script's `save_pretrained` usually writes the model's config)."""
    url = checkpoint.url
    parent = io.parent_of(url)
    return (url, parent, io.parent_of(parent)) if auto_checkpoint_match(url) else (url, parent)


def _namespace_stripper(entries: Sequence[TensorEntry]) -> NameStripper:
    """The storage format's rule (DCP's `model.`, DeepSpeed's wrappers), else the prefix of the wrappers
    the model was prepared in: under DDP save_state saves the wrapped model's state dict (`module.`;
    `_orig_mod.` after torch.compile)."""
    rule = format_namespace_stripper(entries)
    if rule is not keep_name:
        return rule
    prefix = wrapper_prefix([e.name for e in entries])
    if not prefix:
        return keep_name
    return lambda name: name.removeprefix(prefix)


SOURCE = ConvertSource(
    master_weights=_master_weights, config_folders=_config_folders, namespace_stripper=_namespace_stripper
)
