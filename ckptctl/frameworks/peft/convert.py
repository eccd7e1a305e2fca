"""What `convert` reads from PEFT adapter folders (`ConvertSource`): the LoRA adapter, merged into a base model
as PEFT's `merge_and_unload` merges it (`families.lora.adapter.lora_adapter`)."""

from __future__ import annotations

from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import Adapter, ConvertSource
from ckptctl.families.lora.adapter import lora_adapter

__all__ = ["SOURCE"]


def _adapter(checkpoint: Checkpoint) -> Adapter | None:
    """A LoRA adapter, merged as PEFT's `merge_and_unload` merges it (see `families.lora.adapter`)."""
    return lora_adapter(checkpoint.url, checkpoint.tensor_index)


SOURCE = ConvertSource(adapter=_adapter)
