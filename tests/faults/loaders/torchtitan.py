"""torchtitan 0.3.0's own `CheckpointManager.load` of a `step-N/` folder, on the one gloo CPU rank it was saved on.

What torchtitan's `Trainer` does on resume (torchtitan/trainer.py: `checkpointer.load(step=config.checkpoint.
load_step)`; `torchtitan/components/checkpointer/dcp.py: CheckpointManager._load`): the model, optimizers, LR
schedulers, data loader and `train_state` as `tests.writers.torchtitan_writer` builds them, handed to a
`CheckpointManager` whose folder holds the cell's copy (and nothing else), then `load()`: `dcp_load` of every
state from the highest `step-N/`. Everything is built afresh per cell (the writer's seed, not the saved weights); the state compared is
each container's `state_dict()`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.faults.cells import loader_verdicts
from tests.faults.loaders.ranks import TIMEOUT, run_ranks
from tests.writers.ranks import join_gloo

WORLD = 1


def join(rank: int, world: int, port: int) -> None:
    from tests.writers import torchtitan_writer as writer
    from tests.writers.stand_ins import StandIns

    sys.meta_path.append(StandIns("torchtitan", writer._STOOD_IN, writer._stand_in))
    join_gloo(rank, world, port=port, timeout=TIMEOUT)


def load(path: str, options: Mapping[str, Any]) -> Any:
    import torch
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    from tests.writers import torchtitan_writer as writer

    config = writer._model_config()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=writer.STEPS)
    tokens = torch.arange(writer.STEPS * 9).reshape(writer.STEPS, 9) % writer.VOCAB
    dataloader = ParallelAwareDataloader(
        torch.utils.data.TensorDataset(tokens), dp_rank=0, dp_world_size=1, batch_size=1
    )
    train_state = writer._TrainState()
    folder = Path(path)
    checkpointer = CheckpointManager(
        CheckpointManager.Config(enable=True, interval=1, folder=folder.parent.name),
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=Llama3StateDictAdapter(config, None),
        base_folder=str(folder.parent.parent),
    )
    try:
        # The trainer's default `load_step=-1`: the highest `step-N` holding `.metadata` (`_find_load_step`),
        # which in the cell's copy is this one, or none (a fresh start, without an error).
        checkpointer.load()
    finally:
        checkpointer.close()
    return {
        "model": model.state_dict(),
        "optimizer": optimizers.state_dict(),
        "lr_scheduler": schedulers.state_dict(),
        "dataloader": dataloader.state_dict(),
        "train_state": train_state.state_dict(),
    }


def build(checkpoint: Path, _out: Path) -> dict[str, str]:
    """torchtitan's verdict on each cell of a `step-N/` of the run."""
    return loader_verdicts(__name__, checkpoint, loggers=["torchtitan"])


if __name__ == "__main__":
    run_ranks("tests.faults.loaders.torchtitan", WORLD, sys.argv[1])
