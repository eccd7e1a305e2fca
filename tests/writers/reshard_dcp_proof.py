"""The proof of `reshard --to dcp` (`ckptctl.frameworks.dcp.reshard.WRITER`), on gloo CPU ranks.

1. 2 ranks train an FSDP2 model with AdamW (two parameter groups: decay and no decay, as trainers build them)
   for two steps and save, each by its own framework's code: `dcp.save` of `get_state_dict` (`dcp/`, with a
   `trainer_state` beside it) and ckptctl's `CheckpointManager` (`native/step-2`, with an LR scheduler).
2. This process reshards both into DCP folders (`out-dcp/`, `out-native/`) with the writer.
3. On 1 and on 2 ranks, fresh models load each source by its own resume (`dcp.load` + `set_state_dict`;
   `CheckpointManager.restore`) and each output by `dcp.load` + `set_state_dict`, gather their full state
   (`full_state_dict=True`) and take one training step on the same batch: `results-{W}.pt` holds, per case,
   the state and the step's losses (before and after the step).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.writers.dcp_writer import sharded_tiny_net

__all__ = ["CASES", "DcpReshardProof", "prove_dcp_reshard"]

#: Each loaded case: (its name, the folder it loads from, how).
CASES = (
    ("source-dcp", "dcp", "dcp"),
    ("resharded-dcp", "out-dcp", "dcp"),
    ("source-native", "native", "native"),
    ("resharded-native", "out-native", "dcp"),
)


@dataclass(frozen=True)
class DcpReshardProof:
    root: Path
    written: dict[str, Any]

    def results(self, world_size: int) -> dict[str, Any]:
        return torch.load(self.root / f"results-{world_size}.pt", weights_only=True)  # written by the proof


def _model_and_optimizer(world_size: int) -> tuple[Any, Any]:
    model = sharded_tiny_net(world_size)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, betas=(0.8, 0.95)
    )
    return model, optimizer


def _step(model: Any, optimizer: Any, seed: int) -> tuple[float, float]:
    """One training step on a batch fixed by `seed` (the same on every rank): the loss before and after it."""
    generator = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, 11, (4, 3), generator=generator)
    loss = model(batch).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after = model(batch).square().mean()
    return float(loss), float(after)


def _train_worker(rank: int, world_size: int, rendezvous: str, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckptctl import CheckpointManager

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        model, optimizer = _model_and_optimizer(world_size)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for seed in (1, 2):
            _step(model, optimizer, seed)
            scheduler.step()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd, "trainer_state": {"step": 2}}, checkpoint_id=f"{root}/dcp")
        manager = CheckpointManager(f"{root}/native")
        manager.save(2, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
        manager.close()
    finally:
        dist.destroy_process_group()


def _load_worker(rank: int, world_size: int, rendezvous: str, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from ckptctl import CheckpointManager

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        results: dict[str, Any] = {}
        for name, folder, how in CASES:
            model, optimizer = _model_and_optimizer(world_size)
            if how == "native":
                CheckpointManager(f"{root}/{folder}").restore({"model": model, "optimizer": optimizer}, step=2)
            else:
                model_sd, optim_sd = get_state_dict(model, optimizer)
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, checkpoint_id=f"{root}/{folder}")
                set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_sd, optim_sd = get_state_dict(model, optimizer, options=full)
            losses = _step(model, optimizer, seed=3)
            results[name] = {"model": dict(model_sd), "optim": optim_sd, "losses": losses}
        if rank == 0:
            torch.save(results, f"{root}/results-{world_size}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(worker: Any, root: Path, world_size: int) -> None:
    import torch.multiprocessing as mp

    rendezvous = root / f".rendezvous-{worker.__name__}-{world_size}"
    rendezvous.unlink(missing_ok=True)
    mp.spawn(worker, args=(world_size, str(rendezvous), str(root)), nprocs=world_size)


def prove_dcp_reshard(root: Path) -> DcpReshardProof:
    from ckptctl.frameworks.dcp.reshard import WRITER
    from ckptctl.layouts import open_checkpoint
    from ckptctl.layouts.capabilities import ReshardRequest

    _spawn(_train_worker, root, 2)
    written: dict[str, Any] = {}
    for source, out in (("dcp", "out-dcp"), ("native/step-2", "out-native")):
        checkpoint = open_checkpoint(str(root / source))
        assert WRITER.refusal(checkpoint, None) is None
        os.makedirs(root / out)
        state = WRITER.write(ReshardRequest(checkpoint, str(root / out), None), lambda _n: None)
        written[source] = {
            "files": state.files,
            "tensors": state.tensors,
            "not_carried": [(n.what, n.why) for n in state.not_carried],
        }
    for world_size in (1, 2):
        _spawn(_load_worker, root, world_size)
    return DcpReshardProof(root, written)
