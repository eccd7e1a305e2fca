"""What `convert` and `diff` read from Lightning's checkpoints beyond their tensor index (`ConvertSource`): a
DeepSpeed folder's master weights, the module's names, the transformers config among its hyperparameters."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, ChunkEncoding, TensorEntry
from ckptctl.contract.capabilities import ConvertSource, MasterWeights
from ckptctl.contract.naming import NameStripper, keep_name, strip_segments
from ckptctl.errors import CkptctlError
from ckptctl.families.zero_tag.master_weights import checkpoint_master_weights
from ckptctl.formats.safe_pickle import StandIn, state_fields
from ckptctl.frameworks.lightning.layout import DEEPSPEED_TAG, lightning_dict_file, open_lightning_file

__all__ = ["SOURCE"]


def _master_weights(checkpoint: Checkpoint, *, required: bool, notes: list[str]) -> MasterWeights | None:
    """A DeepSpeed folder's fp32 master weights (ZeRO's partitions, as `zero_to_fp32.py` rebuilds them)."""
    prefix = f"{DEEPSPEED_TAG}/" if DEEPSPEED_TAG in _top_folders(checkpoint) else None
    return checkpoint_master_weights(checkpoint, prefix, required=required, notes=notes)


def _namespace_stripper(entries: Sequence[TensorEntry]) -> NameStripper:
    """`state_dict.` (a file's key) or `model.` (a sharded folder's DCP key), then the LightningModule's
    attribute that holds the model (`model.`) when every tensor is under one."""
    names = [e.name for e in entries]
    if not names:
        return keep_name
    if all(c.file.startswith(f"{DEEPSPEED_TAG}/") for e in entries for c in e.chunks):
        # A DeepSpeed folder holds the LightningModule's own state dict: only its attribute is in front.
        heads = {name.partition(".")[0] for name in names}
        return strip_segments(1) if len(heads) == 1 and all("." in name for name in names) else keep_name
    sharded = all(c.encoding is ChunkEncoding.TORCH_SAVE for e in entries for c in e.chunks)
    outer = "model" if sharded else "state_dict"
    if not all(name.startswith(f"{outer}.") for name in names):
        return keep_name
    inner = {name.split(".", 2)[1] for name in names if name.count(".") >= 2}
    if len(inner) == 1 and all(name.count(".") >= 2 for name in names):
        return strip_segments(2)
    return strip_segments(1)


def _config_folders(checkpoint: Checkpoint) -> Sequence[str]:
    """The checkpoint's folder (ModelCheckpoint's `dirpath`) and the one above it."""
    folder = io.parent_of(checkpoint.url)
    return (folder, io.parent_of(folder))


def _model_config(checkpoint: Checkpoint) -> Mapping[str, Any] | None:
    """A transformers config the module kept among its hyperparameters (`save_hyperparameters()` of a
    module built from `config.to_dict()`): a dict naming its `model_type` and `architectures`."""
    url = checkpoint.url
    try:
        root = open_lightning_file(io.join(url, lightning_dict_file(url)) if io.is_dir(url) else url, None).root
    except CkptctlError:
        return None
    hparams = root.get("hyper_parameters") if isinstance(root, dict) else None
    if isinstance(hparams, StandIn):
        hparams = state_fields(hparams, "hyper_parameters")
    if not isinstance(hparams, dict):
        return None
    for value in (hparams, *hparams.values()):
        if isinstance(value, StandIn):
            value = state_fields(value, "hyper_parameters")
        if isinstance(value, dict) and isinstance(value.get("model_type"), str) and value.get("architectures"):
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue
            return value
    return None


def _top_folders(checkpoint: Checkpoint) -> set[str]:
    return {name.partition("/")[0] for name in checkpoint.files if "/" in name}


SOURCE = ConvertSource(
    master_weights=_master_weights,
    namespace_stripper=_namespace_stripper,
    config_folders=_config_folders,
    model_config=_model_config,
)
