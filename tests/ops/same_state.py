"""Exact equality of two loaded training states (nested dicts, lists and tuples of tensors and plain values),
naming where they first differ: what the reshard proofs compare a resumed state with its source's by."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["assert_same_state"]


def assert_same_state(got: Any, want: Any, where: str) -> None:
    """`got` equals `want` exactly: the same keys in the same order, tensors of the same dtype and values."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for key in want:
            assert_same_state(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_state(g, w, f"{where}[{i}]")
    else:
        assert got == want, where
