"""How torchtitan resumes: `CheckpointManager.load(step=checkpoint.load_step)` (torchtitan 0.3.0,
`torchtitan/components/checkpointer/dcp.py`, `_load`).

- `--checkpoint.enable` with the run's `--dump_folder` and `--checkpoint.folder`: with `load_step` -1 (the
  default) it loads the highest `step-N` holding `.metadata` (`_find_load_step`), whatever it holds; a
  model-only last save (`last_save_model_only`, the default) is then taken and `dcp.load` fails on the
  optimizer and trainer keys it lacks, so an older step needs `--checkpoint.load_step N`.
- Model and optimizer are DCP: they reshard onto any number of ranks. The data loader's state does not:
  `ParallelAwareDataloader.load_state_dict` asserts the data-parallel degree it was saved with
  ("dataloader resharding is not supported yet"), unless `--checkpoint.exclude_from_loading dataloader`.
- Step 0 (the seed checkpoint) loads the model only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState, Component
from ckptctl.contract.resume import LatestPick, PlanContext, ResumeProfile, WorldSizeCheck, target_ranks
from ckptctl.families.dcp_resume import overwrite_warnings
from ckptctl.layouts import peek_dir
from ckptctl.quoting import comment, shell

__all__ = ["PROFILE"]


def _newest_step(ctx: PlanContext) -> int | None:
    """The step torchtitan's `_find_load_step` would take: the highest `step-N` of the run that has its
    `.metadata` (complete, whatever it holds)."""
    steps = [
        r.step
        for r in ctx.refs
        if r.step is not None
        and io.parent_of(r.url) == io.parent_of(ctx.url)
        and io.name_of(r.url) == f"step-{r.step}"
        and r.state is not CheckpointState.IN_PROGRESS
    ]
    return max(steps) if steps else None


def _hint(ctx: PlanContext) -> str:
    folder = io.parent_of(ctx.url)
    words = ["--dump_folder", io.parent_of(folder), "--checkpoint.enable", "--checkpoint.folder", io.name_of(folder)]
    step = ctx.checkpoint.ref.step
    if step is not None and step != _newest_step(ctx):
        words += ["--checkpoint.load_step", str(step)]
    world = ctx.world
    if world is not None and world.ok is False:
        words += ["--checkpoint.exclude_from_loading", "dataloader"]
    return shell(*words)


def _world_size(ctx: PlanContext) -> WorldSizeCheck:
    """DCP reshards the model and optimizer; the data loader's state loads on its saved data ranks only."""
    info = ctx.checkpoint.metadata
    saved = info.get("data_parallel_ranks") if isinstance(info.get("data_parallel_ranks"), int) else None
    saved = saved or ctx.checkpoint.world_size
    target = target_ranks(ctx, saved)
    total = sum(e.nbytes for e in ctx.checkpoint.tensors())
    per_rank = total // (target or 1)
    if saved is None or target is None or Component.DATALOADER not in ctx.checkpoint.components or target == saved:
        return WorldSizeCheck(
            saved, target, True, "model and optimizer are DCP: they reshard at load", bytes_per_rank=per_rank
        )
    return WorldSizeCheck(
        saved,
        target,
        False,
        f"the data loader state was saved by {saved} data-parallel ranks and torchtitan does not reshard it "
        "(ParallelAwareDataloader asserts the same dp degree)",
        fix=shell("--checkpoint.exclude_from_loading", "dataloader") + comment("the data order restarts"),
        bytes_per_rank=per_rank,
    )


def _traps(ctx: PlanContext) -> list[str]:
    found = overwrite_warnings(ctx)
    newest = _newest_step(ctx)
    step = ctx.checkpoint.ref.step
    if newest is not None and step is not None and newest != step:
        found.append(
            f"torchtitan's default load takes step-{newest}, the highest step folder, not this one: pass "
            f"--checkpoint.load_step {step} (a model-only last save fails to load as a resume point)"
        )
    if step == 0:
        found.append("step-0 is the seed checkpoint: torchtitan loads its model only and training starts at step 0")
    return found


_STEP_SEARCH = re.compile(r"step-(\d+)")


def _latest_pick(refs: Sequence[CheckpointRef]) -> LatestPick | None:
    """torchtitan 0.3.0 `CheckpointManager._find_load_step` (`checkpointer/dcp.py`): the highest `step-N` folder of
    the checkpoint folder holding `.metadata` or `model.safetensors.index.json`, whatever else it holds."""
    folders = {io.parent_of(r.url) for r in refs if r.layout == "torchtitan"}
    if len(folders) != 1:
        return None
    folder = folders.pop()
    steps = []
    for entry in peek_dir(folder) or []:
        if entry.is_dir and (m := _STEP_SEARCH.search(entry.name)):
            names = {e.name for e in peek_dir(io.join(folder, entry.name)) or () if not e.is_dir}
            if names & {".metadata", "model.safetensors.index.json"}:
                steps.append((int(m.group(1)), entry.name))
    if not steps:
        return None
    return LatestPick(
        io.join(folder, max(steps)[1]),
        "torchtitan's CheckpointManager._find_load_step (load_step -1) takes the highest step-N holding .metadata",
    )


PROFILE = ResumeProfile(
    framework="torchtitan",
    hint=_hint,
    world_size=_world_size,
    restored=frozenset(
        {Component.MODEL, Component.OPTIMIZER, Component.SCHEDULER, Component.DATALOADER, Component.TRAINER_STATE}
    ),
    impacts={
        Component.RNG: "torchtitan saves no RNG state: it seeds every run from --debug.seed (the same numbers "
        "as an uninterrupted run only where they depend on the seed and the step alone)",
    },
    export_name="torchtitan's model-only last save (last_save_model_only)",
    traps=_traps,
    latest_pick=_latest_pick,
)
