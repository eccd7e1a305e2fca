"""ROLL's resume of a `checkpoint-N/` folder with its FSDP2 strategy, on the 2 gloo CPU ranks it was saved on.

ROLL does not install here: its load is written from its source (alibaba/ROLL @ 8eb27cc2) over the same files,
with torch's own DCP:

- `roll/pipeline/base_pipeline.py: BasePipeline.__init__`: `WorkerState.load_from_json(<ckpt>/pipeline,
  "pipeline")` (`roll/utils/worker_state.py`: `json.loads` of `worker_state_pipeline.json` into the pipeline's
  step, log history and key-value state). At that commit no code calls `WorkerState.load_rng_state` (the
  driver's `rng_state_pipeline.pth` is saved by `BasePipeline.save_checkpoint` and never read back).
- `roll/pipeline/base_worker.py: ActorWorker.initialize` calls the strategy's `load_checkpoint(<ckpt>)`,
  `CriticWorker.initialize` its `load_checkpoint(<ckpt>/critic)` (its cluster's name);
  `roll/distributed/strategy/fsdp2_strategy.py: FSDP2StrategyBase.load_checkpoint` loads `<dir>/dcp` when it is
  a folder (and silently nothing otherwise) through `_load_checkpoint_with_dcp`: `dcp.load({**model.state_dict(),
  "optimizer": optimizer, "scheduler": scheduler, "rng_state": {}})`, the RNG state set when one came back, then
  `model.load_state_dict(state, strict=False)` (missing keys only logged as a warning).

The models, optimizers and schedulers are built afresh per cell as `tests.writers.rl_runs` builds them (the tiny
Llama under FSDP2, AdamW, StepLR); each rank compares its own shards, the optimizers' and schedulers' state, its
CPU RNG state and the pipeline state.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.faults.cells import loader_verdicts
from tests.faults.loaders.common import local_shards
from tests.faults.loaders.ranks import TIMEOUT, run_ranks
from tests.writers.ranks import join_gloo

WORLD = 2


def join(rank: int, world: int, port: int) -> None:
    join_gloo(rank, world, port=port, timeout=TIMEOUT)


def _strategy_load(load_dir: str, mesh: Any) -> dict[str, Any]:
    """`FSDP2StrategyBase.load_checkpoint(load_dir)` of a freshly built actor or critic; what it then holds."""
    import logging

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    from tests.writers.models import tiny_llama

    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    checkpoint_dir = os.path.join(load_dir, "dcp")
    if os.path.isdir(checkpoint_dir):
        state: dict[str, Any] = {**model.state_dict(), "optimizer": optimizer, "scheduler": scheduler, "rng_state": {}}
        dcp.load(state_dict=state, checkpoint_id=checkpoint_dir)
        if state["rng_state"]:
            torch.set_rng_state(state["rng_state"]["cpu"])
        info = model.load_state_dict(state, strict=False)
        if info.missing_keys:
            logging.getLogger("roll").warning(f"Missing keys: {info.missing_keys}")
    return {
        "model": local_shards(model.state_dict()),
        "optimizer": local_shards(optimizer.state_dict()),
        "scheduler": scheduler.state_dict(),
    }


def load(path: str, options: Mapping[str, Any]) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    with open(os.path.join(path, "pipeline", "worker_state_pipeline.json"), encoding="utf-8") as f:
        pipeline = json.loads(f.read())
    torch.manual_seed(1234)  # other generators than the saved ones: a skipped RNG restore shows
    mesh = init_device_mesh("cpu", (WORLD,))  # per load: the group may be new (tests.faults.loaders.ranks)
    state = {"actor": _strategy_load(path, mesh), "critic": _strategy_load(os.path.join(path, "critic"), mesh)}
    return {**state, "rng": torch.get_rng_state(), "pipeline": pipeline}


def build(checkpoint: Path, _out: Path) -> dict[str, str]:
    """ROLL's (derived) verdict on each cell of a `checkpoint-N/` with `critic/` of the FSDP2 run."""
    return loader_verdicts(__name__, checkpoint, loggers=["roll"])


if __name__ == "__main__":
    run_ranks("tests.faults.loaders.roll", WORLD, sys.argv[1])
