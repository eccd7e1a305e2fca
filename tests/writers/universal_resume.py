"""DeepSpeed itself resuming from `ckptctl reshard --to deepspeed-universal` on another number of gloo CPU ranks.

`resume_losses` runs three resumes of DeepSpeed 0.19.8 engines (the tiny Llama, AdamW + StepLR, bf16, the
suite's ZeRO-2 and ZeRO-3 configs, `tests.writers.deepspeed_writer`), each taking `STEPS` training steps on
the same fixed global batches (each rank its equal slice, so that the data-parallel mean gradient is the
full batch's whatever the number of ranks) and recording the global mean loss of each step:

1. `original`: 2 ranks load the 2-rank tag as it was saved (`load_checkpoint`, no conversion).
2. `to_1`: 1 rank loads ckptctl's universal conversion of that tag (`"load_universal": true`); right after
   loading, it saves a ZeRO tag of its own (1 rank) before stepping.
3. `to_2`: ckptctl converts that 1-rank tag, and 2 ranks load the conversion (`"load_universal": true`).

`to_1` runs first, in a 1-rank spawn; `original` and `to_2` then run in one 2-rank spawn, one engine each.

`to_1` must step as `original` does (2 -> 1) and `to_2` as `to_1` does (1 -> 2: the 1-rank save holds the
state `to_1` stepped from).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.writers.deepspeed_ranks import join_deepspeed_ranks
from tests.writers.deepspeed_writer import FROZEN_UNDER_ZERO3, _free_port
from tests.writers.ranks import run_ranks

__all__ = ["STEPS", "resume_losses"]

STEPS = 2
GLOBAL_BATCH = 4


def _rank(rank: int, world: int, port: int, jobs: list[tuple[int, str, bool, str | None, str]]) -> None:
    from tests.writers.models import tiny_llama

    join_deepspeed_ranks(rank, world, port)
    import deepspeed  # after joining, which picks DeepSpeed's CPU accelerator

    for stage, load_dir, universal, save_to, out in jobs:
        model = tiny_llama()
        if stage == 3:
            model.get_parameter(FROZEN_UNDER_ZERO3).requires_grad_(False)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": True},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10_000,
            "checkpoint": {"load_universal": universal},
        }
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
        path, _ = engine.load_checkpoint(load_dir)
        assert path is not None, f"nothing loaded from {load_dir}"
        if save_to is not None:
            engine.save_checkpoint(save_to)
        generator = torch.Generator().manual_seed(7)
        losses = []
        share = GLOBAL_BATCH // world
        for _ in range(STEPS):
            ids = torch.randint(0, 128, (GLOBAL_BATCH, 16), generator=generator)[rank * share : (rank + 1) * share]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            mean = loss.detach().float().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world)
        if rank == 0:
            Path(out).write_text(json.dumps({"losses": losses, "global_steps": engine.global_steps}))
        deepspeed.comm.barrier()
        del engine


def _spawn(world: int, jobs: list[tuple[int, str, bool, str | None, str]]) -> None:
    run_ranks(_rank, (world, _free_port(), jobs), world)


def resume_losses(root: Path, tags: dict[int, Path], reshard: Callable[[Path, Path], None]) -> dict[str, Any]:
    """The losses of each resume (see the module), per ZeRO stage: `{"original"|"to_1"|"to_2": {stage:
    {"losses", "global_steps"}}}`; `tags`: stage -> a 2-rank tag; `reshard(src, dst)`: ckptctl's conversion.
    Tens of seconds: use it from a session-scoped fixture."""
    stages = sorted(tags)
    for stage in stages:
        reshard(tags[stage], root / f"uni2-zero{stage}")
    _spawn(
        1,
        [
            (s, str(root / f"uni2-zero{s}"), True, str(root / f"save1-zero{s}"), str(root / f"to_1-{s}.json"))
            for s in stages
        ],
    )
    for stage in stages:
        reshard(root / f"save1-zero{stage}", root / f"uni1-zero{stage}")
    # `original` needs nothing `to_1` wrote: its jobs ride in `to_2`'s 2-rank spawn (each job builds its own engine),
    # which saves two processes that import torch and DeepSpeed.
    original = [(s, str(tags[s].parent), False, None, str(root / f"original-{s}.json")) for s in stages]
    _spawn(
        2, [*original, *((s, str(root / f"uni1-zero{s}"), True, None, str(root / f"to_2-{s}.json")) for s in stages)]
    )
    return {
        run: {stage: json.loads((root / f"{run}-{stage}.json").read_text()) for stage in stages}
        for run in ("original", "to_1", "to_2")
    }
