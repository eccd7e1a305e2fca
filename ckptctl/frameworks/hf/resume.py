"""A Hugging Face model folder restores no training state: a resume from it starts a new run."""

from __future__ import annotations

from ckptctl.contract.resume import PlanContext, ResumeProfile, WorldSizeCheck
from ckptctl.quoting import comment, python_call

__all__ = ["PROFILE"]


def _world_size(ctx: PlanContext) -> WorldSizeCheck:
    return WorldSizeCheck(None, ctx.target, True, "model weights load on any number of ranks")


def _hint(ctx: PlanContext) -> str:
    return python_call("AutoModelForCausalLM.from_pretrained", ctx.url) + comment("starts a new run: no training state")


PROFILE = ResumeProfile(framework="transformers (a model folder)", hint=_hint, world_size=_world_size, resumable=False)
