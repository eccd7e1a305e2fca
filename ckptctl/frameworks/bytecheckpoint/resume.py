"""How a run resumes from a ByteCheckpoint save (bytecheckpoint 0.0.2, `api/load.py`, `checkpointer/`).

- `bcp.load(path, {"model": model, "optimizer": optimizer, "extra_state": {}}, framework=...)` loads the step
  folder it is given; `find_latest_ckpt_path(ckpt_path)` (`utilities/ckpt_format/common_utils.py`) is the
  `global_step_N` the tracker names, the usual `path`. The framework must be the one the run saved with
  (`fsdp`, `fsdp2` or `ddp`): the checkpoint does not record it.
- Model and optimizer reshard at load: ByteCheckpoint's load planner reads each rank's part of the tensors
  from the chunks DCP's metadata places, on any number of ranks. The extra state does not: each rank loads
  `extra_state_rank_{R}.pt`, and a rank without its own file loads rank 0's ("ByteCheckpoint does not
  guarantee extra_state reshard correctness").
"""

from __future__ import annotations

from ckptctl import io
from ckptctl.checkpoint import Component
from ckptctl.contract.resume import PlanContext, ResumeProfile, WorldSizeCheck, target_ranks
from ckptctl.frameworks.bytecheckpoint.files import EXTRA_STATE, STEP_RE, TRACKER, tracker_of
from ckptctl.quoting import Code, comment, python_call

__all__ = ["PROFILE"]


def _run(url: str) -> str:
    """The save path `bcp.save` was given: the folder of the step folders and the tracker."""
    return io.parent_of(url) if STEP_RE.match(io.name_of(url)) else url


def _hint(ctx: PlanContext) -> str:
    components = {"model": Code("model")}
    if Component.OPTIMIZER in ctx.checkpoint.components:
        components["optimizer"] = Code("optimizer")
    if any(rel.startswith(f"{EXTRA_STATE}/") for rel in ctx.checkpoint.files):
        components["extra_state"] = Code("{}")
    state = Code("{" + ", ".join(f"{key!r}: {value}" for key, value in components.items()) + "}")
    call = python_call("bcp.load", ctx.url, state, framework=Code("FRAMEWORK"))
    return call + comment("FRAMEWORK: what the run saved with ('fsdp', 'fsdp2' or 'ddp'); the checkpoint does not say")


def _world_size(ctx: PlanContext) -> WorldSizeCheck:
    saved = ctx.checkpoint.world_size
    target = target_ranks(ctx, saved) or 1
    total = sum(e.nbytes for e in ctx.checkpoint.tensors())
    note = f"ByteCheckpoint reshards the model and optimizer at load: {target} rank(s) each read their part"
    if saved is not None and target != saved and any(rel.startswith(f"{EXTRA_STATE}/") for rel in ctx.checkpoint.files):
        note += (
            f"; the extra state does not reshard: ranks without an extra_state_rank_R.pt of their own (saved on "
            f"{saved}) load rank 0's"
        )
    return WorldSizeCheck(saved, target, True, note, bytes_per_rank=total // target)


def _notes(ctx: PlanContext) -> list[str]:
    tracker = tracker_of(_run(ctx.url))
    step = ctx.checkpoint.ref.step
    if tracker is None or step is None or not STEP_RE.match(io.name_of(ctx.url)):
        return []
    if tracker != step:
        return [f"{TRACKER} names global_step_{tracker}: find_latest_ckpt_path would load that step, not this one"]
    return []


_IMPACTS = {
    Component.TRAINER_STATE: "the extra state holds no step counter: ByteCheckpoint restores what the training "
    "code put there, and the step is only in the folder name (global_step_N)",
    Component.RNG: "the extra state holds no RNG state: ByteCheckpoint saves only what the training code puts there",
    Component.SCHEDULER: "the extra state holds no LR scheduler: ByteCheckpoint saves only what the training code "
    "puts there",
}

PROFILE = ResumeProfile(
    framework="ByteCheckpoint",
    hint=_hint,
    world_size=_world_size,
    impacts=_IMPACTS,
    follows_pointer=True,
    run_of=_run,
    notes=_notes,
)
