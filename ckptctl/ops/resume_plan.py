"""`resume-plan`: which checkpoint of a run a resume should load, what it brings back, and how to ask for it.

The checkpoints of the run are tried newest first: one still being written, broken, or failing the
layout's structural verify is skipped with its reason, and the first that passes is the plan. Frameworks
that follow a `latest` pointer (DeepSpeed and those built on it) load the tag it names, so newer tags are
skipped as unfinished saves. The plan then says what the framework restores from that checkpoint and what
it does not (with what that means for the run), whether it loads on the target number of ranks and how
many bytes each rank reads, the exact setting that resumes from it, and warnings about the traps of each
framework (LAYOUTS.md): a DCP slot overwritten in place, AReaL info files older than its weights, a
`latest` naming a broken tag, open-instruct's start-up clean-up, RNG keys older checkpoints lack, and the
Trainer picking the highest `checkpoint-N` without checking it.

What each framework does is one `ResumeProfile` in `PROFILES`, keyed by layout name: a new layout adds an
entry (and gets a generic plan until it does).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Component, Problem
from ckptctl.errors import CkptctlError
from ckptctl.layouts import get_layout, scan_run
from ckptctl.ops.report import SCHEMA_VERSION, NoProgress, Progress, iso, jsonable

__all__ = [
    "DEFAULT_IMPACT",
    "PROFILES",
    "RESUMABLE",
    "PlanContext",
    "ResumePlan",
    "ResumeProfile",
    "Skipped",
    "WorldSizeCheck",
    "plan_resume",
    "profile_for",
    "rng_keys",
]

#: What a training resume restores, in the order plans list them.
RESUMABLE: tuple[Component, ...] = (
    Component.MODEL,
    Component.OPTIMIZER,
    Component.SCHEDULER,
    Component.RNG,
    Component.DATALOADER,
    Component.TRAINER_STATE,
)

#: What a missing component means for the resumed run (a layout's profile may say it better).
DEFAULT_IMPACT: Mapping[Component, str] = {
    Component.MODEL: "no model weights: there is nothing to resume from",
    Component.OPTIMIZER: "no optimizer state: Adam moments restart from zero (expect a loss spike; a short "
    "learning-rate warm-up softens it)",
    Component.SCHEDULER: "no LR scheduler state: the schedule restarts from its first step unless the training "
    "code sets it from the step",
    Component.RNG: "no RNG state: dropout, sampling and shuffling draw other numbers than an uninterrupted run",
    Component.DATALOADER: "no data loader/sampler state: the data order restarts, so samples seen before the "
    "save are seen again unless the code skips them",
    Component.TRAINER_STATE: "no step/epoch counters: the loop counts from 0 unless it is told the step "
    "(schedules, logging and saves shift)",
}

#: A DCP data file newer than its `.metadata` by more than this (seconds) means an overwrite in place
#: was under way; below it, clocks and timestamp granularity of shared file systems.
_MTIME_SLACK_S = 2.0
_MODEL_STATES = re.compile(r"model_states\.pt$")
_OPTIM_STATES = re.compile(r"optim_states\.pt$")
_TRAINER_RNG = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
#: `metadata["kind"]` of the model-only folders layouts recognise inside a run (OpenRLHF's `*_hf` exports,
#: open-instruct's snapshots): weights without training state.
_EXPORT_KINDS = {"hf_export": "an HF export", "hf_snapshot": "an HF snapshot"}


# --------------------------------------------------------------------------------------------------
# Results.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Skipped:
    """A checkpoint newer than the one chosen, and why a resume must not load it."""

    url: str
    step: int | None
    reason: str
    layout: str
    state: CheckpointState

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "step": self.step, "reason": self.reason, "layout": self.layout, "state": self.state}


@dataclass(frozen=True, slots=True)
class WorldSizeCheck:
    """Whether the checkpoint loads on the target number of ranks.

    Attributes:
        saved: ranks that wrote it (None when not recorded).
        target: ranks of the resumed run (the saved number when not asked).
        ok: whether it loads there; None when it cannot be told.
        note: why, in one line.
        fix: what to run first when it does not load as is ("" when nothing is needed).
        bytes_per_rank: estimated bytes each rank reads to load it (None when unknown).
    """

    saved: int | None
    target: int | None
    ok: bool | None
    note: str
    fix: str = ""
    bytes_per_rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"saved": self.saved, "target": self.target, "ok": self.ok, "note": self.note, "fix": self.fix}


@dataclass(frozen=True, slots=True)
class ResumePlan:
    """What a resume of a run would load and how.

    Attributes:
        run: the run folder.
        checkpoint: the checkpoint to resume from, or None when nothing is resumable.
        framework: who wrote it (and reads it back).
        skipped: newer checkpoints a resume must not load, newest first, with the reason.
        continues_from: step, epoch and the progress counters the checkpoint records.
        restores: components the framework restores from it.
        missing: components it does not restore (absent, or saved but never reloaded).
        impacts: one line per missing component (and framework-specific extras): what it means.
        world_size: whether the target number of ranks can load it.
        resume_hint: the setting that resumes from it, for the framework that wrote it.
        warnings: traps worth knowing before resuming.
    """

    run: str
    checkpoint: CheckpointRef | None
    framework: str | None
    skipped: tuple[Skipped, ...]
    continues_from: Mapping[str, Any] = field(default_factory=dict)
    restores: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    impacts: Mapping[str, str] = field(default_factory=dict)
    world_size: WorldSizeCheck | None = None
    resume_hint: str | None = None
    warnings: tuple[str, ...] = ()

    @property
    def resumable(self) -> bool:
        return self.checkpoint is not None

    def to_json(self) -> dict[str, Any]:
        chosen = self.checkpoint
        return {
            "schema_version": SCHEMA_VERSION,
            "run": self.run,
            "checkpoint": None
            if chosen is None
            else {
                "url": chosen.url,
                "step": chosen.step,
                "layout": chosen.layout,
                "epoch": chosen.epoch,
                "created": iso(chosen.created),
                "framework": self.framework,
            },
            "skipped": [s.to_json() for s in self.skipped],
            "restores": list(self.restores),
            "missing": list(self.missing),
            "impacts": dict(self.impacts),
            "world_size_ok": None if self.world_size is None else self.world_size.ok,
            "world_size": None if self.world_size is None else self.world_size.to_json(),
            "bytes_per_rank": None if self.world_size is None else self.world_size.bytes_per_rank,
            "resume_hint": self.resume_hint,
            "continues_from": jsonable(dict(self.continues_from)),
            "warnings": list(self.warnings),
        }


# --------------------------------------------------------------------------------------------------
# Per-framework knowledge.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlanContext:
    """What a profile's functions get: the chosen checkpoint, the run's checkpoints and the target ranks.

    Attributes:
        run: the run folder.
        checkpoint: the chosen checkpoint, opened.
        refs: every checkpoint of the run (the chosen one included).
        skipped: the newer checkpoints that were skipped.
        target: the number of ranks asked for, or None.
        world: the profile's world-size verdict, once known (hints depend on it).
    """

    run: str
    checkpoint: Checkpoint
    refs: tuple[CheckpointRef, ...]
    skipped: tuple[Skipped, ...]
    target: int | None
    world: WorldSizeCheck | None = None

    @property
    def url(self) -> str:
        return self.checkpoint.url

    @property
    def newest(self) -> bool:
        """Whether the chosen checkpoint is the run's newest (nothing newer was skipped)."""
        return not self.skipped


