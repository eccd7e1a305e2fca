"""How accelerate resumes (`accelerator.load_state(dir)` after `prepare`, accelerate 1.15 `accelerator.py`
`load_state`, `checkpointing.py` `load_accelerator_state`): the model and optimizer (through DeepSpeed's
`load_checkpoint` or DCP under those plugins), every scheduler, the sampler when saved, the GradScaler,
and this process's RNG states and `accelerator.step`. It restores no training step or epoch, and
`load_state()` without a path takes the highest-numbered folder of `checkpoints/` without looking inside."""

from __future__ import annotations

import re
from collections.abc import Mapping

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointState, Component
from ckptctl.contract.resume import (
    RESUMABLE,
    PlanContext,
    ResumeProfile,
    WorldSizeCheck,
    pickled_rng_keys,
    target_ranks,
)
from ckptctl.errors import CkptctlError
from ckptctl.families.dcp_resume import overwrite_warnings, reshards
from ckptctl.families.zero_tag import resume as zero_resume
from ckptctl.frameworks.accelerate.files import (
    AUTO_FOLDER,
    AUTO_PARENT,
    RNG_FILE,
    per_process_files,
    rng_ranks,
    without_dcp,
)
from ckptctl.quoting import Code, comment, python_call

__all__ = ["PROFILE"]

_FRAMEWORK = "accelerate"
#: The number load_state (and total_limit's rotation) sorts `checkpoints/` entries by: the first number of
#: the last path component (`accelerator.py` `_inner`: `re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)[0]`).
_SORT_NUMBER = re.compile(r"[0-9]+")


def _hint(ctx: PlanContext) -> str:
    if without_dcp(ctx.checkpoint.files):
        # load_state passes no use_dcp and reads FSDP state from the DCP folders only.
        plugin, accelerator = Code("accelerator.state.fsdp_plugin"), Code("accelerator")
        model, optimizer = Code("model"), Code("optimizer")
        return (
            f"{python_call('load_fsdp_model', plugin, accelerator, model, ctx.url, 0, use_dcp=False)}; "
            f"{python_call('load_fsdp_optimizer', plugin, accelerator, optimizer, model, ctx.url, 0, use_dcp=False)}"
            + comment("accelerate.utils, on each process")
        )
    return python_call("accelerator.load_state", ctx.url)


def _world_size(ctx: PlanContext) -> WorldSizeCheck:
    checkpoint = ctx.checkpoint
    if zero_resume.zero_facts(checkpoint):
        return zero_resume.world_size(ctx)
    own = per_process_files(name for name in checkpoint.files if "/" not in name)
    if own:
        saved = checkpoint.world_size
        target = target_ranks(ctx, saved) or 1
        note = (
            "each process loads its own *_rank{R}.bin FSDP shards: only the same number of processes, sharding the "
            "model alike, loads them"
        )
        return WorldSizeCheck(saved, target, target == saved, note)
    if any(name.startswith("pytorch_model_fsdp_") and name.endswith("/.metadata") for name in checkpoint.files):
        return reshards(ctx)
    ranks = rng_ranks([name for name in checkpoint.files if "/" not in name])
    saved = checkpoint.world_size
    target = target_ranks(ctx, saved) or 1
    per_rank = sum(size for name, size in checkpoint.files.items() if "/" not in name and not RNG_FILE.match(name)) + (
        checkpoint.files.get("random_states_0.pkl") or 0
    )
    note = "every process loads the whole model and optimizer state"
    if ranks and target > len(ranks):
        note += (
            f"; processes {len(ranks)}..{target - 1} find no random_states_N.pkl of their own and keep unrestored RNG "
            "states (load_state only logs 'Could not load random states')"
        )
    return WorldSizeCheck(saved, target, True, note, bytes_per_rank=per_rank)


_IMPACTS: Mapping[Component, str] = {
    Component.DATALOADER: "no sampler state: accelerate 1.15 saves sampler.bin only for iterable data sets "
    "(accelerate#3996), so the epoch's shuffle order is drawn again from the seed; skip the batches already seen "
    "with accelerator.skip_first_batches(dataloader, n)",
    Component.TRAINER_STATE: "accelerate saves no training step or epoch: the loop must work out where it was "
    "(from its own records or the folder name) and skip the batches already seen with "
    "accelerator.skip_first_batches",
}


