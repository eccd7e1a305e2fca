"""A training process that saves with `CheckpointManager` every 0.1 s until told to stop (test_prune_concurrency
prunes beside it), forked from the writers' pre-imported server (`tests.writers.ranks.run_ranks`): a process
that never saw the test's state, as a fresh interpreter is, without importing torch again (~1.8 CPU-s)."""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

from ckptctl.core import CheckpointManager

__all__ = ["save_until_stopped"]


def save_until_stopped(rank: int, run: str, stop: str, seconds: float, stdout: str, stderr: str) -> None:
    """Save steps 1, 2, ... of a small model into `run`, printing each step once saved (to the file `stdout`),
    until the file `stop` exists or `seconds` have passed; what it prints going to the files `stdout` and
    `stderr`."""
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 does for a fresh interpreter
    with open(stdout, "w") as out, open(stderr, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    try:
        manager = CheckpointManager(run)
        model = torch.nn.Linear(16, 16)
        state = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
        end = time.monotonic() + seconds
        step = 0
        while not os.path.exists(stop) and time.monotonic() < end:
            step += 1
            model.weight.data.add_(1.0)
            manager.save(step, state, metrics={"loss": 1.0 / step})
            print(step, flush=True)
            time.sleep(0.1)
    except BaseException:  # said in `stderr` (the rank's own wrapper would keep the traceback to itself)
        traceback.print_exc()
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
