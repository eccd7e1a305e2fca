"""What `convert` reads from the HF Trainer's `checkpoint-N` folders beyond their tensor index
(`ConvertSource`): the PEFT adapter it saved instead of a model, the DeepSpeed tag's master weights."""

from __future__ import annotations

from functools import partial

from ckptctl import io
from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import Adapter, ConvertSource, MasterWeights
from ckptctl.families.lora.adapter import ADAPTER_WEIGHTS, lora_adapter
from ckptctl.families.zero_tag.master_weights import checkpoint_master_weights
from ckptctl.frameworks.hf_trainer.layout import TrainerParts, model_tensors

__all__ = ["SOURCE"]


def _adapter(checkpoint: Checkpoint) -> Adapter | None:
    """The PEFT adapter the Trainer saved instead of the model, when it trained a PEFT model."""
    if not any(name in checkpoint.files for name in ADAPTER_WEIGHTS):
        return None
    return lora_adapter(checkpoint.url, partial(model_tensors, checkpoint.tensor_index))


def _master_weights(checkpoint: Checkpoint, *, required: bool, notes: list[str]) -> MasterWeights | None:
    """The fp32 master weights of the DeepSpeed tag inside (`global_stepN/`), when there is one."""
    tag = TrainerParts.of(checkpoint.url, io.list_dir(checkpoint.url)).ds_tag
    prefix = None if tag is None else f"{tag}/"
    return checkpoint_master_weights(checkpoint, prefix, required=required, notes=notes)


SOURCE = ConvertSource(adapter=_adapter, master_weights=_master_weights)
