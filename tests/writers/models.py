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
