"""The core on a CUDA machine: GPU tensors and CUDA generator states survive a save and a restore.

CI has no GPU, so these tests skip there; they run wherever `torch.cuda.is_available()` (the project's
GPU checks run them on a lent H100). What a user relies on: a model and optimizer living on the GPU
restore onto the GPU with the exact values saved (async saves included, where the copy to the host is
the only part the loop waits for), and the CUDA random stream continues where it was saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptctl.core import CheckpointManager
from tests.core import _workers
from tests.core.util import assert_same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _trained_on_gpu(seed: int) -> dict[str, Any]:
    state = _workers.build_training_state(seed=seed)
    state["model"].cuda()
    # AdamW's moments are created on the parameters' device at the first step: they live on the GPU too.
    state["optimizer"] = torch.optim.AdamW(state["model"].parameters(), lr=1e-2)
    tokens = torch.randint(0, 32, (2, 8), device="cuda")
    state["model"](tokens).logsumexp(-1).mean().backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()
    return {"model": state["model"], "optimizer": state["optimizer"]}


def _host_copy(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: v.detach().cpu().clone() for k, v in state["model"].state_dict().items()},
        "optimizer": _to_cpu(state["optimizer"].state_dict()),
    }


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_gpu_model_and_optimizer_restore_on_the_gpu_exactly(tmp_path: Path, async_save: bool) -> None:
    state = _trained_on_gpu(seed=5)
    saved = _host_copy(state)
    manager = CheckpointManager(tmp_path / "run", async_save=async_save)
    manager.save(1, state)
    # The loop goes on at once and changes the GPU tensors in place: the checkpoint keeps the values of save().
    with torch.no_grad():
        for param in state["model"].parameters():
            param.add_(1.0)
    manager.wait()

    fresh = _trained_on_gpu(seed=6)
    assert CheckpointManager(tmp_path / "run").restore(fresh) == 1
    assert all(p.is_cuda for p in fresh["model"].parameters())
    moments = [t for s in fresh["optimizer"].state.values() for t in s.values() if t.dim() > 0]
    assert moments and all(t.is_cuda for t in moments)
    assert_same(saved, _host_copy(fresh))


def test_cuda_random_stream_continues_after_restore(tmp_path: Path) -> None:
    torch.cuda.manual_seed_all(7)
    torch.rand(5, device="cuda")  # move the stream away from the seed
    manager = CheckpointManager(tmp_path / "run")
    manager.save(1, {"w": torch.zeros(2)})
    expected = torch.rand(8, device="cuda").cpu()

    torch.cuda.manual_seed_all(99)  # what a fresh process would start with
    state: dict[str, Any] = {"w": None}
    CheckpointManager(tmp_path / "run").restore(state)
    assert torch.equal(torch.rand(8, device="cuda").cpu(), expected)


def test_a_gpu_checkpoint_restores_on_a_cpu_only_state(tmp_path: Path) -> None:
    """A checkpoint saved from the GPU loads into a CPU model (evaluation or conversion hosts have no GPU)."""
    state = _trained_on_gpu(seed=8)
    saved = _host_copy(state)
    CheckpointManager(tmp_path / "run").save(1, state)
    cpu_state = _workers.build_training_state(seed=9)
    cpu_state = {"model": cpu_state["model"], "optimizer": cpu_state["optimizer"]}
    CheckpointManager(tmp_path / "run").restore(cpu_state)
    assert all(not p.is_cuda for p in cpu_state["model"].parameters())
    assert_same(saved["model"], {k: v.clone() for k, v in cpu_state["model"].state_dict().items()})


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


def test_async_staging_pins_only_the_buffers_of_device_tensors() -> None:
    from ckptctl.core.snapshot import Stager

    stager = Stager()
    host, device = torch.arange(6.0), torch.arange(6.0, device="cuda")
    host_buffer, device_buffer = stager.stage("host", host), stager.stage("device", device)
    stager.finish()
    assert device_buffer.is_pinned() and not host_buffer.is_pinned()
    assert torch.equal(host_buffer, host) and torch.equal(device_buffer, device.cpu())