def _auto_numbers(ctx: PlanContext) -> list[tuple[int, str]] | None:
    """The entries of the automatic-naming `checkpoints/` folder holding the chosen checkpoint, with the
    number load_state sorts them by (None for an entry without one); None when it is not such a folder."""
    if AUTO_FOLDER.match(io.name_of(ctx.url)) is None or io.name_of(io.parent_of(ctx.url)) != AUTO_PARENT:
        return None
    try:
        entries = io.list_dir(io.parent_of(ctx.url))
    except CkptctlError:
        return None
    numbered = []
    for entry in entries:
        found = _SORT_NUMBER.findall(entry.name)
        numbered.append((int(found[0]) if found else -1, entry.name))
    return numbered


def _traps(ctx: PlanContext) -> list[str]:
    """`load_state()` without a path: it sorts every entry of `checkpoints/` by its number (an entry without
    one makes it raise IndexError) and loads the highest, complete or not. And a newer save numbered lower
    than the chosen one: the numbering restarted, so the number does not say which state is the latest."""
    found = overwrite_warnings(ctx)
    numbered = _auto_numbers(ctx)
    if numbered is None:
        return found
    chosen = ctx.checkpoint.ref
    later = [
        (created, ref)
        for ref in ctx.refs
        if (created := ref.created) is not None
        and chosen.created is not None
        and created > chosen.created
        and ref.layout == chosen.layout
        and io.parent_of(ref.url) == io.parent_of(chosen.url)
        and ref.state is CheckpointState.COMPLETE
        and (ref.step or 0) < (chosen.step or 0)
    ]
    if later:
        _, newest = max(later, key=lambda item: item[0])
        found.append(
            f"{io.name_of(newest.url)} was saved after {io.name_of(chosen.url)}: the save numbering restarted (a "
            "resume that did not set accelerator.project_configuration.iteration, accelerate#3306), so it holds the "
            "later training state; to continue from it, pass its path to load_state"
        )
    unnumbered = sorted(name for number, name in numbered if number < 0)
    if unnumbered:
        found.append(
            f"{io.parent_of(ctx.url)} holds {', '.join(unnumbered[:3])}{' ...' if len(unnumbered) > 3 else ''}, "
            "without a number: accelerator.load_state() without a path (and save_state's total_limit rotation) "
            "fails on it with IndexError; move it out, or pass the path"
        )
    numbers = [(number, name) for number, name in numbered if number >= 0]
    if numbers:
        _, highest = max(numbers)
        if highest != io.name_of(ctx.url):
            why = next(
                (s.reason for s in ctx.skipped if io.name_of(s.url) == highest), "not a complete accelerate checkpoint"
            )
            found.append(
                f"accelerator.load_state() without a path loads the highest-numbered folder, {highest} ({why}): "
                f"pass the path of {io.name_of(ctx.url)}"
            )
    return found


def _notes(ctx: PlanContext) -> list[str]:
    found = []
    number = ctx.checkpoint.progress.get("save_iteration")
    if isinstance(number, int):
        found.append(
            f"checkpoint_{number} counts saves, not training steps; load_state does not restore the save counter "
            f"(accelerate#3306): set accelerator.project_configuration.iteration = {number + 1} before the next "
            "save_state, or it fails with 'Checkpoint directory ... already exists' (with total_limit, the rotation "
            "first deletes checkpoint_0 and the new save takes its name, below the older ones)"
        )
    if without_dcp(ctx.checkpoint.files):
        found.append(
            "accelerator.load_state reads FSDP state from the DCP folders (pytorch_model_fsdp_0/) and fails here; "
            "load_fsdp_model/load_fsdp_optimizer restore the model and optimizer only: the schedulers, sampler and "
            "RNG states load with accelerate.checkpointing.load_accelerator_state(dir, [], [], schedulers, "
            "dataloaders, accelerator.process_index)"
        )
    if zero_resume.zero_facts(ctx.checkpoint):
        found.append(
            "load_state reads the DeepSpeed tag through engine.load_checkpoint(dir, 'pytorch_model'): prepare the "
            "same DeepSpeed config (ZeRO stage) before calling it"
        )
    return found


def _rng_keys(checkpoint: Checkpoint) -> frozenset[str] | None:
    """The keys of the first `random_states_N.pkl` (its `data.pkl` only, read on demand)."""
    ranks = rng_ranks([name for name in checkpoint.files if "/" not in name])
    if not ranks:
        return None
    name = f"random_states_{ranks[0]}.pkl"
    return pickled_rng_keys(io.join(checkpoint.url, name), checkpoint.files.get(name), frozenset({"step"}))


PROFILE = ResumeProfile(
    framework=_FRAMEWORK,
    hint=_hint,
    world_size=_world_size,
    restored=frozenset(RESUMABLE) - {Component.TRAINER_STATE},
    impacts=_IMPACTS,
    rng_keys=_rng_keys,
    traps=_traps,
    notes=_notes,
)
