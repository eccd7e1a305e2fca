"""Fixtures of the core tests. The 2-rank FSDP run is slow, so it runs once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import build_once
from tests.core import _workers
from tests.core.util import run_worker


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def trained_state() -> dict[str, Any]:
    """A tiny transformer, AdamW, StepLR and a resumable sampler after three training steps."""
    state = _workers.build_training_state(seed=3)
    batches = iter(state["sampler"])
    for _ in range(3):
        tokens = torch.tensor([[next(batches) % 32 for _ in range(8)] for _ in range(2)])
        state["model"](tokens).logsumexp(-1).mean().backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state["scheduler"].step()
    return state


@pytest.fixture(scope="session")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank gloo FSDP2 run saved at step 3 (`run/`), its single-process re-save (`single/`), and what
    2 fresh ranks restored from each; see `_workers.fsdp`."""
    return build_once(tmp_path_factory, "fsdp", _fsdp_run)


def _fsdp_run(root: Path) -> Path:
    run_worker("fsdp", str(root), timeout=240)
    return root
