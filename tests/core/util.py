"""Helpers shared by the core tests: running worker programs and comparing nested states."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
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


def run_fresh_worker(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run a worker program to completion in a fresh interpreter (`python -m tests.core._workers`), for what only
    an interpreter of its own shows: atexit hooks at its end, the modules importing the core pulls in. Fail the
    test with its output if it fails."""
    done = subprocess.run(
        worker_command(*args), cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"worker {args} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


def run_worker(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run a worker program (`tests.core._workers.COMMANDS`) to completion in a process forked from the writers'
    pre-imported server (`tests.writers.ranks.run_ranks`): a process that never saw the test's state, as a fresh
    interpreter is, without importing torch again (2-3 CPU-seconds a worker). Fail the test with its output if
    it fails or runs past `timeout` seconds."""
    from tests.core._workers import run_command
    from tests.writers.ranks import run_ranks

    with tempfile.TemporaryDirectory() as folder:
        stdout, stderr = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        context = run_ranks(run_command, (list(args), stdout, stderr), 1, join=False)
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"ran past {timeout} s")
        except Exception as exc:
            # The worker and what it forked (save loops, a writer left running) end with the test: they are a
            # process group of their own (`run_command`). A child left running would save on for ever and hold
            # the pre-imported server open (its exit waits for every process it forked).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(context.processes[0].pid, signal.SIGKILL)
            context.processes[0].join()
            raise AssertionError(f"worker {args} failed ({exc}):\n{_read(stdout)}\n{_read(stderr)}") from exc
        return subprocess.CompletedProcess(args, 0, _read(stdout), _read(stderr))


def _read(path: str) -> str:
    """What the worker wrote to `path`; nothing when it failed before opening it."""
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


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
