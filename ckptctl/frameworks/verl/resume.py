"""How verl resumes (`RayPPOTrainer._load_checkpoint`, verl/trainer/ppo/ray_trainer.py, verl 0.9.1).

- `trainer.resume_mode=auto` (the default) loads the `global_step_N` folder that the run's tracker
  `latest_checkpointed_iteration.txt` names under `trainer.default_local_dir` (`find_latest_ckpt_path`); with
  no tracker it trains from scratch. Any other step: `trainer.resume_mode=resume_path
  trainer.resume_from_path=<global_step_N>` (the path must contain `global_step_`: the step is parsed from it).
- Each role loads `{model,optim,extra_state}_world_size_{W}_rank_{R}.pt` for its own world size and rank
  (`FSDPCheckpointManager.load_checkpoint`): only the world size it was saved with finds its files.
- `extra_state` restores the LR scheduler and the RNG states; `data.pt` the data loader (a missing one only
  warns); the critic loads from `critic/` when the run trains one.
"""

from __future__ import annotations

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, Component
from ckptctl.contract.resume import PlanContext, ResumeProfile, WorldSizeCheck, target_ranks
from ckptctl.frameworks.verl.files import STEP_RE, tracker_of
from ckptctl.quoting import comment, shell

__all__ = ["PROFILE"]


def _step_folder(url: str) -> str:
    """The `global_step_N` folder of a checkpoint (a role folder's parent)."""
    return url if STEP_RE.match(io.name_of(url)) else io.parent_of(url)


def _run(url: str) -> str:
    """`trainer.default_local_dir`: the folder of the step folders and the tracker ("." for a relative step
    folder given alone)."""
    return io.parent_of(_step_folder(url)) or "."


def _role_folder(ref: CheckpointRef) -> bool:
    """A role folder given directly loads as part of its step, not on its own."""
    return STEP_RE.match(io.name_of(ref.url)) is None


def _hint(ctx: PlanContext) -> str:
    step_folder = _step_folder(ctx.url)
    run = _run(ctx.url)
    tracker = tracker_of(run)
    step = ctx.checkpoint.ref.step
    if tracker is not None and step is not None and tracker[1] == step:
        setting = shell("trainer.resume_mode=auto", f"trainer.default_local_dir={run}")
        return setting + comment(f"its {tracker[0]} names global_step_{step}")
    return shell("trainer.resume_mode=resume_path", f"trainer.resume_from_path={step_folder}")


def _world_size(ctx: PlanContext) -> WorldSizeCheck:
    saved = ctx.checkpoint.world_size
    target = target_ranks(ctx, saved)
    ok = None if saved is None or target is None else saved == target
    return WorldSizeCheck(
        saved,
        target,
        ok,
        "verl loads model_/optim_/extra_state_world_size_{W}_rank_{R}.pt of its own world size: only the world "
        "size the checkpoint was saved with finds its files",
        fix="" if ok is not False or target is None else _reshard(ctx, saved, target),
    )


def _reshard(ctx: PlanContext, saved: int | None, target: int) -> str:
    """ckptctl's reshard of the step to `target` ranks (a new run folder holding the step and the tracker),
    which verl's own checkpoint manager loads there."""
    new_run = "NEW_RUN_DIR"
    command = shell("ckptctl", "reshard", _step_folder(ctx.url), new_run, "--world-size", str(target))
    return command + comment(
        f"then trainer.resume_mode=auto trainer.default_local_dir={new_run} on {target} ranks (FSDP2 saves; "
        f"or resume on the {saved} saved ranks)"
    )


def _notes(ctx: PlanContext) -> list[str]:
    tracker = tracker_of(_run(ctx.url))
    step = ctx.checkpoint.ref.step
    if tracker is None:
        return [
            "the run has no latest_checkpointed_iteration.txt: trainer.resume_mode=auto trains from scratch "
            "(verl does not write it with async_save); use resume_path"
        ]
    if step is not None and tracker[1] != step:
        return [f"{tracker[0]} names global_step_{tracker[1]}: resume_mode=auto would load that step, not this one"]
    return []


_IMPACTS = {
    Component.DATALOADER: "no data.pt: verl warns and the data loader starts the epoch over",
    Component.TRAINER_STATE: "verl saves no counters: it takes the step from the folder name (global_step_N)",
}

PROFILE = ResumeProfile(
    framework="verl",
    hint=_hint,
    world_size=_world_size,
    impacts=_IMPACTS,
    follows_pointer=True,
    run_of=_run,
    companion=_role_folder,
    notes=_notes,
)
