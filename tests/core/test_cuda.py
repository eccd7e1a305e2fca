"""A training state on a CUDA device: saved (sync, and async through pinned host buffers) and restored onto
its device, with the CUDA generators. Runs only where CUDA is available (skipped on CPU-only CI)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptctl.core import CheckpointManager
from tests.core.util import assert_same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64, device="cuda")).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return {"model": model, "optimizer": optimizer, "buffer": {"ema": torch.randn(16, device="cuda")}}


def on_host(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: v.cpu() for k, v in state["model"].state_dict().items()},
        "exp_avg": [state["optimizer"].state[p]["exp_avg"].cpu() for p in state["model"].parameters()],
    }


@pytest.mark.parametrize("async_save", [False, True])
def test_cuda_state_restores_onto_its_device_with_the_cuda_generators(tmp_path: Path, async_save: bool) -> None:
    state = cuda_state(seed=0)
    saved, saved_ema = on_host(state), state["buffer"]["ema"].cpu()
    torch.cuda.manual_seed_all(123)
    manager = CheckpointManager(tmp_path / "run", async_save=async_save)
    manager.save(1, state)
    expected_draws = torch.rand(8, device="cuda").cpu()  # what the generator gives after the save
    with torch.no_grad():  # the loop goes on while an async save writes: the checkpoint keeps step 1
        for p in state["model"].parameters():
            p.add_(1.0)
    manager.wait()

    fresh = cuda_state(seed=1)
    torch.cuda.manual_seed_all(999)
    assert manager.restore(fresh) == 1
    assert torch.equal(torch.rand(8, device="cuda").cpu(), expected_draws)
    assert all(p.is_cuda for p in fresh["model"].parameters())
    assert all(s["exp_avg"].is_cuda for s in fresh["optimizer"].state.values())
    assert_same(saved, on_host(fresh))
    assert torch.equal(fresh["buffer"]["ema"].cpu(), saved_ema)  # a plain value comes back as saved
