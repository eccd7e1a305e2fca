"""Values read back from universal checkpoints compared exactly: what the `reshard --to deepspeed-universal` tests
compare ckptctl's output with DeepSpeed's own `ds_to_universal` by."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["assert_same_value", "files"]


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def assert_same_value(a: Any, b: Any, where: str) -> None:
    """Equal values: tensors of the same dtype, shape and elements (bit for bit), dicts with the same keys in
    the same order, DeepSpeed's objects by their fields."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):  # open-instruct's client state keeps numpy's RNG state
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (
            f"{where}: {list(a)} != {list(b) if isinstance(b, dict) else b}"
        )
        for key in a:
            assert_same_value(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_value(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b), where
        assert_same_value(vars(a), vars(b), where)
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"
