"""A PEFT adapter restores no training state: it is loaded onto its base model (a new run, or inference)."""

from __future__ import annotations

from ckptctl.contract.resume import PlanContext, ResumeProfile, WorldSizeCheck
from ckptctl.quoting import Code, comment, python_call

__all__ = ["PROFILE"]


def _world_size(ctx: PlanContext) -> WorldSizeCheck:
    return WorldSizeCheck(None, ctx.target, True, "an adapter loads onto its base model on any number of ranks")


def _hint(ctx: PlanContext) -> str:
    call = python_call("PeftModel.from_pretrained", Code("base_model"), ctx.url)
    return call + comment("starts a new run: no training state")


PROFILE = ResumeProfile(
    framework="PEFT (an adapter)", hint=_hint, world_size=_world_size, resumable=False, export_name="a PEFT adapter"
)
