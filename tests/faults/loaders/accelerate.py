"""accelerate's `checkpoint_N`, loaded by accelerate itself: `Accelerator.load_state(path)` (accelerate/accelerator.py:
load_state, then accelerate/checkpointing.py: load_accelerator_state: the model's weights, `optimizer.bin`,
`scheduler.bin`, the samplers, and `random_states_{process}.pkl`, whose failure it only logs at info level),
on one `Accelerator(cpu=True)` with the plain run's model, AdamW, StepLR and data loader prepared as
`tests.writers.accelerate_writer` prepares them, reused for every cell.

Before each cell the accelerator first loads the run's older `checkpoint_N` (`prior`), so that whatever the
cell's load skips shows as different from the reference load. The model's, optimizer's and scheduler's state
dicts, the generators it restores (python, numpy, torch CPU) and the step it restores are the state compared.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.faults.cells import loader_verdicts
from tests.faults.loaders.common import run

_prepared: dict[str, Any] = {}


def _prepare() -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from tests.writers.accelerate_writer import _batches
    from tests.writers.models import tiny_llama

    set_seed(0)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = torch.utils.data.DataLoader(_batches(), batch_size=2, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    _prepared.update(accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler)


def load(path: str, options: Mapping[str, Any]) -> Any:
    import numpy as np
    import torch

    if not _prepared:
        _prepare()
    accelerator = _prepared["accelerator"]
    accelerator.load_state(options["prior"])
    accelerator.load_state(path)
    return {
        "model": _prepared["model"].state_dict(),
        "optimizer": _prepared["optimizer"].state_dict(),
        "scheduler": _prepared["scheduler"].state_dict(),
        "step": accelerator.step,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }


def build(checkpoint: Path, prior: Path, _out: Path) -> dict[str, str]:
    """accelerate's verdict on each cell of a `checkpoint_N` of the plain run, `prior` its older one."""
    return loader_verdicts(__name__, checkpoint, prior=str(prior), loggers=["accelerate"])


if __name__ == "__main__":
    run(load)
