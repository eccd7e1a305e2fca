"""What a layout tells `resume-plan`: how its framework resumes (one `ResumeProfile` per layout).

A layout returns its profile from `Layout.resume_profile()`; the framework's own rules (its resume
setting, world-size rules, traps) live in its package (`ckptctl/frameworks/<name>/resume.py`), and
`ckptctl.ops.resume_plan` applies them without naming any framework. The types and the verdicts several
frameworks share are here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Component, Problem
from ckptctl.errors import CkptctlError

__all__ = [
    "DEFAULT_IMPACT",
    "RESUMABLE",
    "Blocker",
    "LatestPick",
    "LoadedAlong",
    "PlanContext",
    "PlannedLayout",
    "ResumeProfile",
    "Skipped",
    "WorldSizeCheck",
    "generic_profile",
    "pickled_rng_keys",
    "recorded_rng_keys",
    "target_ranks",
    "unchecked_world_size",
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
class LoadedAlong:
    """A checkpoint the framework loads along with the chosen one, from where its own setting points (the
    critic OpenRLHF loads from `_critic/latest` with the actor): the resume fails when it does not load.

    Attributes:
        url: the checkpoint folder that will be loaded (it may not exist).
        what: what it is, for people ("the critic's `latest` tag").
        fix: what to do first when it does not load ("write global_step2 into _critic/latest").
    """

    url: str
    what: str
    fix: str


@dataclass(frozen=True, slots=True)
class LatestPick:
    """What a framework's own latest-finder loads when a resume lets it choose (`resume_from_checkpoint=True`, a
    `latest` pointer, a tracker): `verify --latest` judges this one, whatever ckptctl would pick instead.

    Attributes:
        url: the folder (or file) it loads; it may be no checkpoint at all (an empty `checkpoint-N`).
        finder: the framework's code that picks it, for people ("transformers get_last_checkpoint: ...").
    """

    url: str
    finder: str

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "finder": self.finder}


@dataclass(frozen=True, slots=True)
class Blocker:
    """A checkpoint loaded along with the chosen one that does not load: the resume, as it stands, fails.

    Attributes:
        url: the checkpoint folder.
        step: its step, when it can be read.
        reason: why it does not load (missing, broken, failing structural verify).
        fix: what to do first.
    """

    url: str
    step: int | None
    reason: str
    fix: str

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "step": self.step, "reason": self.reason, "fix": self.fix}


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


class PlannedLayout(Protocol):
    """What a profile's rules may ask of the layout of another checkpoint of the run (`PlanContext.layout_of`):
    the `Layout` hooks they use, named here so that the contract needs no registry."""

    def open(self, url: str) -> Checkpoint: ...

    def verify(self, checkpoint: Checkpoint) -> list[Problem]: ...

    def resume_profile(self) -> ResumeProfile: ...


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
        layout_of: the layout registered under a name (the registry's `get_layout`), for rules that look at
            other checkpoints of the run (a ZeRO tag's universal conversion beside it). Given by the planner,
            which knows the registry; the shared readers do not import it.
    """

    run: str
    checkpoint: Checkpoint
    refs: tuple[CheckpointRef, ...]
    skipped: tuple[Skipped, ...]
    target: int | None
    world: WorldSizeCheck | None = None
    layout_of: Callable[[str], PlannedLayout] = field(kw_only=True)

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


def _nothing_along(ctx: PlanContext) -> list[LoadedAlong]:
    return []


def _not_converted(url: str) -> str | None:
    return None


def _no_pick(refs: Sequence[CheckpointRef]) -> LatestPick | None:
    return None


#: An RNG state's keys name generators (`cuda`, `torch_cuda_rng_state_all`); a longer key names none.
_MAX_RNG_KEY = 200


def pickled_rng_keys(url: str, size: int | None = None, ignore: frozenset[str] = frozenset()) -> frozenset[str] | None:
    """The generator names among the top-level keys of the torch.save RNG state at `url` (its `data.pkl`
    only), less `ignore`; None when the file cannot be read or holds no dict.

    Only string keys of at most `_MAX_RNG_KEY` characters are names: a hostile file's other keys (a tuple a
    million levels deep, whose `str()` recurses that deep; a 16 MiB string) name no generator and are
    neither converted nor shown.
    """
    from ckptctl.formats.torch_pickle import open_torch_pickle

    try:
        root = open_torch_pickle(url, size).root
    except CkptctlError:
        return None
    if not isinstance(root, dict):
        return None
    return frozenset(k for k in root if type(k) is str and len(k) <= _MAX_RNG_KEY) - ignore


