"""What `convert` reads from DeepSpeed's tags and universal checkpoints beyond their tensor index
(`ConvertSource`): the fp32 master weights `zero_to_fp32.py` rebuilds, and the names of the module."""

from __future__ import annotations

from collections.abc import Sequence

from ckptctl.checkpoint import Checkpoint, TensorEntry
from ckptctl.contract.capabilities import CONVERT_SOURCE, ConvertSource, MasterWeights, default_config_folders
from ckptctl.contract.naming import NameStripper, keep_name
from ckptctl.errors import CkptctlError
from ckptctl.families.zero_tag.master_weights import assemble_master_weights, checkpoint_master_weights
from ckptctl.families.zero_tag.naming import wrapper_prefix
from ckptctl.families.zero_tag.tag import read_tag
from ckptctl.frameworks.deepspeed.universal_host import host_layout
from ckptctl.layouts import capability

__all__ = ["SOURCE", "UNIVERSAL_SOURCE"]


def _master_weights(checkpoint: Checkpoint, *, required: bool, notes: list[str]) -> MasterWeights | None:
    """The fp32 master weights DeepSpeed's `zero_to_fp32.py` reconstructs (`checkpoint_master_weights`)."""
    return checkpoint_master_weights(checkpoint, "", required=required, notes=notes)


def _universal_master_weights(checkpoint: Checkpoint, *, required: bool, notes: list[str]) -> MasterWeights | None:
    """The fp32 weights of every parameter's `fp32.pt`, with the frozen parameters and buffers of the
    model states: what zero_to_fp32 makes of the tag it was converted from.

    Raises:
        CkptctlError: several model-parallel ranks (as for a tag: their frozen parameters and buffers
            are shards).
    """
    tag = read_tag(checkpoint.url)
    if tag.mp_world_size > 1:
        raise CkptctlError(
            f"{checkpoint.url} holds {tag.mp_world_size} model-parallel ranks, whose model states hold shards",
            "convert with the training framework's own tool",
        )
    return assemble_master_weights(tag, checkpoint.tensor_index(), zero3=tag.zero_stage == 3)


def _universal_config_folders(checkpoint: Checkpoint) -> Sequence[str]:
    """Where the framework that wrote the tag keeps the model's config (`host_layout`)."""
    host = capability(host_layout(checkpoint.url), CONVERT_SOURCE)
    folders = None if host is None else host.config_folders
    return default_config_folders(checkpoint) if folders is None else folders(checkpoint)


def _universal_namespace_stripper(entries: Sequence[TensorEntry]) -> NameStripper:
    """The wrappers' prefixes of the module's names (`module.`, ...), as for a tag: the states are named
    after the module's parameters, whatever file they lie in."""
    prefix = wrapper_prefix([e.name for e in entries])
    return (lambda name: name.removeprefix(prefix)) if prefix else keep_name


SOURCE = ConvertSource(master_weights=_master_weights)
UNIVERSAL_SOURCE = ConvertSource(
    master_weights=_universal_master_weights,
    config_folders=_universal_config_folders,
    namespace_stripper=_universal_namespace_stripper,
)
