"""How Lightning resumes: `trainer.fit(model, ckpt_path=...)` (lightning 2.6.6
`pytorch/trainer/connectors/checkpoint_connector.py` `_parse_ckpt_path`: a path, or "last" for the newest
`last.ckpt` of the ModelCheckpoint callbacks, or "best"). Without `ckpt_path` nothing is restored.

A file holds the whole state and loads on any number of ranks; a sharded folder is a DCP save, which
reshards; a DeepSpeed folder follows DeepSpeed's rules (`DeepSpeedStrategy.load_checkpoint` is the engine's). Lightning saves no RNG state: a resumed run draws other numbers than an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, Component
from ckptctl.contract.resume import LatestPick, PlanContext, ResumeProfile, WorldSizeCheck, target_ranks
from ckptctl.families.dcp_resume import overwrite_warnings, reshards
from ckptctl.families.zero_tag import resume as zero_resume
from ckptctl.frameworks.lightning.files import LAST
from ckptctl.quoting import Code, comment, python_call

__all__ = ["PROFILE"]

_FRAMEWORK = "Lightning"


def _hint(ctx: PlanContext) -> str:
    if io.name_of(ctx.url) == LAST:
        call = python_call("trainer.fit", Code("model"), ckpt_path="last")
        return call + comment(f"the newest last.ckpt of the ModelCheckpoint callbacks: {ctx.url}")
    return python_call("trainer.fit", Code("model"), ckpt_path=ctx.url)


def _world_size(ctx: PlanContext) -> WorldSizeCheck:
    if zero_resume.zero_facts(ctx.checkpoint):
        return zero_resume.world_size(ctx)
    if io.is_dir(ctx.url):
        return reshards(ctx)
    target = target_ranks(ctx, None)
    return WorldSizeCheck(
        None,
        target,
        True,
        "the file holds the whole state: every rank loads it (any number of ranks)",
        bytes_per_rank=ctx.checkpoint.ref.size_bytes,
    )


_IMPACTS: Mapping[Component, str] = {
    Component.RNG: "Lightning saves no RNG state: dropout and shuffling draw other numbers than an uninterrupted "
    "run (seed_everything reseeds from the start, not from the step)",
    Component.DATALOADER: "no data loader state: Lightning restarts the epoch's batches unless the loader is "
    "stateful (a StatefulDataLoader); the loop skips none by itself",
}


def _traps(ctx: PlanContext) -> list[str]:
    return overwrite_warnings(ctx) if io.is_dir(ctx.url) and not zero_resume.zero_facts(ctx.checkpoint) else []


def _latest_pick(refs: Sequence[CheckpointRef]) -> LatestPick | None:
    """`ckpt_path="last"` (`_parse_ckpt_path`): the `last.ckpt` of the ModelCheckpoint's dirpath, the run's pointer."""
    last = next((r for r in refs if r.latest and r.layout == "lightning"), None)
    if last is None:
        return None
    return LatestPick(last.url, 'Lightning\'s trainer.fit(ckpt_path="last") takes last.ckpt')


PROFILE = ResumeProfile(
    framework=_FRAMEWORK,
    hint=_hint,
    world_size=_world_size,
    restored=frozenset(
        {Component.MODEL, Component.OPTIMIZER, Component.SCHEDULER, Component.TRAINER_STATE, Component.DATALOADER}
    ),
    impacts=_IMPACTS,
    traps=_traps,
    latest_pick=_latest_pick,
)
