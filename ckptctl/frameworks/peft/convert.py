"""What `convert` reads from PEFT adapter folders (`ConvertSource`): the LoRA adapter, merged into a base model
as PEFT's `merge_and_unload` merges it (`frameworks.peft.layout.lora_adapter`)."""

from __future__ import annotations

from ckptctl.checkpoint import Checkpoint
from ckptctl.frameworks.peft.layout import lora_adapter
from ckptctl.layouts.capabilities import Adapter, ConvertSource

__all__ = ["SOURCE"]


def _adapter(checkpoint: Checkpoint) -> Adapter | None:
    """A LoRA adapter, merged as PEFT's `merge_and_unload` merges it (see `frameworks.peft.layout`)."""
    return lora_adapter(checkpoint.url, checkpoint.tensor_index)


SOURCE = ConvertSource(adapter=_adapter)