def _no_notes(ctx: PlanContext) -> list[str]:
    return []


def _no_extras(ctx: PlanContext) -> dict[str, str]:
    return {}


def _never(ref: CheckpointRef) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class ResumeProfile:
    """How one framework resumes from its checkpoints.

    Attributes:
        framework: its name, for people.
        hint: the exact setting that resumes from the chosen checkpoint.
        world_size: whether (and at what read cost) the target number of ranks loads it.
        restored: the components it reloads when present (others are saved but ignored on resume).
        impacts: better one-liners than `DEFAULT_IMPACT` for this framework.
        follows_pointer: it loads what the run's `latest` pointer names, not the newest folder.
        picks_highest: it resumes from the highest-numbered folder without checking it.
        resumable: False for model-only folders (an HF export restores no training state).
        run_of: the run folder a checkpoint belongs to (the folder its checkpoints are grouped by).
        companion: checkpoints that are not resumed from but load along with the chosen one (OpenRLHF's
            critic tags); they are left out of the candidates.
        notes: framework-specific warnings.
        extras: framework-specific "not restored" lines beyond components (AReaL's critic).
    """

    framework: str
    hint: Callable[[PlanContext], str]
    world_size: Callable[[PlanContext], WorldSizeCheck]
    restored: frozenset[Component] = frozenset(RESUMABLE)
    impacts: Mapping[Component, str] = field(default_factory=dict)
    follows_pointer: bool = False
    picks_highest: bool = False
    resumable: bool = True
    run_of: Callable[[str], str] = io.parent_of
    companion: Callable[[CheckpointRef], bool] = _never
    notes: Callable[[PlanContext], list[str]] = _no_notes
    extras: Callable[[PlanContext], dict[str, str]] = _no_extras


def _target(ctx: PlanContext, saved: int | None) -> int | None:
    return ctx.target if ctx.target is not None else saved


# --- native (ckptctl's own core) ------------------------------------------------------------------


def _native_hint(ctx: PlanContext) -> str:
    root = io.parent_of(ctx.url)
    step = "" if ctx.newest or ctx.checkpoint.ref.step is None else f", step={ctx.checkpoint.ref.step}"
    return f'CheckpointManager("{root}").restore(state{step})'


