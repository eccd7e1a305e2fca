"""How `engine.load_checkpoint` resumes a DeepSpeed tag: it follows `latest`, and ZeRO 1-3 load only on
the data-parallel size they were saved with (else a universal checkpoint first).

The frameworks built on DeepSpeed (OpenRLHF, open-instruct, the Trainer with DeepSpeed) reuse
`world_size`, `IMPACTS` and `pointer_caveat` in their own profiles.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, Component
from ckptctl.frameworks.deepspeed.names import MODEL_STATES, OPTIM_STATES
from ckptctl.layouts.resume import PlanContext, ResumeProfile, WorldSizeCheck, target_ranks

__all__ = ["IMPACTS", "PROFILE", "pointer_caveat", "world_size", "zero_facts"]


def zero_facts(checkpoint: Checkpoint) -> Mapping[str, Any]:
    """The tag's facts (`tag`, `zero_stage`, `dp_world_size`, ...) as the layouts record them: at the top of
    a tag's metadata, under `deepspeed` in a Trainer checkpoint's; empty when it holds no DeepSpeed tag."""
    metadata = checkpoint.metadata
    if "zero_stage" in metadata:
        return metadata
    inner = metadata.get("deepspeed")
    return inner if isinstance(inner, Mapping) else {}


def _tag_url(checkpoint: Checkpoint) -> str:
    """The DeepSpeed tag folder: the checkpoint itself, or the one inside a Trainer checkpoint."""
    tag = zero_facts(checkpoint).get("tag")
    if isinstance(tag, str) and tag != io.name_of(checkpoint.url) and io.is_dir(io.join(checkpoint.url, tag)):
        return io.join(checkpoint.url, tag)
    return checkpoint.url


def world_size(ctx: PlanContext) -> WorldSizeCheck:
    """Without ZeRO any multiple of the model-parallel size loads the tag; with ZeRO only the saved
    data-parallel size does, unless the tag is converted to a universal checkpoint first."""
    info = zero_facts(ctx.checkpoint)
    stage, dp, mp = info.get("zero_stage"), info.get("dp_world_size"), info.get("mp_world_size") or 1
    saved = dp * mp if isinstance(dp, int) and isinstance(mp, int) else ctx.checkpoint.world_size
    target = target_ranks(ctx, saved)
    files = ctx.checkpoint.files
    model = [s for n, s in files.items() if MODEL_STATES.match(n.rpartition("/")[2])]
    optim = [s for n, s in files.items() if OPTIM_STATES.match(n.rpartition("/")[2])]
    per_rank = (sum(model) // len(model) if model else 0) + (sum(optim) // len(optim) if optim else 0)
    if target is None or saved is None or not isinstance(stage, int):
        return WorldSizeCheck(saved, target, None, "the DeepSpeed data-parallel size is not recorded")
    if stage == 0:
        ok = target % mp == 0
        note = f"without ZeRO the optimizer state is whole in the model-states file: any multiple of the model-parallel size ({mp}) loads it"
        return WorldSizeCheck(saved, target, ok, note, bytes_per_rank=per_rank if ok else None)
    if target == saved:
        note = f"the same data-parallel size ({dp}) as saved: each rank reads its own rank files"
        return WorldSizeCheck(saved, target, True, note, bytes_per_rank=per_rank)
    tag_url = _tag_url(ctx.checkpoint)
    universal = f"{tag_url.rstrip('/')}_universal"
    fix = (
        f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {tag_url} --output_folder {universal}; "
        'then set "checkpoint": {"load_universal": true} in the DeepSpeed config (load_checkpoint then follows '
        f"{io.join(io.parent_of(universal), 'latest_universal')})"
    )
    note = (
        f"ZeRO-{stage} partitions the optimizer state over {dp} data-parallel rank(s) and cannot load on {target} "
        "(DeepSpeed#2898): convert it to a universal checkpoint first"
    )
    return WorldSizeCheck(saved, target, False, note, fix=fix)


def _hint(ctx: PlanContext) -> str:
    tag = io.name_of(ctx.url)
    if ctx.world is not None and ctx.world.ok is False and ctx.world.fix:
        return (
            f'engine.load_checkpoint("{io.parent_of(ctx.url)}", tag="{tag}_universal") with "checkpoint": '
            f'{{"load_universal": true}}, once ds_to_universal has converted {tag} into {tag}_universal'
        )
    return f'engine.load_checkpoint("{io.parent_of(ctx.url)}", tag="{tag}")'


IMPACTS: Mapping[Component, str] = {
    Component.RNG: "DeepSpeed saves no RNG state: dropout and sampling draw other numbers than an uninterrupted "
    "run (save them in client_state to keep them)",
    Component.DATALOADER: "no data sampler state (DeepSpeed saves one only for its own data loader): the data "
    "order restarts unless the training code skips consumed samples",
}


def pointer_caveat(ctx: PlanContext, pointer: str) -> str:
    """What to do first when the framework follows `latest` and it names another tag than the chosen one."""
    named = next((r for r in ctx.refs if r.latest and io.parent_of(r.url) == io.parent_of(ctx.url)), None)
    if named is not None and named.url == ctx.url:
        return ""
    return f" (it loads the tag `{pointer}` names: write {io.name_of(ctx.url)} into {pointer} first)"


PROFILE = ResumeProfile(
    framework="DeepSpeed",
    hint=_hint,
    world_size=world_size,
    impacts=IMPACTS,
    follows_pointer=True,
)
