"""How DeepSpeed's own `engine.load_checkpoint` resumes a tag (the rules every framework that saves ZeRO
tags shares are `layouts.parts.zero_tag.resume`'s). A universal checkpoint's profile (`UNIVERSAL_PROFILE`) is
that of the framework that wrote its tag (`universal.host_layout`), with the world-size rule of universal
checkpoints: the hints of those frameworks say how each loads one.
"""

from __future__ import annotations

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef
from ckptctl.frameworks.deepspeed.universal import host_layout, source_of
from ckptctl.frameworks.deepspeed.universal_states import OPTIMIZER_STATE, ZERO_DIR
from ckptctl.layouts import get_layout
from ckptctl.layouts.parts.zero_tag.names import MODEL_STATES
from ckptctl.layouts.parts.zero_tag.resume import IMPACTS, LOAD_UNIVERSAL, is_universal, world_size, zero_facts
from ckptctl.layouts.resume import PlanContext, ResumeProfile, WorldSizeCheck, target_ranks

__all__ = ["PROFILE", "UNIVERSAL_PROFILE"]


def _hint(ctx: PlanContext) -> str:
    tag = io.name_of(ctx.url)
    if is_universal(ctx.checkpoint):
        return f'engine.load_checkpoint("{io.parent_of(ctx.url)}", tag="{tag}") with {LOAD_UNIVERSAL} in the DeepSpeed config'
    if ctx.world is not None and ctx.world.ok is False and ctx.world.fix:
        return (
            f'engine.load_checkpoint("{io.parent_of(ctx.url)}", tag="{tag}_universal") with {LOAD_UNIVERSAL}, '
            f"once ds_to_universal has converted {tag} into {tag}_universal"
        )
    return f'engine.load_checkpoint("{io.parent_of(ctx.url)}", tag="{tag}")'


PROFILE = ResumeProfile(
    framework="DeepSpeed",
    hint=_hint,
    world_size=world_size,
    impacts=IMPACTS,
    follows_pointer=True,
)


# --------------------------------------------------------------------------------------------------
# Universal checkpoints: the profile of the framework that wrote the tag, with the universal world-size rule.
# --------------------------------------------------------------------------------------------------


def universal_world_size(ctx: PlanContext) -> WorldSizeCheck:
    """A universal checkpoint loads on any number of data-parallel ranks: each reads the rank-0 model states
    and its share of the parameters' states (under ZeRO-3 every parameter's files whole, then keeps its
    partition)."""
    info = zero_facts(ctx.checkpoint)
    stage, dp, mp = info.get("zero_stage"), info.get("dp_world_size"), info.get("mp_world_size") or 1
    saved = dp * mp if isinstance(dp, int) and isinstance(mp, int) else ctx.checkpoint.world_size
    target = target_ranks(ctx, saved)
    files = ctx.checkpoint.files
    model = [size for name, size in files.items() if "/" not in name and MODEL_STATES.match(name)]
    states = sum(size for name, size in files.items() if name.startswith(f"{ZERO_DIR}/") and name != OPTIMIZER_STATE)
    share = states if stage == 3 or not target else -(-states // target)
    per_rank = max(model, default=0) + files.get(OPTIMIZER_STATE, 0) + share
    if mp > 1:
        note = (
            f"saved with {mp} model-parallel ranks: a universal checkpoint reshapes data parallelism; other tensor or "
            "pipeline sizes load only where the model states record how to split each parameter "
            "(universal_checkpoint_info)"
        )
        return WorldSizeCheck(saved, target, None, note, bytes_per_rank=per_rank)
    note = f"a universal checkpoint loads on any number of data-parallel ranks ({LOAD_UNIVERSAL}; saved on {dp})"
    return WorldSizeCheck(saved, target, True, note, bytes_per_rank=per_rank)


def _host(url: str) -> ResumeProfile:
    """The profile of the framework that resumes from the universal checkpoint at `url`."""
    return get_layout(host_layout(url)).resume_profile()


def _universal_hint(ctx: PlanContext) -> str:
    return _host(ctx.url).hint(ctx)


def _universal_run(url: str) -> str:
    return _host(url).run_of(url)


def _universal_companion(ref: CheckpointRef) -> bool:
    return _host(ref.url).companion(ref)


def _universal_traps(ctx: PlanContext) -> list[str]:
    return _host(ctx.url).traps(ctx)


def _universal_notes(ctx: PlanContext) -> list[str]:
    return _host(ctx.url).notes(ctx)


def _converted_from(url: str) -> str | None:
    source = source_of(url)
    return None if source is None else source.url


UNIVERSAL_PROFILE = ResumeProfile(
    framework="DeepSpeed (universal checkpoint)",
    hint=_universal_hint,
    world_size=universal_world_size,
    impacts=IMPACTS,
    run_of=_universal_run,
    companion=_universal_companion,
    traps=_universal_traps,
    notes=_universal_notes,
    converted_from=_converted_from,
)
