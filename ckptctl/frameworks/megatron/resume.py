"""How Megatron-LM resumes a dist-ckpt (`--load <save> --ckpt-format torch_dist`): it follows the tracker
(`--ckpt-step N` picks another iteration), and the sharded state reshards onto another parallelism at load,
except a distributed optimizer's state saved `dp_reshardable`, which only changes its data-parallel size.

Megatron-LM `megatron/training/checkpointing.py` (`load_checkpoint`, `_load_base_checkpoint`): a release
checkpoint, or `--finetune`, loads the weights only and starts at iteration 0 (no optimizer, scheduler or RNG
state); `--no-load-optim` / `--no-load-rng` skip those states. megatron-core
`optimizer/distrib_optimizer.py` `DistributedOptimizer.sharded_state_dict`: "dp_reshardable ... allows
checkpoint resharding only in DP dimension".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Component
from ckptctl.contract.resume import PlanContext, ResumeProfile, WorldSizeCheck, target_ranks
from ckptctl.families.dcp_resume import overwrite_warnings
from ckptctl.frameworks.megatron.files import RELEASE, iteration_of, read_tracker
from ckptctl.quoting import shell

__all__ = ["PROFILE"]


def _parallelism(ctx: PlanContext) -> Mapping[str, Any]:
    found = ctx.checkpoint.metadata.get("parallelism")
    return found if isinstance(found, Mapping) else {}


def _size(facts: Mapping[str, Any], key: str) -> int:
    value = facts.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _world_size(ctx: PlanContext) -> WorldSizeCheck:
    facts = _parallelism(ctx)
    saved_world = facts.get("world_size")
    saved = saved_world if isinstance(saved_world, int) else ctx.checkpoint.world_size
    target = target_ranks(ctx, saved)
    tp, pp, cp = (
        _size(facts, k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
    )
    model_parallel = tp * pp * cp
    total = sum(e.nbytes for e in ctx.checkpoint.tensors())
    per_rank = total // target if target else None
    layout = f"TP={tp}, PP={pp}" + (f", CP={cp}" if cp > 1 else "")
    if facts.get("distrib_optim_sharding_type") == "dp_reshardable":
        if target is None:
            return WorldSizeCheck(saved, target, None, "the number of ranks is not recorded")
        ok = target % model_parallel == 0
        note = (
            f"the distributed optimizer's state was saved dp_reshardable: only the data-parallel size may change, "
            f"so keep {layout} and use a multiple of {model_parallel} ranks"
        )
        fix = "" if ok else f"run on a multiple of {model_parallel} ranks with {layout}, or load with --no-load-optim"
        return WorldSizeCheck(saved, target, ok, note, fix=fix, bytes_per_rank=per_rank if ok else None)
    if target is not None and target % model_parallel:
        note = (
            f"dist-ckpt reshards at load: {target} rank(s) is no multiple of the saved {layout}, so choose a "
            "tensor/pipeline-parallel size that divides it (Megatron reshards the model and optimizer state)"
        )
    else:
        note = f"dist-ckpt reshards at load onto any parallelism (saved with {layout})"
    return WorldSizeCheck(saved, target, True, note, bytes_per_rank=per_rank)


def _hint(ctx: PlanContext) -> str:
    save = io.parent_of(ctx.url)
    name = io.name_of(ctx.url)
    words = ["--load", save, "--ckpt-format", "torch_dist"]
    iteration = iteration_of(name)
    if iteration is not None and read_tracker(save) != name:
        words += ["--ckpt-step", str(iteration)]
    return shell(*words)


def _notes(ctx: PlanContext) -> list[str]:
    notes = []
    if io.name_of(ctx.url) == RELEASE:
        notes.append(
            "a release checkpoint: Megatron-LM loads its weights only and starts at iteration 0 (no optimizer, "
            "scheduler or RNG state), as with --finetune"
        )
    return notes


PROFILE = ResumeProfile(
    framework="Megatron-LM",
    hint=_hint,
    world_size=_world_size,
    restored=frozenset(
        {
            Component.MODEL,
            Component.OPTIMIZER,
            Component.SCHEDULER,
            Component.RNG,
            Component.DATALOADER,
            Component.TRAINER_STATE,
        }
    ),
    follows_pointer=True,
    traps=overwrite_warnings,
    notes=_notes,
)
