"""megatron-core 0.16.1's own `dist_checkpointing.load` of an `iter_N/` folder, as Megatron-LM resumes it, on the
2 gloo CPU ranks (tensor parallel 2) it was saved on.

What Megatron-LM's `load_checkpoint` does with `--ckpt-format torch_dist` (NVIDIA/Megatron-LM
`megatron/training/checkpointing.py`: `_load_base_checkpoint` builds the sharded state dict of
`generate_state_dict` for loading and calls `dist_checkpointing.load(sharded_state_dict, checkpoint_name,
load_strategy)`; `load_checkpoint` then puts `model` in with `model.load_state_dict`, `optimizer` with
`optimizer.load_state_dict`, `opt_param_scheduler` with its `load_state_dict`, and reads `iteration`,
`num_floating_point_operations_so_far`, `args` and this rank's `rng_state`): the `GPTModel`, FP32 optimizer (with
megatron-core's Adam `init_state_fn`, `megatron/core/optimizer/__init__.py`, so that loading fills its moments)
and scheduler as `tests.writers.megatron_writer` builds them. Megatron-LM itself does not install here (only
megatron-core): its steps around the load are the ones cited. Each rank compares its own tensor-parallel part.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.faults.cells import loader_verdicts
from tests.faults.loaders.ranks import TIMEOUT, run_ranks
from tests.writers.ranks import join_gloo

WORLD = 2


def join(rank: int, world: int, port: int) -> None:
    import torch

    from tests.writers.megatron_writer import _cpu_rng_tracker

    # megatron-core's load strategies wait for devices and put their flags on the current one (see the writer).
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    join_gloo(rank, world, port=port, timeout=TIMEOUT)
    regroup()
    _cpu_rng_tracker()


def regroup() -> None:
    """megatron-core's own groups, on the (new) default group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)


def _init_adam_state(opt: Any, config: Any = None) -> None:
    """megatron-core's `init_state_fn` for Adam (megatron/core/optimizer/__init__.py: `_get_megatron_optimizer_
    based_on_param_groups`), which the writer's optimizer had no need of."""
    import torch

    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)


def load(path: str, options: Mapping[str, Any]) -> Any:
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    from tests.writers.megatron_writer import gpt_model, lr_scheduler

    torch.manual_seed(1234)  # other weights than the saved ones: a skipped tensor shows
    model = gpt_model(tied=False)
    config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, bf16=False, fp16=False)
    optimizer = FP32Optimizer.__new__(FP32Optimizer)  # as the writer builds it (FP32Optimizer's scale is CUDA's)
    inner = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.01)
    MegatronOptimizer.__init__(optimizer, inner, config, _init_adam_state)
    optimizer._scale = torch.tensor([1.0])
    optimizer.is_stub_optimizer = False
    scheduler = lr_scheduler(optimizer)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    model_state = model.sharded_state_dict()
    sharded = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True),
        "opt_param_scheduler": scheduler.state_dict(),
        "rng_state": ShardedObject("rng_state", [{}], (1, WORLD), (0, tp_rank), replica_id=0),
    }
    loaded = dist_checkpointing.load(sharded, path)
    model.load_state_dict(loaded["model"], strict=True)
    # `FP32Optimizer.load_state_dict`, less its `_filter_and_reorder_param_groups`, which matches param groups by
    # the keys Megatron's own `_get_param_groups` gives them (`wd_mult`, ...): the writer's optimizer has plain
    # torch param groups, as saved.
    optim_state = loaded["optimizer"]
    if "common_step" in optim_state["state"]:
        optimizer._restore_common_per_param_step(optim_state, optim_state["state"].pop("common_step"))
    optimizer.optimizer.load_state_dict(optim_state)
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    return {
        "model": {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng_state": loaded["rng_state"],
        "iteration": loaded["iteration"],
        "checkpoint_version": loaded["checkpoint_version"],
        "flops": loaded["num_floating_point_operations_so_far"],
        "args": vars(loaded["args"]),
    }


def build(checkpoint: Path, _out: Path) -> dict[str, str]:
    """megatron-core's verdict on each cell of an `iter_N/` of the TP-2 run."""
    return loader_verdicts(__name__, checkpoint, loggers=["megatron"])


if __name__ == "__main__":
    run_ranks("tests.faults.loaders.megatron", WORLD, sys.argv[1])
