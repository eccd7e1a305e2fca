"""verl 0.9.1's own resume of a `global_step_N/` folder, on the 2 gloo CPU ranks it was saved on.

What verl's PPO trainer does on resume (`verl/trainer/ppo/ray_trainer.py: RayPPOTrainer._load_checkpoint`): each
role's worker calls `verl/utils/checkpoint/fsdp_checkpoint_manager.py: FSDPCheckpointManager.load_checkpoint` on
`global_step_N/actor` and `global_step_N/critic` (its rank's `model_/optim_/extra_state_world_size_W_rank_R.pt`:
weights, optimizer, LR scheduler and RNG), then the driver `torch.load`s `data.pt` into the data loader, or
prints "No dataloader state found ..., will start from scratch" and goes on without it (here: that state is
missing from what was restored).

The actor and critic are built afresh for each cell from the run's base model as `tests.writers.verl_writer`
builds them (FSDP2 on verl's meshes: the actor on `("fsdp",)`, the critic on `("ddp", "fsdp")` of (2, 1)); each
rank compares its own shards (`DTensor.to_local`), the optimizer's and scheduler's state, its CPU RNG state and
the data loader state.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.faults.cells import loader_verdicts
from tests.faults.loaders.common import local_shards
from tests.faults.loaders.ranks import run_ranks

WORLD = 2


def join(rank: int, world: int, port: int) -> None:
    from tests.writers.verl_ranks import join_verl_ranks

    join_verl_ranks(rank, world, port)


def load(path: str, options: Mapping[str, Any]) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    # verl's create_device_mesh, per load: the group may be new (tests.faults.loaders.ranks)
    meshes = {
        "actor": init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",)),
        "critic": init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("ddp", "fsdp")),
    }
    base = options["base"]
    tokenizer = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(1234)  # other generators than the saved ones: a skipped RNG restore shows
    state: dict[str, Any] = {}
    for role in ("actor", "critic"):
        if role == "actor":
            model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        else:
            model = AutoModelForTokenClassification.from_pretrained(base, num_labels=1, torch_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=meshes[role])
        fully_shard(model, mesh=meshes[role])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        manager = FSDPCheckpointManager(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, processing_class=tokenizer, checkpoint_config={}
        )
        manager.load_checkpoint(os.path.join(path, role))
        state[role] = {
            "model": local_shards(model.state_dict()),
            "optimizer": local_shards(optimizer.state_dict()),
            "scheduler": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"},
        }
    state["rng"] = torch.get_rng_state()
    data = os.path.join(path, "data.pt")
    if os.path.exists(data):  # RayPPOTrainer._load_checkpoint: torch.load(..., weights_only=False)
        state["dataloader"] = torch.load(data, weights_only=False)
    return state


def build(checkpoint: Path, _out: Path) -> dict[str, str]:
    """verl's verdict on each cell of the run's `global_step_N/` (actor, critic, data.pt)."""
    base = checkpoint.parent.parent / "base"
    return loader_verdicts(__name__, checkpoint, base=str(base), loggers=["verl"])


if __name__ == "__main__":
    run_ranks("tests.faults.loaders.verl", WORLD, sys.argv[1])