def _native_world_size(ctx: PlanContext) -> WorldSizeCheck:
    from ckptctl.frameworks.native.layout import DCP_FOLDER, read_native_manifest

    checkpoint = ctx.checkpoint
    saved = checkpoint.world_size
    target = _target(ctx, saved) or 1
    manifest = read_native_manifest(ctx.url)
    sharded = any(c.storage == "dcp" for c in manifest.components.values())
    rng_ranks = sorted(int(m.group(1)) for f in checkpoint.files if (m := re.fullmatch(r"rng\.rank-(\d+)\.json", f)))
    if not sharded:
        per_rank = sum(size for name, size in checkpoint.files.items() if name != "ckptctl-manifest.json")
        note = "a single-process save: every rank reads all of it and loads the full state"
        if target > 1:
            note += "; every rank restores the same RNG state, so ranks draw identical random numbers"
        return WorldSizeCheck(saved, target, True, note, bytes_per_rank=per_rank)
    prefix = f"{DCP_FOLDER}/"
    dcp_bytes = sum(e.nbytes for e in checkpoint.tensors() if e.chunks and e.chunks[0].file.startswith(prefix))
    other = sum(
        size
        for name, size in checkpoint.files.items()
        if not name.startswith(prefix) and not re.match(r"rng\.rank-(?!0\.)\d+\.", name)
    )
    note = f"model and optimizer are torch DCP: they reshard onto {target} rank(s)"
    if rng_ranks and target > len(rng_ranks):
        note += (
            f"; ranks {len(rng_ranks)}..{target - 1} find no RNG state of their own and keep their seeded generators"
        )
    return WorldSizeCheck(saved, target, True, note, bytes_per_rank=dcp_bytes // target + other)


# --- torch DCP ---------------------------------------------------------------------------------------


def _dcp_hint(ctx: PlanContext) -> str:
    return f'dcp.load(state, checkpoint_id="{ctx.url}")'


def _resharding(ctx: PlanContext) -> WorldSizeCheck:
    saved = ctx.checkpoint.world_size
    target = _target(ctx, saved) or 1
    total = sum(e.nbytes for e in ctx.checkpoint.tensors())
    return WorldSizeCheck(
        saved,
        target,
        True,
        f"torch DCP reshards at load: {target} rank(s) each read their part",
        bytes_per_rank=total // target,
    )


# --- DeepSpeed and the frameworks built on it ------------------------------------------------------


def _ds_info(checkpoint: Checkpoint) -> Mapping[str, Any]:
    metadata = checkpoint.metadata
    if "zero_stage" in metadata:
        return metadata
    inner = metadata.get("deepspeed")
    return inner if isinstance(inner, Mapping) else {}


def _ds_tag_url(checkpoint: Checkpoint) -> str:
    """The DeepSpeed tag folder: the checkpoint itself, or the one inside a Trainer checkpoint."""
    tag = _ds_info(checkpoint).get("tag")
    if isinstance(tag, str) and tag != io.name_of(checkpoint.url) and io.is_dir(io.join(checkpoint.url, tag)):
        return io.join(checkpoint.url, tag)
    return checkpoint.url


def _deepspeed_world_size(ctx: PlanContext) -> WorldSizeCheck:
    info = _ds_info(ctx.checkpoint)
    stage, dp, mp = info.get("zero_stage"), info.get("dp_world_size"), info.get("mp_world_size") or 1
    saved = dp * mp if isinstance(dp, int) and isinstance(mp, int) else ctx.checkpoint.world_size
    target = _target(ctx, saved)
    files = ctx.checkpoint.files
    model = [s for n, s in files.items() if _MODEL_STATES.search(n)]
    optim = [s for n, s in files.items() if _OPTIM_STATES.search(n)]
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
    tag_url = _ds_tag_url(ctx.checkpoint)
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


def _deepspeed_hint(ctx: PlanContext) -> str:
    tag = io.name_of(ctx.url)
    if ctx.world is not None and ctx.world.ok is False and ctx.world.fix:
        return (
            f'engine.load_checkpoint("{io.parent_of(ctx.url)}", tag="{tag}_universal") with "checkpoint": '
            f'{{"load_universal": true}}, once ds_to_universal has converted {tag} into {tag}_universal'
        )
    return f'engine.load_checkpoint("{io.parent_of(ctx.url)}", tag="{tag}")'


_DEEPSPEED_IMPACTS: Mapping[Component, str] = {
    Component.RNG: "DeepSpeed saves no RNG state: dropout and sampling draw other numbers than an uninterrupted "
    "run (save them in client_state to keep them)",
    Component.DATALOADER: "no data sampler state (DeepSpeed saves one only for its own data loader): the data "
    "order restarts unless the training code skips consumed samples",
}


def _pointer_caveat(ctx: PlanContext, pointer: str) -> str:
    """What to do first when the framework follows `latest` and it names another tag than the chosen one."""
    named = next((r for r in ctx.refs if r.latest and io.parent_of(r.url) == io.parent_of(ctx.url)), None)
    if named is not None and named.url == ctx.url:
        return ""
    return f" (it loads the tag `{pointer}` names: write {io.name_of(ctx.url)} into {pointer} first)"


# --- OpenRLHF ----------------------------------------------------------------------------------------


def _openrlhf_run(url: str) -> str:
    parent = io.parent_of(url)
    return io.parent_of(parent) if io.name_of(parent) in ("_actor", "_critic") else parent


def _openrlhf_critic(ref: CheckpointRef) -> bool:
    return io.name_of(io.parent_of(ref.url)) == "_critic"


def _openrlhf_notes(ctx: PlanContext) -> list[str]:
    """The critic loads from `_critic/latest` along with the actor: say when the two are out of step."""
    critic = next((r for r in ctx.refs if _openrlhf_critic(r) and r.latest), None)
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


def _openrlhf_hint(ctx: PlanContext) -> str:
    ckpt_path = _openrlhf_run(ctx.url)
    pointer = "_actor/latest" if io.name_of(io.parent_of(ctx.url)) == "_actor" else "latest"
    return (
        f"--load_checkpoint --ckpt_path {ckpt_path} (OpenRLHF >= 0.10.2: --ckpt.load_enable --ckpt.path {ckpt_path})"
        + _pointer_caveat(ctx, pointer)
    )


# --- open-instruct -----------------------------------------------------------------------------------


def _open_instruct_hint(ctx: PlanContext) -> str:
    return f"--checkpoint_state_dir {io.parent_of(ctx.url)}" + _pointer_caveat(ctx, "latest")


def _open_instruct_notes(ctx: PlanContext) -> list[str]:
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


# --- AReaL -------------------------------------------------------------------------------------------


def _areal_trial(url: str) -> str | None:
    """The trial folder (`.../{experiment}/{trial}/`, holding `recover_info/`) at or above `url`."""
    folder = url
    for _ in range(4):
        if io.is_dir(io.join(folder, "recover_info")):
            return folder
        parent = io.parent_of(folder)
        if parent == folder:
            break
        folder = parent
    return None


def _areal_run(url: str) -> str:
    """The trial folder: its recover slots, HF exports and `recover_info/` are one run."""
    return _areal_trial(url) or io.parent_of(url)


def _areal_critic(ref: CheckpointRef) -> bool:
    """The critic's recover slot loads along with the actor's (same `recover_info/`)."""
    return io.name_of(io.parent_of(ref.url)) == "critic"


def _areal_hint(ctx: PlanContext) -> str:
    trial = _areal_trial(ctx.url)
    if trial is None:
        return "recover.mode=on with the experiment_name and trial_name of the run that saved it"
    experiment = io.name_of(io.parent_of(trial))
    hint = f"recover.mode=on experiment_name={experiment} trial_name={io.name_of(trial)}"
    marker = "/checkpoints/"
    if marker in trial:
        hint += f" cluster.fileroot={trial.split(marker, 1)[0]}"
    return hint + " (older releases: recover.mode=auto or resume)"


def _areal_world_size(ctx: PlanContext) -> WorldSizeCheck:
    saved = ctx.checkpoint.world_size
    target = _target(ctx, saved)
    ok = None if saved is None or target is None else saved == target
    note = "AReaL reloads its recover checkpoint only with the parallelism (allocation_mode) it was saved with"
    return WorldSizeCheck(saved, target, ok, note)


def _areal_notes(ctx: PlanContext) -> list[str]:
    trial = _areal_trial(ctx.url)
    if trial is None:
        return []
    step_info = _mtime(io.join(trial, "recover_info"), "step_info.json")
    weights = [
        m
        for name in ("default/recover_checkpoint", "recover_checkpoint")
        if (m := _mtime(io.join(trial, name), ".metadata")) is not None
    ]
    if step_info is None or not weights or step_info + _MTIME_SLACK_S >= max(weights):
        return []
    return [
        "recover_info/step_info.json is older than the recover checkpoint's .metadata: the last save rewrote the "
        "weights but not the counters (a torn save); AReaL would pair the older step with newer weights, or "
        "restart from step 0 if the info files do not parse"
    ]


def _areal_extras(ctx: PlanContext) -> dict[str, str]:
    trial = _areal_trial(ctx.url)
    if trial is None or not io.is_dir(io.join(trial, "critic")):
        return {}
    return {
        "critic": "the critic is saved under critic/, but AReaL's recover reloads only the engines the training "
        "script hands to RecoverHandler.load: unless yours passes the critic, it restarts from its initial weights"
    }


_AREAL_IMPACTS: Mapping[Component, str] = {
    Component.SCHEDULER: "AReaL's recover checkpoint holds no LR scheduler: the schedule restarts from its first step",
    Component.RNG: "AReaL's recover checkpoint holds no RNG state: sampling and dropout draw other numbers",
}


# --- ROLL ---------------------------------------------------------------------------------------------


def _roll_run(url: str) -> str:
    """ROLL writes each launch into a new `YYYYmmdd-HHMMSS` folder: the run is the folder above them."""
    parent = io.parent_of(url)
    return io.parent_of(parent) if re.fullmatch(r"\d{8}-\d{6}", io.name_of(parent)) else parent


def _roll_hint(ctx: PlanContext) -> str:
    return f"resume_from_checkpoint: {ctx.url}"


def _unchecked_world_size(ctx: PlanContext) -> WorldSizeCheck:
    saved = ctx.checkpoint.world_size
    return WorldSizeCheck(
        saved,
        _target(ctx, saved),
        None,
        "not checked for this framework: keep the parallelism it was saved with to be safe",
    )


# --- Hugging Face Trainer -------------------------------------------------------------------------


def _trainer_hint(ctx: PlanContext) -> str:
    return f'trainer.train(resume_from_checkpoint="{ctx.url}")'


def _trainer_world_size(ctx: PlanContext) -> WorldSizeCheck:
    checkpoint = ctx.checkpoint
    if _ds_info(checkpoint):
        return _deepspeed_world_size(ctx)
    rng = sorted(int(m.group(1) or 0) if m.group(1) else -1 for f in checkpoint.files if (m := _TRAINER_RNG.match(f)))
    saved = checkpoint.world_size
    target = _target(ctx, saved) or 1
    if any(name.startswith("pytorch_model_fsdp_") for name in checkpoint.files):
        return _resharding(ctx)
    per_rank = sum(
        size
        for name, size in checkpoint.files.items()
        if "/" not in name and not _TRAINER_RNG.match(name) and name != "training_args.bin"
    )
    note = "the Trainer loads the full model and optimizer.pt on every rank"
    wanted = {-1} if target == 1 else set(range(target))
    without = sorted(wanted - set(rng))
    if rng and without:
        names = "rng_state.pth" if without == [-1] else f"rng_state_{{{without[0]}..{without[-1]}}}.pth"
        note += f"; it looks for {names}, which the checkpoint lacks: those processes keep unrestored RNG states"
    return WorldSizeCheck(saved, target, True, note, bytes_per_rank=per_rank)


_TRAINER_IMPACTS: Mapping[Component, str] = {
    Component.DATALOADER: "no sampler state: the Trainer rebuilds the data order from the seed and skips the "
    "batches already seen in the current epoch (unless ignore_data_skip=True)",
}


# --- the table ----------------------------------------------------------------------------------------


def _model_only_world_size(ctx: PlanContext) -> WorldSizeCheck:
    return WorldSizeCheck(None, ctx.target, True, "model weights load on any number of ranks")


def _model_only_hint(ctx: PlanContext) -> str:
    return f'AutoModelForCausalLM.from_pretrained("{ctx.url}") (starts a new run: no training state)'


#: How each layout's framework resumes, keyed by layout name.
PROFILES: Mapping[str, ResumeProfile] = {
    "native": ResumeProfile(
        framework="ckptctl",
        hint=_native_hint,
        world_size=_native_world_size,
        impacts={
            Component.DATALOADER: "no data loader/sampler state was saved: pass a stateful sampler in `state` to "
            "keep the data order; as it is the order restarts",
        },
    ),
    "dcp": ResumeProfile(framework="torch.distributed.checkpoint", hint=_dcp_hint, world_size=_resharding),
    "hf_trainer": ResumeProfile(
        framework="transformers Trainer",
        hint=_trainer_hint,
        world_size=_trainer_world_size,
        impacts=_TRAINER_IMPACTS,
        picks_highest=True,
    ),
    "deepspeed": ResumeProfile(
        framework="DeepSpeed",
        hint=_deepspeed_hint,
        world_size=_deepspeed_world_size,
        impacts=_DEEPSPEED_IMPACTS,
        follows_pointer=True,
    ),
    "openrlhf": ResumeProfile(
        framework="OpenRLHF",
        hint=_openrlhf_hint,
        world_size=_deepspeed_world_size,
        run_of=_openrlhf_run,
        companion=_openrlhf_critic,
        notes=_openrlhf_notes,
        impacts=_DEEPSPEED_IMPACTS,
        follows_pointer=True,
    ),
    "open_instruct": ResumeProfile(
        framework="open-instruct",
        hint=_open_instruct_hint,
        world_size=_deepspeed_world_size,
        notes=_open_instruct_notes,
        impacts=_DEEPSPEED_IMPACTS,
        follows_pointer=True,
    ),
    "areal": ResumeProfile(
        framework="AReaL",
        hint=_areal_hint,
        world_size=_areal_world_size,
        impacts=_AREAL_IMPACTS,
        run_of=_areal_run,
        companion=_areal_critic,
        notes=_areal_notes,
        extras=_areal_extras,
    ),
    "roll": ResumeProfile(framework="ROLL", hint=_roll_hint, world_size=_unchecked_world_size, run_of=_roll_run),
    "hf": ResumeProfile(
        framework="transformers (a model folder)",
        hint=_model_only_hint,
        world_size=_model_only_world_size,
        resumable=False,
    ),
}


def _generic_hint(ctx: PlanContext) -> str:
    return f"load {ctx.url} with the framework that wrote it ({ctx.checkpoint.layout})"


def profile_for(layout: str) -> ResumeProfile:
    """The profile of a layout; layouts without one get a generic plan."""
    return PROFILES.get(layout) or ResumeProfile(framework=layout, hint=_generic_hint, world_size=_unchecked_world_size)


# --------------------------------------------------------------------------------------------------
# The plan.
# --------------------------------------------------------------------------------------------------


def plan_resume(
    run: str,
    *,
    world_size: int | None = None,
    layout: str | None = None,
    digests: bool = False,
    progress: Progress | None = None,
    cuda: bool | None = None,
) -> ResumePlan:
    """Plan the resume of the run at `run` (see the module docstring).

    Args:
        run: the run folder (or one checkpoint folder).
        world_size: ranks of the resumed run; None keeps the saved number.
        layout: consider only checkpoints of this layout.
        digests: also check file digests against the manifest of each candidate (slower: hashes every
            byte of each candidate); the default is structural verification only.
        progress: where digest hashing reports progress.
        cuda: whether the resumed run uses CUDA (a checkpoint without CUDA generator states is only worth a
            warning then); None: whether torch sees a CUDA device here, asked only when it matters.

    Raises:
        CheckpointNotFound: the run folder does not exist.
        CkptctlError: the folder holds several runs (the message lists them), or `world_size` < 1.
    """
    if world_size is not None and world_size < 1:
        raise CkptctlError(f"--world-size must be at least 1, not {world_size}")
    if layout is not None:
        get_layout(layout)  # an unknown name fails here, listing the known ones
    refs = [r for r in scan_run(run) if layout is None or r.layout == layout]
    refs = _one_run(run, refs)
    ordered = [r for r in _newest_first(refs) if not profile_for(r.layout).companion(r)]
    pointer_named = _pointer_target(ordered)
    skipped: list[Skipped] = []
    chosen: Checkpoint | None = None
    run_warnings: list[str] = []
    for ref in ordered:
        profile = profile_for(ref.layout)
        reason, checkpoint, pointer_problems = _judge(ref, profile, pointer_named, digests, progress or NoProgress())
        run_warnings += [p for p in pointer_problems if p not in run_warnings]
        if reason is None and checkpoint is not None:
            chosen = checkpoint
            break
        skipped.append(Skipped(ref.url, ref.step, reason or "cannot be opened", ref.layout, ref.state))
    if chosen is None:
        return ResumePlan(
            run=run, checkpoint=None, framework=None, skipped=tuple(skipped), warnings=tuple(run_warnings)
        )
    profile = profile_for(chosen.layout)
    ctx = PlanContext(run, chosen, tuple(refs), tuple(skipped), world_size)
    ctx = replace(ctx, world=profile.world_size(ctx))
    restores, missing, impacts = _components(ctx, profile)
    warnings = run_warnings + _warnings(ctx, profile, pointer_named, cuda)
    return ResumePlan(
        run=run,
        checkpoint=chosen.ref,
        framework=profile.framework,
        skipped=tuple(skipped),
        continues_from=_continues_from(chosen),
        restores=restores,
        missing=missing,
        impacts=impacts,
        world_size=ctx.world,
        resume_hint=profile.hint(ctx),
        warnings=tuple(warnings),
    )


def _one_run(run: str, refs: list[CheckpointRef]) -> list[CheckpointRef]:
    """The checkpoints of the one run below `run` (grouped by each profile's `run_of`).

    Several groups holding training state are an error; model-only exports kept in the run's own folder
    stay in (they are reported when newer), those elsewhere are left out.
    """
    groups: dict[str, list[CheckpointRef]] = {}
    for ref in refs:
        groups.setdefault(profile_for(ref.layout).run_of(ref.url), []).append(ref)
    resumable = [key for key, members in groups.items() if any(profile_for(r.layout).resumable for r in members)]
    if len(resumable) > 1:
        names = ", ".join(sorted(io.relative_to(key, run) or "." for key in resumable))
        raise CkptctlError(
            f"{run} holds several runs ({names})", "pass one of them (or --layout to consider one layout only)"
        )
    return groups[resumable[0]] if resumable else refs


def _newest_first(refs: Sequence[CheckpointRef]) -> list[CheckpointRef]:
    def key(ref: CheckpointRef) -> tuple[bool, int, bool, float]:
        created = ref.created.timestamp() if ref.created else 0.0
        # At equal steps, what a `latest` pointer names first (OpenRLHF's best_global_stepN beside global_stepN).
        return (ref.step is not None, ref.step if ref.step is not None else -1, ref.latest, created)

    return sorted(refs, key=key, reverse=True)


def _pointer_target(ordered: Sequence[CheckpointRef]) -> CheckpointRef | None:
    """The checkpoint a `latest` pointer names, for frameworks that load what it names."""
    return next((r for r in ordered if r.latest and profile_for(r.layout).follows_pointer), None)


def _judge(
    ref: CheckpointRef,
    profile: ResumeProfile,
    pointer_named: CheckpointRef | None,
    digests: bool,
    progress: Progress,
) -> tuple[str | None, Checkpoint | None, list[str]]:
    """Why `ref` must not be resumed from (None when it can), the opened checkpoint, and run-level problems
    its verify reported (a `latest` pointer naming a missing tag concerns the run, not this checkpoint)."""
    if ref.state is CheckpointState.IN_PROGRESS:
        return f"in progress: {ref.note or 'still being written'}", None, []
    if ref.state is CheckpointState.BROKEN:
        return f"broken: {ref.note or 'incomplete'}", None, []
    if not profile.resumable:
        return "model weights only (an export): a resume needs training state", None, []
    if (
        pointer_named is not None
        and ref.url != pointer_named.url
        and io.parent_of(ref.url) == io.parent_of(pointer_named.url)
        and _newer(ref, pointer_named)
    ):
        return (
            f"newer than {io.name_of(pointer_named.url)}, which `latest` names: {profile.framework} loads that one "
            "(and writes `latest` after the rank files, so this save may not have finished)",
            None,
            [],
        )
    layout = get_layout(ref.layout)
    try:
        checkpoint = layout.open(ref.url)
        problems = list(layout.verify(checkpoint))
    except CkptctlError as exc:
        return f"fails verify: {exc.message}", None, []
    if digests:
        problems += _digest_problems(checkpoint, progress)
    outside = [p for p in problems if p.path.startswith("../")]
    errors = [p for p in problems if p.severity == "error" and p not in outside]
    run_problems = [f"{p.path}: {p.message}" for p in outside if p.severity == "error"]
    kind = checkpoint.metadata.get("kind")
    if kind in _EXPORT_KINDS:
        return f"model weights only ({_EXPORT_KINDS[kind]}): a resume needs training state", checkpoint, run_problems
    if errors:
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        return f"fails verify: {_problem_text(errors[0])}{more}", checkpoint, run_problems
    if checkpoint.ref.state is CheckpointState.BROKEN:
        return f"broken: {checkpoint.ref.note}", checkpoint, run_problems
    return None, checkpoint, run_problems


def _newer(a: CheckpointRef, b: CheckpointRef) -> bool:
    if a.step is not None and b.step is not None:
        return a.step > b.step
    return bool(a.created and b.created and a.created > b.created)


def _problem_text(problem: Problem) -> str:
    if problem.path and not problem.message.startswith(problem.path):
        return f"{problem.path}: {problem.message}"
    return problem.message


def _digest_problems(checkpoint: Checkpoint, progress: Progress) -> list[Problem]:
    from ckptctl.formats.manifest import read_manifest
    from ckptctl.ops.verification import check_digests

    manifest = read_manifest(checkpoint.url)
    if manifest is None:
        return []
    problems, _ = check_digests(checkpoint.url, manifest, checkpoint.files, None, progress)
    return problems


def _components(ctx: PlanContext, profile: ResumeProfile) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, str]]:
    present = ctx.checkpoint.components
    restores = tuple(c.value for c in RESUMABLE if c in present and c in profile.restored)
    missing = tuple(c.value for c in RESUMABLE if c.value not in restores)
    impacts: dict[str, str] = {}
    for name in missing:
        component = Component(name)
        if component in present:
            impacts[name] = (
                profile.impacts.get(component) or f"{name} is saved but {profile.framework} does not reload it"
            )
        else:
            impacts[name] = profile.impacts.get(component) or DEFAULT_IMPACT[component]
    extras = profile.extras(ctx)
    impacts.update(extras)
    return restores, missing + tuple(extras), impacts


