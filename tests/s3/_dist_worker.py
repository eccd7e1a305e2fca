"""Two gloo ranks (FSDP2 on CPU) save to a remote run, then restore it into freshly built state; then one
process restores it too. Writes `expected.pt`, `restored-2-ranks.pt` and `restored-1-process.pt` into LOCAL.

`main(ROOT, LOCAL)` in the test's process (the ranks are forked from the writers' pre-imported server,
`tests.writers.ranks`; the test process restores as the one process), or
`python -m tests.s3._dist_worker s3://bucket/run LOCAL` (with the S3 server's AWS_* variables set).
"""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch

from ckptctl.core import CheckpointManager
from tests.core._workers import ResumableSampler, _fsdp_model, _fsdp_state, _full_state, _init_group, _leave_group


def _manager(root: str, local: str) -> CheckpointManager:
    # Both ranks run on this machine and share one staging folder (their files differ).
    return CheckpointManager(root, staging_dir=os.path.join(local, "staging"))


def _rank(rank: int, world: int, root: str, local: str) -> None:
    _init_group(rank, world, local, "store")
    state = _fsdp_state(seed=0)
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)
    batches = iter(state["sampler"])
    for _ in range(3):
        x = torch.randn(4, 8) + next(batches)
        state["model"](x).pow(2).mean().backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state["scheduler"].step()
    _manager(root, local).save(3, state, metrics={"loss": 0.25})
    full = _full_state(state)
    if rank == 0:
        torch.save(full, os.path.join(local, "expected.pt"))
    state = _fsdp_state(seed=7)  # other weights, no optimizer state yet
    assert _manager(root, local).restore(state) == 3
    full = _full_state(state)
    if rank == 0:
        torch.save(full, os.path.join(local, "restored-2-ranks.pt"))
    _leave_group()


def main(root: str, local: str) -> None:
    from tests.writers.ranks import run_ranks

    os.makedirs(os.path.join(local, "staging"), exist_ok=True)
    run_ranks(_rank, (2, root, local), 2, environment={"OMP_NUM_THREADS": "1"})
    model = _fsdp_model(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": ResumableSampler(16, 5)}
    assert _manager(root, local).restore(state) == 3
    torch.save({"model": model.state_dict()}, os.path.join(local, "restored-1-process.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
