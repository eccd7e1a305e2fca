"""What `convert` reads from PEFT adapter folders (`ConvertSource`): the LoRA adapter, merged into a base model
as PEFT's `merge_and_unload` merges it (`layouts.parts.lora.adapter.lora_adapter`)."""

from __future__ import annotations

from ckptctl.checkpoint import Checkpoint
from ckptctl.layouts.capabilities import Adapter, ConvertSource
from ckptctl.layouts.parts.lora.adapter import lora_adapter

__all__ = ["SOURCE"]


def _adapter(checkpoint: Checkpoint) -> Adapter | None:
    """A LoRA adapter, merged as PEFT's `merge_and_unload` merges it (see `layouts.parts.lora.adapter`)."""
    return lora_adapter(checkpoint.url, checkpoint.tensor_index)


SOURCE = ConvertSource(adapter=_adapter)