def _continues_from(checkpoint: Checkpoint) -> dict[str, Any]:
    found: dict[str, Any] = {"step": checkpoint.ref.step, "epoch": checkpoint.ref.epoch}
    progress = checkpoint.metadata.get("progress")
    if isinstance(progress, Mapping):
        found.update({str(k): v for k, v in progress.items() if type(v) in (int, float, str, bool)})
    return found


# --------------------------------------------------------------------------------------------------
# Warnings.
# --------------------------------------------------------------------------------------------------


def _warnings(
    ctx: PlanContext, profile: ResumeProfile, pointer_named: CheckpointRef | None, cuda: bool | None
) -> list[str]:
    found: list[str] = []
    if profile.picks_highest:
        found += _highest_warning(ctx, profile)
    if profile.follows_pointer:
        found += _pointer_warning(ctx, pointer_named)
    found += _torn_dcp_warnings(ctx.checkpoint)
    found += _rng_warnings(ctx, cuda)
    found += profile.notes(ctx)
    return found


def _highest_warning(ctx: PlanContext, profile: ResumeProfile) -> list[str]:
    """The Trainer resumes from the highest-numbered `checkpoint-N` folder without looking inside
    (transformers#35782), even one that holds nothing yet."""
    output_dir = io.parent_of(ctx.url)
    try:
        numbered = [
            (int(m.group(1)), e.name)
            for e in io.list_dir(output_dir)
            if e.is_dir and (m := _CHECKPOINT_DIR.match(e.name))
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
        f"{profile.framework}: resume_from_checkpoint=True picks the highest checkpoint-N without checking it, "
        f"so it would load {highest} ({why}); pass the path of {io.name_of(ctx.url)} instead"
    ]


