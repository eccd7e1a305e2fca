"""Real torch DCP checkpoints for tests, written by torch itself.

- `write_fsdp_dcp`: 2 CPU ranks (torch.multiprocessing spawn + gloo), a small model sharded with FSDP2
  `fully_shard`, one AdamW step, then `dcp.save({"model": ..., "optim": ...})` of `get_state_dict`, the
  way torchtitan-style trainers save. The model has uneven and empty shards on purpose (11 rows over 2
  ranks, a 1-row layer). Rank 0 also gathers the full state dict (`full_state_dict=True`) and writes it
  as the reference the tests compare against.
- `write_single_process_dcp`: a plain `dcp.save(state_dict)` in this process (cheap), by default of a
  state dict with many dtypes, a 0-d tensor, an empty tensor, a transposed view and non-tensor values.

References are safetensors files (written by the safetensors package, not by ckptctl) under the same
flattened keys DCP uses (`model.l1.weight`, `optim.state.l1.weight.exp_avg`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.writers.ranks import join_gloo, run_ranks

__all__ = [
    "WrittenDcp",
    "flatten",
    "sample_state_dict",
    "sharded_tiny_net",
    "write_fsdp_dcp",
    "write_single_process_dcp",
]


@dataclass(frozen=True)
class WrittenDcp:
    """A DCP checkpoint written by torch and what it must contain.

    Attributes:
        path: the checkpoint folder.
        reference: safetensors file of every tensor, full (unsharded), under its flattened DCP key.
        model_parameters: number of elements of the model's parameters (not buffers).
        world_size: ranks that wrote it.
        non_tensor_keys: flattened keys of the non-tensor values (DCP bytes items).
    """

    path: Path
    reference: Path
    model_parameters: int
    world_size: int
    non_tensor_keys: tuple[str, ...]

    def reference_tensors(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.reference))


class TinyNet(torch.nn.Module):
    """Uneven on purpose: 11 embedding rows and a 5-row head split 6/5 and 3/2 over 2 ranks, and a
    1-row layer whose second shard is empty; a replicated int64 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.l1 = torch.nn.Linear(8, 12)
        self.norm = torch.nn.LayerNorm(12)
        self.head = torch.nn.Linear(12, 5, bias=False)
        self.gate = torch.nn.Linear(12, 1)
        self.register_buffer("counter", torch.arange(3, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.l1(self.embed(x))))
        return self.head(h) * torch.sigmoid(self.gate(h))


def sharded_tiny_net(world_size: int) -> TinyNet:
    """A `TinyNet` (seeded) sharded with FSDP2 over `world_size` CPU ranks, each linear layer and the embedding a
    unit of its own (the process group is up)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyNet()
    mesh = init_device_mesh("cpu", (world_size,))
    for module in (model.embed, model.l1, model.head, model.gate):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts (and lists of dicts) into dotted keys, as DCP's default planner does."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        elif isinstance(value, list) and any(isinstance(v, Mapping | torch.Tensor) for v in value):
            out.update(flatten({str(i): v for i, v in enumerate(value)}, f"{name}."))
        else:
            out[name] = value
    return out


def _save_reference(flat: Mapping[str, Any], path: Path) -> tuple[str, ...]:
    from safetensors.torch import save_file

    tensors = {k: v.detach().clone().contiguous() for k, v in flat.items() if isinstance(v, torch.Tensor)}
    save_file(tensors, str(path))
    return tuple(sorted(k for k, v in flat.items() if not isinstance(v, torch.Tensor)))


def _fsdp_worker(rank: int, world_size: int, rendezvous: str, path: str, reference: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    join_gloo(rank, world_size, rendezvous=rendezvous)
    try:
        model = sharded_tiny_net(world_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(1 + rank)
        model(torch.randint(0, 11, (4, 3))).sum().backward()
        optimizer.step()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd, "trainer_state": {"step": 1}}, checkpoint_id=path)
        full_model, full_optim = get_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            flat = flatten({"model": full_model, "optim": full_optim, "trainer_state": {"step": 1}})
            keys = _save_reference(flat, Path(reference))
            params = sum(p.numel() for p in TinyNet().parameters())
            Path(reference).with_suffix(".json").write_text(json.dumps({"non_tensor_keys": keys, "params": params}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write_fsdp_dcp(root: Path, name: str = "step-1", world_size: int = 2) -> WrittenDcp:
    """Write a real FSDP2 DCP checkpoint `root/name` from `world_size` spawned CPU ranks.

    Takes a few seconds (each rank imports torch); use it from a session-scoped fixture.
    """
    root.mkdir(parents=True, exist_ok=True)
    path = root / name
    reference = root / f"{name}.reference.safetensors"
    rendezvous = root / f".{name}.rendezvous"
    run_ranks(_fsdp_worker, (world_size, str(rendezvous), str(path), str(reference)), world_size)
    rendezvous.unlink(missing_ok=True)
    info = json.loads(reference.with_suffix(".json").read_text())
    return WrittenDcp(path, reference, info["params"], world_size, tuple(info["non_tensor_keys"]))


def sample_state_dict() -> dict[str, Any]:
    """A raw (unprefixed) state dict covering the dtypes, shapes and views DCP stores differently."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 4, generator=g)
    return {
        "weight": torch.randn(4, 3, generator=g),
        "half": torch.randn(5, generator=g).to(torch.float16),
        "brain": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "double": torch.randn(3, generator=g).double(),
        "ids": torch.arange(7, dtype=torch.int64),
        "small": torch.arange(5, dtype=torch.int8) - 2,
        "bytes": torch.arange(9, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
        "wide": torch.arange(4, dtype=torch.int32).to(torch.uint16),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "transposed": base.t(),  # a full view in another order: saved with its strides
        "rows": base[2:5],  # a partial view: DCP clones it before saving
        "step": 7,
        "name": "tiny",
    }


def write_single_process_dcp(path: Path, state_dict: Mapping[str, Any] | None = None) -> WrittenDcp:
    """`dcp.save(state_dict)` in this process (no process group); the reference is written beside it."""
    import torch.distributed.checkpoint as dcp

    state = dict(sample_state_dict() if state_dict is None else state_dict)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in non-distributed mode"
        dcp.save(state, checkpoint_id=str(path))
    reference = path.parent / f"{path.name}.reference.safetensors"
    keys = _save_reference(flatten(state), reference)
    return WrittenDcp(path, reference, 0, 1, keys)
