"""How DeepSpeed's own `engine.load_checkpoint` resumes a tag (the rules every framework that saves ZeRO
tags shares are `families.zero_tag.resume`'s). A universal checkpoint's profile is that of the framework
that wrote its tag (`universal_host.UNIVERSAL_PROFILE`).
"""

from __future__ import annotations

from ckptctl import io
from ckptctl.contract.resume import PlanContext, ResumeProfile
from ckptctl.families.zero_tag.resume import IMPACTS, LOAD_UNIVERSAL, is_universal, world_size
from ckptctl.quoting import comment, python_call

__all__ = ["PROFILE"]


def _hint(ctx: PlanContext) -> str:
    save_dir, tag = io.parent_of(ctx.url), io.name_of(ctx.url)
    if is_universal(ctx.checkpoint):
        return python_call("engine.load_checkpoint", save_dir, tag=tag) + comment(
            f"with {LOAD_UNIVERSAL} in the DeepSpeed config"
        )
    if ctx.world is not None and ctx.world.ok is False and ctx.world.fix:
        return python_call("engine.load_checkpoint", save_dir, tag=f"{tag}_universal") + comment(
            f"with {LOAD_UNIVERSAL}, once ds_to_universal has converted {tag} into {tag}_universal"
        )
    return python_call("engine.load_checkpoint", save_dir, tag=tag)


PROFILE = ResumeProfile(
    framework="DeepSpeed",
    hint=_hint,
    world_size=world_size,
    impacts=IMPACTS,
    follows_pointer=True,
)