def _pointer_warning(ctx: PlanContext, pointer_named: CheckpointRef | None) -> list[str]:
    if pointer_named is None or pointer_named.url == ctx.url:
        return []
    why = next((s.reason for s in ctx.skipped if s.url == pointer_named.url), "")
    return [
        f"`latest` names {io.name_of(pointer_named.url)}{f' ({why})' if why else ''}: a load without an explicit "
        f"tag would follow it; load {io.name_of(ctx.url)} by name, or write it into `latest`"
    ]


def _torn_dcp_warnings(checkpoint: Checkpoint) -> list[str]:
    """A DCP folder whose data files are newer than its `.metadata`: an in-place overwrite that did not
    finish left the OLD metadata over (partly) NEW data, and structural verify cannot tell."""
    folders = sorted({os.path.dirname(f) for f in checkpoint.files if os.path.basename(f) == ".metadata"})
    found = []
    for folder in folders:
        url = io.join(checkpoint.url, folder) if folder else checkpoint.url
        try:
            entries = io.list_dir(url)
        except CkptctlError:
            continue
        meta = next((e.mtime for e in entries if e.name == ".metadata" and not e.is_dir), None)
        data = [e.mtime for e in entries if e.name.endswith(".distcp") and not e.is_dir and e.mtime]
        if meta and data and max(data) > meta + _MTIME_SLACK_S:
            where = f"{folder}/" if folder else ""
            found.append(
                f"{where}.metadata is older than its data files ({max(data) - meta:.0f} s): the DCP folder was "
                "overwritten in place and the save did not finish, so the data may not match the metadata; "
                "`ckptctl verify --deep` reads every tensor back (file copies that did not keep mtimes also cause this)"
            )
    return found


