"""How the Hugging Face Trainer resumes (`trainer.train(resume_from_checkpoint=...)`): the full state on
every rank, or DeepSpeed's or FSDP's rules when the checkpoint holds their folders; `True` picks the
highest `checkpoint-N` without looking inside (transformers#35782)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, Component
from ckptctl.contract.resume import (
    LatestPick,
    PlanContext,
    ResumeProfile,
    WorldSizeCheck,
    pickled_rng_keys,
    target_ranks,
)
from ckptctl.errors import CkptctlError
from ckptctl.families.dcp_resume import overwrite_warnings, reshards
from ckptctl.families.zero_tag import resume as zero_resume
from ckptctl.frameworks.hf_trainer.files import CHECKPOINT_DIR, RNG_FILE
from ckptctl.layouts import peek_dir
from ckptctl.quoting import python_call

__all__ = ["PROFILE"]

_FRAMEWORK = "transformers Trainer"


def _hint(ctx: PlanContext) -> str:
    return python_call("trainer.train", resume_from_checkpoint=ctx.url)


def _world_size(ctx: PlanContext) -> WorldSizeCheck:
    checkpoint = ctx.checkpoint
    if zero_resume.zero_facts(checkpoint):
        return zero_resume.world_size(ctx)
    rng = sorted(int(m.group(1) or 0) if m.group(1) else -1 for f in checkpoint.files if (m := RNG_FILE.match(f)))
    saved = checkpoint.world_size
    target = target_ranks(ctx, saved) or 1
    if any(name.startswith("pytorch_model_fsdp_") for name in checkpoint.files):
        return reshards(ctx)
    per_rank = sum(
        size
        for name, size in checkpoint.files.items()
        if "/" not in name and not RNG_FILE.match(name) and name != "training_args.bin"
    )
    note = "the Trainer loads the full model and optimizer.pt on every rank"
    wanted = {-1} if target == 1 else set(range(target))
    without = sorted(wanted - set(rng))
    if rng and without:
        names = "rng_state.pth" if without == [-1] else f"rng_state_{{{without[0]}..{without[-1]}}}.pth"
        note += f"; it looks for {names}, which the checkpoint lacks: those processes keep unrestored RNG states"
    return WorldSizeCheck(saved, target, True, note, bytes_per_rank=per_rank)


_IMPACTS: Mapping[Component, str] = {
    Component.DATALOADER: "no sampler state: the Trainer rebuilds the data order from the seed and skips the "
    "batches already seen in the current epoch (unless ignore_data_skip=True)",
}


def _highest_warning(ctx: PlanContext) -> list[str]:
    """The Trainer resumes from the highest-numbered `checkpoint-N` folder without looking inside
    (transformers#35782), even one that holds nothing yet."""
    output_dir = io.parent_of(ctx.url)
    try:
        numbered = [
            (int(m.group(1)), e.name)
            for e in io.list_dir(output_dir)
            if e.is_dir and (m := CHECKPOINT_DIR.match(e.name))
        ]
    except CkptctlError:
        return []
    if not numbered:
        return []
    _, highest = max(numbered)
    if highest == io.name_of(ctx.url):
        return []
    url = io.join(output_dir, highest)
    why = next((s.reason for s in ctx.skipped if s.url == url), "not a complete Trainer checkpoint")
    return [
        f"{_FRAMEWORK}: resume_from_checkpoint=True picks the highest checkpoint-N without checking it, "
        f"so it would load {highest} ({why}); pass the path of {io.name_of(ctx.url)} instead"
    ]


def _traps(ctx: PlanContext) -> list[str]:
    return _highest_warning(ctx) + overwrite_warnings(ctx)


def _rng_keys(checkpoint: Checkpoint) -> frozenset[str] | None:
    """The keys of the first `rng_state*.pth` (its pickle's `data.pkl` only, read on demand)."""
    name = next((f for f in sorted(checkpoint.files) if RNG_FILE.match(f)), None)
    if name is None:
        return None
    return pickled_rng_keys(io.join(checkpoint.url, name), checkpoint.files[name])


def _latest_pick(refs: Sequence[CheckpointRef]) -> LatestPick | None:
    """transformers 5.24 `trainer_utils.get_last_checkpoint`, which `Trainer.train(resume_from_checkpoint=True)`
    calls: the `checkpoint-N` folder of the output_dir with the highest N, whatever it holds."""
    folders = {
        io.parent_of(r.url) for r in refs if r.layout == "hf_trainer" and CHECKPOINT_DIR.match(io.name_of(r.url))
    }
    if len(folders) != 1:
        return None
    output_dir = folders.pop()
    numbered = [
        (int(m.group(1)), e.name)
        for e in peek_dir(output_dir) or ()
        if e.is_dir and (m := CHECKPOINT_DIR.match(e.name))
    ]
    if not numbered:
        return None
    return LatestPick(
        io.join(output_dir, max(numbered)[1]),
        "transformers get_last_checkpoint (resume_from_checkpoint=True) takes the highest checkpoint-N",
    )


PROFILE = ResumeProfile(
    framework=_FRAMEWORK,
    hint=_hint,
    world_size=_world_size,
    impacts=_IMPACTS,
    rng_keys=_rng_keys,
    traps=_traps,
    latest_pick=_latest_pick,
)
