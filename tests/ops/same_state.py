"""Exact equality of two loaded training states (nested dicts, lists and tuples of tensors, numpy arrays,
framework objects and plain values), naming where they first differ: what the reshard proofs compare a resumed
state with its source's by, and the universal tests ckptctl's output with DeepSpeed's own `ds_to_universal`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["assert_same_state", "files"]


def files(root: Path) -> list[str]:
    """Every file below `root`, relative, sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def assert_same_state(got: Any, want: Any, where: str) -> None:
    """`got` equals `want` exactly: tensors of the same dtype, shape and elements (bit for bit), dicts with the
    same keys in the same order, sequences of the same type, objects by their fields, plain values of the same
    type."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, np.ndarray):  # open-instruct's client state keeps numpy's RNG state
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and np.array_equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (
            f"{where}: {list(got) if isinstance(got, dict) else got} != {list(want)}"
        )
        for key in want:
            assert_same_state(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_state(g, w, f"{where}[{i}]")
    elif hasattr(want, "__dict__") and not isinstance(want, type):
        assert type(got) is type(want), where
        assert_same_state(vars(got), vars(want), where)
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"
