"""`reshard --to dcp` streams (issue 24: memory bounded by one parameter's row, whatever the model's size): the
DCP writer reads each source tensor only when its write item comes up and lets it go once written, so no two
tensors of the state are alive at once, and what it wrote loads with torch's own `dcp.load` equal to the state."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptctl.contract.capabilities import ParamState, ReshardRequest, StateTensor
from ckptctl.frameworks.dcp import reshard as dcp_reshard

SHAPES = {"embed.weight": (64, 8), "layer.weight": (8, 8), "layer.bias": (8,), "head.weight": (64, 8)}


class StreamedState:
    """A `ParamState` of known tensors whose reads check that every tensor read before has been let go."""

    def __init__(self) -> None:
        self.alive: list[tuple[str, weakref.ref[torch.Tensor]]] = []
        self.read_order: list[str] = []
        self.values: dict[str, torch.Tensor] = {}

    def tensor(self, key: str, shape: tuple[int, ...], seed: int) -> StateTensor:
        value = torch.arange(seed, seed + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) / 7
        self.values[key] = value

        def read() -> torch.Tensor:
            held = [name for name, ref in self.alive if ref() is not None]
            if held:  # held, or garbage of a reference cycle: a full collection (~0.1-0.2 CPU-s here) tells
                gc.collect()
                held = [name for name, ref in self.alive if ref() is not None]
            assert not held, f"{key} read while {held} still held"
            copy = value.clone()
            self.alive.append((key, weakref.ref(copy)))
            self.read_order.append(key)
            return copy

        return StateTensor("float32", shape, read)

    def state(self) -> ParamState:
        model = tuple(
            (name, self.tensor(f"model.{name}", shape, k * 1000)) for k, (name, shape) in enumerate(SHAPES.items())
        )
        optimizer: dict[str, dict[str, StateTensor | int | float]] = {
            name: {
                "step": self.tensor(f"optim.state.{name}.step", (), 3),
                "exp_avg": self.tensor(f"optim.state.{name}.exp_avg", shape, k * 1000 + 1),
                "exp_avg_sq": self.tensor(f"optim.state.{name}.exp_avg_sq", shape, k * 1000 + 2),
            }
            for k, (name, shape) in enumerate(SHAPES.items())
        }
        groups = (
            {"lr": 0.1, "weight_decay": 0.1, "params": ["embed.weight", "layer.weight", "head.weight"]},
            {"lr": 0.1, "weight_decay": 0.0, "params": ["layer.bias"]},
        )
        return ParamState(model, optimizer, groups, ())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(("file_bytes", "data_files"), [(1 << 26, 1), (1 << 10, 3)])
def test_each_tensor_is_read_when_written_and_let_go_and_the_folder_loads_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_bytes: int, data_files: int
) -> None:
    source = StreamedState()
    state = source.state()
    monkeypatch.setattr(dcp_reshard, "_state_of", lambda _source: state)
    monkeypatch.setattr(dcp_reshard, "FILE_BYTES", file_bytes)
    advanced: list[int] = []
    written = dcp_reshard.WRITER.write(
        ReshardRequest(source=Any, staging=str(tmp_path), world_size=None), advanced.append
    )  # type: ignore[arg-type]

    assert sorted(source.read_order) == sorted(source.values)
    assert written.tensors == len(source.values)
    assert sum(advanced) == written.bytes == sum(v.nbytes for v in source.values.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(written.files)
    assert len(written.files) == data_files + 1  # embed, layer (weight and bias: one row each), head; .metadata
    loaded: dict[str, Any] = {
        "model": {name: torch.zeros(shape) for name, shape in SHAPES.items()},
        "optim": {
            "state": {
                name: {"step": torch.zeros(()), "exp_avg": torch.zeros(shape), "exp_avg_sq": torch.zeros(shape)}
                for name, shape in SHAPES.items()
            },
            "param_groups": [
                {"lr": 0.0, "weight_decay": 0.0, "params": []},
                {"lr": 0.0, "weight_decay": 0.0, "params": []},
            ],
        },
    }
    dcp.load(loaded, checkpoint_id=str(tmp_path), no_dist=True)
    for name in SHAPES:
        assert torch.equal(loaded["model"][name], source.values[f"model.{name}"])
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["optim"]["state"][name][key], source.values[f"optim.state.{name}.{key}"])
    assert [g["params"] for g in loaded["optim"]["param_groups"]] == [list(g["params"]) for g in state.param_groups]
    assert [g["weight_decay"] for g in loaded["optim"]["param_groups"]] == [0.1, 0.0]