def _rng_warnings(ctx: PlanContext, cuda: bool | None) -> list[str]:
    """RNG keys the chosen checkpoint lacks: that newer checkpoints of the run have, or CUDA's when the
    resume runs with CUDA (a CPU save resumed on CPU lacks nothing)."""
    keys = rng_keys(ctx.checkpoint)
    if keys is None:
        return []
    found = []
    newer = [r for r in ctx.refs if r.layout == ctx.checkpoint.layout and _newer(r, ctx.checkpoint.ref)]
    for ref in _newest_first(newer):
        try:
            other = rng_keys(get_layout(ref.layout).open(ref.url))
        except CkptctlError:
            continue
        if other is not None:
            lacking = sorted(other - keys)
            if lacking:
                found.append(
                    f"{io.name_of(ctx.url)} lacks RNG state {', '.join(lacking)} that {io.name_of(ref.url)} has: "
                    "those generators keep their seeded state on resume (a loader that requires them fails)"
                )
            break
    cuda_keys = {"cuda", "torch_cuda_rng_state_all", "torch_cuda_rng_state"}
    if not keys & cuda_keys and _resumes_on_cuda(cuda):
        found.append("the RNG state holds no CUDA generators (saved without CUDA): a GPU resume leaves them unrestored")
    return found


def _resumes_on_cuda(cuda: bool | None) -> bool:
    if cuda is not None:
        return cuda
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def rng_keys(checkpoint: Checkpoint) -> frozenset[str] | None:
    """The top-level keys of the checkpoint's RNG state (None when it has none, or cannot tell).

    Layouts may record them as `metadata["rng_keys"]`; native `rng*.json` and the Trainer's
    `rng_state*.pth` are read here (a small JSON file; a pickle's `data.pkl` only).
    """
    recorded = checkpoint.metadata.get("rng_keys")
    if isinstance(recorded, list | tuple | frozenset | set):
        return frozenset(map(str, recorded))
    files = sorted(checkpoint.files)
    if checkpoint.layout == "native":
        name = next((f for f in files if re.fullmatch(r"rng(\.rank-0)?\.json", f)), None)
        if name is None:
            return None
        try:
            tree = json.loads(io.read_bytes(io.join(checkpoint.url, name))).get("tree")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, CkptctlError):
            return None
        return frozenset(tree) if isinstance(tree, dict) else None
    name = next((f for f in files if _TRAINER_RNG.match(f)), None)
    if name is None or checkpoint.layout != "hf_trainer":
        return None
    from ckptctl.formats.torch_pickle import open_torch_pickle

    try:
        root = open_torch_pickle(io.join(checkpoint.url, name), checkpoint.files[name]).root
    except CkptctlError:
        return None
    return frozenset(map(str, root)) if isinstance(root, dict) else None


def _mtime(folder: str, name: str) -> float | None:
    try:
        entries = io.list_dir(folder)
    except CkptctlError:
        return None
    return next((e.mtime for e in entries if e.name == name and not e.is_dir), None)
