"""The tiny model the writers train and save (and the tests build to compare with)."""

from __future__ import annotations

from typing import Any


def tiny_llama(**overrides: Any) -> Any:
    """A tiny Llama built from a local config (no hub access), with a fixed seed; `overrides` change the
    config (`tie_word_embeddings=True`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **overrides,
    )
    return LlamaForCausalLM(config)


def fully_sharded(model: Any, mesh: Any) -> Any:
    """`model` (a `tiny_llama`) with FSDP2's `fully_shard` on each decoder layer and on the whole, over the
    device mesh `mesh`, as the suite's FSDP2 writers and loaders shard it."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
