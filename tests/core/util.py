"""Helpers shared by the core tests: running worker programs and comparing nested states."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]


def worker_env() -> dict[str, str]:
    # One thread per worker: the tests start several at once on small machines.
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def worker_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.core._workers", *args]


def run_worker(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run a worker program to completion; fail the test with its output if it fails."""
    done = subprocess.run(
        worker_command(*args), cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"worker {args} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Exact equality of nested states: tensors by value, dtype and shape; NaN equals NaN."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: {type(b)} is not a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, f"{where}: {b!r} is not a {a.dtype} array"
        assert np.array_equal(a, b), f"{where}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: {type(b)} is not a dict"
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{where}: {b!r} is not NaN"
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"
