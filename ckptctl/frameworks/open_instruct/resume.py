"""How open-instruct resumes (`--checkpoint_state_dir`): the DeepSpeed tag `latest` names, after a
start-up that deletes the tags it deems incomplete."""

from __future__ import annotations

from ckptctl import io
from ckptctl.errors import CkptctlError
from ckptctl.frameworks.deepspeed import resume as deepspeed
from ckptctl.layouts.resume import PlanContext, ResumeProfile

__all__ = ["PROFILE"]


def _hint(ctx: PlanContext) -> str:
    return f"--checkpoint_state_dir {io.parent_of(ctx.url)}" + deepspeed.pointer_caveat(ctx, "latest")


def _notes(ctx: PlanContext) -> list[str]:
    """Its start-up deletes every `global_step*` folder with fewer entries than the fullest one."""
    save_dir = io.parent_of(ctx.url)
    try:
        tags = [e.name for e in io.list_dir(save_dir) if e.is_dir and e.name.startswith("global_step")]
        counts = {name: len(io.list_dir(io.join(save_dir, name))) for name in tags}
    except CkptctlError:
        return []
    if not counts:
        return []
    fullest = max(counts.values())
    doomed = sorted(name for name, count in counts.items() if count < fullest)
    if not doomed:
        return []
    chosen = io.name_of(ctx.url)
    what = f"{', '.join(doomed)}" + (
        f" (including {chosen}, the one this plan resumes from)" if chosen in doomed else ""
    )
    return [
        f"open-instruct's start-up deletes every global_step* folder with fewer entries than the fullest "
        f"({fullest}) and rewrites `latest`: it would delete {what}; copy them elsewhere first if you need them"
    ]


PROFILE = ResumeProfile(
    framework="open-instruct",
    hint=_hint,
    world_size=deepspeed.world_size,
    notes=_notes,
    impacts=deepspeed.IMPACTS,
    follows_pointer=True,
    export_name="an HF snapshot",
)