def recorded_rng_keys(checkpoint: Checkpoint) -> frozenset[str] | None:
    """The RNG keys the layout recorded when it opened the checkpoint (`Checkpoint.rng_keys`)."""
    return checkpoint.rng_keys


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
        resumable: False for model-only folders (an HF export restores no training state).
        export_name: what the framework's model-only folders are, for the reason a plan skips them.
        run_of: the run folder a checkpoint belongs to (the folder its checkpoints are grouped by).
        companion: checkpoints that are not resumed from but load along with the chosen one (OpenRLHF's
            critic tags); they are left out of the candidates, unless the run holds nothing else.
        loaded_with: the checkpoints the framework loads along with the chosen one (OpenRLHF's critic from
            `_critic/latest`); the plan verifies each, and one that does not load blocks the resume.
        rng_keys: the top-level keys of the checkpoint's RNG state (None when it has none, or cannot
            tell); by default what the layout recorded, a profile may read them on demand instead.
        traps: warnings the files on disk give about the chosen checkpoint that structural verify cannot
            tell (a DCP folder overwritten in place, a folder the framework would pick instead); listed first.
        notes: other framework-specific warnings, listed last.
        extras: framework-specific "not restored" lines beyond components (AReaL's critic).
        latest_pick: what the framework's own latest-finder loads among the run's checkpoints (`refs`, newest first,
            one folder's), when a resume lets it choose; None where it has none of its own or it would find
            nothing. A profile that `follows_pointer` without one picks what the run's pointer names.
        converted_from: the checkpoint of the run a checkpoint of this layout was converted from, holding the
            same training state in a form the framework loads on fewer world sizes (the ZeRO tag of a DeepSpeed
            universal checkpoint), or None. At equal steps the original is tried first, and a plan whose
            original does not load on the target number of ranks takes a conversion of it that does.
    """

    framework: str
    hint: Callable[[PlanContext], str]
    world_size: Callable[[PlanContext], WorldSizeCheck]
    restored: frozenset[Component] = frozenset(RESUMABLE)
    impacts: Mapping[Component, str] = field(default_factory=dict)
    follows_pointer: bool = False
    resumable: bool = True
    export_name: str = "an HF export"
    run_of: Callable[[str], str] = io.parent_of
    companion: Callable[[CheckpointRef], bool] = _never
    loaded_with: Callable[[PlanContext], list[LoadedAlong]] = _nothing_along
    rng_keys: Callable[[Checkpoint], frozenset[str] | None] = recorded_rng_keys
    traps: Callable[[PlanContext], list[str]] = _no_notes
    notes: Callable[[PlanContext], list[str]] = _no_notes
    extras: Callable[[PlanContext], dict[str, str]] = _no_extras
    converted_from: Callable[[str], str | None] = _not_converted
    latest_pick: Callable[[Sequence[CheckpointRef]], LatestPick | None] = _no_pick


def target_ranks(ctx: PlanContext, saved: int | None) -> int | None:
    """The ranks of the resumed run: those asked for, else the saved number."""
    return ctx.target if ctx.target is not None else saved


def unchecked_world_size(ctx: PlanContext) -> WorldSizeCheck:
    """The verdict for a framework whose world-size rules ckptctl does not know."""
    saved = ctx.checkpoint.world_size
    return WorldSizeCheck(
        saved,
        target_ranks(ctx, saved),
        None,
        "not checked for this framework: keep the parallelism it was saved with to be safe",
    )


def _generic_hint(ctx: PlanContext) -> str:
    return f"load {ctx.url} with the framework that wrote it ({ctx.checkpoint.layout})"


def generic_profile(layout: str) -> ResumeProfile:
    """The plan for a layout that has no profile of its own: what it holds, and no framework rules."""
    return ResumeProfile(framework=layout, hint=_generic_hint, world_size=unchecked_world_size)
