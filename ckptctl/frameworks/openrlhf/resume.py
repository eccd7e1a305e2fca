"""How OpenRLHF resumes (`--load_checkpoint`): the actor's and the critic's DeepSpeed tags, each from its
own `latest`, under one `--ckpt_path`."""

from __future__ import annotations

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState
from ckptctl.frameworks.deepspeed import resume as deepspeed
from ckptctl.layouts.resume import PlanContext, ResumeProfile

__all__ = ["PROFILE"]


def _run(url: str) -> str:
    parent = io.parent_of(url)
    return io.parent_of(parent) if io.name_of(parent) in ("_actor", "_critic") else parent


def _critic(ref: CheckpointRef) -> bool:
    return io.name_of(io.parent_of(ref.url)) == "_critic"


def _notes(ctx: PlanContext) -> list[str]:
    """The critic loads from `_critic/latest` along with the actor: say when the two are out of step."""
    critic = next((r for r in ctx.refs if _critic(r) and r.latest), None)
    if critic is None:
        return []
    if critic.state is not CheckpointState.COMPLETE:
        return [f"the critic's `latest` names {io.name_of(critic.url)}, which is {critic.state.value}: its load fails"]
    if critic.step != ctx.checkpoint.ref.step:
        return [
            f"the critic resumes from {io.name_of(critic.url)} (step {critic.step}) and the actor from "
            f"{io.name_of(ctx.url)} (step {ctx.checkpoint.ref.step}): they are out of step"
        ]
    return []


def _hint(ctx: PlanContext) -> str:
    ckpt_path = _run(ctx.url)
    pointer = "_actor/latest" if io.name_of(io.parent_of(ctx.url)) == "_actor" else "latest"
    return (
        f"--load_checkpoint --ckpt_path {ckpt_path} (OpenRLHF >= 0.10.2: --ckpt.load_enable --ckpt.path {ckpt_path})"
        + deepspeed.pointer_caveat(ctx, pointer)
    )


PROFILE = ResumeProfile(
    framework="OpenRLHF",
    hint=_hint,
    world_size=deepspeed.world_size,
    run_of=_run,
    companion=_critic,
    notes=_notes,
    impacts=deepspeed.IMPACTS,
    follows_pointer=True,
)
