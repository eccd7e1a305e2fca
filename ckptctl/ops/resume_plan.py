"""`resume-plan`: which checkpoint of a run a resume should load, what it brings back, and how to ask for it.

The checkpoints of the run are tried newest first: one still being written, abandoned, superseded (off
the run's branch after a rollback), slim (`ckptctl slim` dropped its training-only state), broken, or failing the layout's structural verify is skipped with its
reason, and the first that passes is the plan. Frameworks that follow a `latest` pointer load the tag it
names, so newer tags are skipped as unfinished saves. A checkpoint that does not load on the target number
of ranks gives way to a conversion of it that does (`ResumeProfile.converted_from`). The plan then says
what the framework restores from that checkpoint and what it does not (with what that means for the run),
whether it loads on the target number of ranks and how many bytes each rank reads, the exact setting that
resumes from it, and warnings: a `latest` naming a broken tag, RNG keys older checkpoints lack, and the
traps of each framework (LAYOUTS.md). What the framework loads along with the chosen checkpoint
(OpenRLHF's critic, from its own `latest`) is verified too: one that does not load is a blocker, and the
resume as it stands fails.

What each framework does is the `ResumeProfile` its layout returns (`Layout.resume_profile()`, in
`ckptctl/frameworks/<name>/resume.py`); a layout without one gets a generic plan. Nothing here names a
framework.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Component, Problem, Role
from ckptctl.contract.base import checkpoint_problems
from ckptctl.contract.resume import (
    DEFAULT_IMPACT,
    RESUMABLE,
    Blocker,
    LatestPick,
    LoadedAlong,
    PlanContext,
    ResumeProfile,
    Skipped,
    WorldSizeCheck,
    generic_profile,
)
from ckptctl.errors import CheckpointNotFound, CkptctlError, UnknownLayout
from ckptctl.formats.manifest import read_manifest
from ckptctl.formats.slim_marker import SLIM_NOTE
from ckptctl.layouts import detect, get_layout, scan_run
from ckptctl.layouts.run_state import run_state_problems, run_state_profile, with_run_state
from ckptctl.ops.digests import check_digests
from ckptctl.ops.report import SCHEMA_VERSION, NoProgress, Progress, iso, jsonable

__all__ = [
    "RESUME_TARGET",
    "Blocker",
    "ResumePlan",
    "Skipped",
    "WorldSizeCheck",
    "plan_resume",
    "profile_for",
    "resume_targets",
    "rng_keys",
]

#: Why `resume_targets` names a checkpoint.
RESUME_TARGET = "a resume would load it"


# --------------------------------------------------------------------------------------------------
# Results.
# --------------------------------------------------------------------------------------------------


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
        blockers: checkpoints the framework loads along with the chosen one that do not load (the resume
            fails until each one's `fix` is done).
        latest_pick: what the framework's own latest-finder loads when the resume lets it choose (the Trainer's
            highest `checkpoint-N`, the checkpoint a `latest` pointer names), which may be a skipped one; None
            where it has no finder of its own.
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
    blockers: tuple[Blocker, ...] = ()
    latest_pick: LatestPick | None = None

    @property
    def resumable(self) -> bool:
        return self.checkpoint is not None

    @property
    def unknown_layout(self) -> tuple[Skipped, ...]:
        """Checkpoints skipped because ckptctl does not know their layout (state `unknown`)."""
        return tuple(s for s in self.skipped if s.state is CheckpointState.UNKNOWN)

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
            "blockers": [b.to_json() for b in self.blockers],
            "unknown_layout": [s.url for s in self.unknown_layout],
            "latest_pick": None if self.latest_pick is None else self.latest_pick.to_json(),
        }


def profile_for(layout: str) -> ResumeProfile:
    """The profile of a layout (`Layout.resume_profile()`); names no layout knows get a generic plan."""
    try:
        return get_layout(layout).resume_profile()
    except UnknownLayout:
        return generic_profile(layout)


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
    rejected: Mapping[str, str] | None = None,
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
        rejected: checkpoints the caller rules out, with the reason (`repair`: a step whose other role fails
            verify); they are skipped as the plan's own verdicts are.

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
    newest = _newest_first(refs)
    # What loads along with another checkpoint is no candidate of its own, unless the folder holds nothing
    # else (`resume-plan RUN/_critic` plans the critic's resume).
    ordered = [r for r in newest if not profile_for(r.layout).companion(r)] or newest
    pointer_named = _pointer_target(ordered)
    picked = _latest_pick(ordered, pointer_named)
    skipped: list[Skipped] = []
    chosen: Checkpoint | None = None
    run_warnings: list[str] = []
    for ref in ordered:
        if rejected and ref.url in rejected:
            skipped.append(Skipped(ref.url, ref.step, rejected[ref.url], ref.layout, ref.state))
            continue
        profile = _profile(ref)
        reason, checkpoint, pointer_problems = _judge(ref, profile, pointer_named, digests, progress or NoProgress())
        run_warnings += [p for p in pointer_problems if p not in run_warnings]
        if reason is None and checkpoint is not None:
            chosen = checkpoint
            break
        skipped.append(Skipped(ref.url, ref.step, reason or "cannot be opened", ref.layout, ref.state))
    if chosen is None:
        return ResumePlan(
            run=run,
            checkpoint=None,
            framework=None,
            skipped=tuple(skipped),
            warnings=tuple(run_warnings),
            latest_pick=picked,
        )
    profile = _profile(chosen.ref)
    ctx = PlanContext(run, chosen, tuple(refs), tuple(skipped), world_size, layout_of=get_layout)
    ctx = replace(ctx, world=profile.world_size(ctx))
    if ctx.world is not None and ctx.world.ok is False:
        found = _conversion_that_loads(ctx, ordered, digests, progress or NoProgress())
        if found is not None:
            conversion, profile, world, conversion_problems = found
            reason = (
                f"does not load on {ctx.world.target} ranks ({ctx.world.note}): resuming from "
                f"{io.name_of(conversion.url)}, a conversion of it that does"
            )
            skipped.append(Skipped(chosen.url, chosen.ref.step, reason, chosen.layout, chosen.ref.state))
            run_warnings += [p for p in conversion_problems if p not in run_warnings]
            chosen = conversion
            ctx = PlanContext(run, chosen, tuple(refs), tuple(skipped), world_size, world, layout_of=get_layout)
    restores, missing, impacts = _components(ctx, profile)
    warnings = run_warnings + _warnings(ctx, profile, pointer_named, cuda)
    blockers = tuple(
        blocker
        for along in profile.loaded_with(ctx)
        if (blocker := _blocker(ctx, profile, along, digests, progress or NoProgress())) is not None
    )
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
        blockers=blockers,
        latest_pick=picked,
    )


def resume_targets(run: str, refs: Sequence[CheckpointRef]) -> dict[str, str]:
    """url -> why it must be left as it is, for what a resume of each folder of `refs` (checkpoints of `run`)
    would load: the run's own plan, and each folder's; where that cannot be told, every checkpoint of the
    folder, with why. What `slim` (and `prune --slim`) never touch."""
    protected: dict[str, str] = {}
    folders = sorted({io.parent_of(r.url) for r in refs} - {run})
    for folder in [run, *folders]:
        try:
            # Only the checkpoint matters here, not the warnings (whether CUDA is there would import torch).
            plan = plan_resume(folder, cuda=False)
        except CkptctlError as exc:
            if folder == run:  # several runs below it: each folder of checkpoints below says
                continue
            for ref in refs:
                if io.parent_of(ref.url) == folder:
                    protected.setdefault(ref.url, f"what a resume would load cannot be told ({exc.message})")
            continue
        if plan.checkpoint is not None:
            protected.setdefault(plan.checkpoint.url, RESUME_TARGET)
    return protected


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


def _profile(ref: CheckpointRef) -> ResumeProfile:
    """The resume profile of `ref`'s layout, or of it and the run-level state file the scan attached to it."""
    profile = profile_for(ref.layout)
    return run_state_profile(profile, ref) if ref.run_state else profile


def _newest_first(refs: Sequence[CheckpointRef]) -> list[CheckpointRef]:
    def key(ref: CheckpointRef) -> tuple[bool, int, float, bool, bool, float]:
        created = ref.created.timestamp() if ref.created else 0.0
        # At equal steps, a checkpoint before its conversions (which a plan takes when it does not load on the
        # target ranks), and what a `latest` pointer names first (a best-so-far copy saved beside the step's own).
        # Without steps, epochs order them (`epoch_0/`, `epoch_1/` model folders).
        original = profile_for(ref.layout).converted_from(ref.url) is None
        step = ref.step if ref.step is not None else -1
        epoch = ref.epoch if ref.epoch is not None else -1.0
        return (ref.step is not None, step, epoch, original, ref.latest, created)

    return sorted(refs, key=key, reverse=True)


def _conversion_that_loads(
    ctx: PlanContext, ordered: Sequence[CheckpointRef], digests: bool, progress: Progress
) -> tuple[Checkpoint, ResumeProfile, WorldSizeCheck, list[str]] | None:
    """A conversion of the chosen checkpoint (`ResumeProfile.converted_from`: a DeepSpeed universal
    checkpoint of a ZeRO tag) that passes verify and loads on the target ranks: the opened conversion, its
    profile and world-size verdict, and the run-level problems its verify reported."""
    for ref in ordered:
        profile = profile_for(ref.layout)
        if profile.converted_from(ref.url) != ctx.url:
            continue
        reason, checkpoint, problems = _judge(ref, profile, None, digests, progress)
        if reason is not None or checkpoint is None:
            continue
        world = profile.world_size(replace(ctx, checkpoint=checkpoint, world=None))
        if world.ok:
            return checkpoint, profile, world, problems
    return None


def _pointer_target(ordered: Sequence[CheckpointRef]) -> CheckpointRef | None:
    """The checkpoint a `latest` pointer names, for frameworks that load what it names."""
    return next((r for r in ordered if r.latest and profile_for(r.layout).follows_pointer), None)


def _latest_pick(ordered: Sequence[CheckpointRef], pointer_named: CheckpointRef | None) -> LatestPick | None:
    """What the framework of the run's newest resumable checkpoint picks when a resume lets it choose: its
    profile's own finder, else the checkpoint the run's pointer names when it follows one."""
    profile = next((p for ref in ordered if (p := _profile(ref)).resumable), None)
    if profile is None:
        return None
    picked = profile.latest_pick(ordered)
    if picked is None and profile.follows_pointer and pointer_named is not None:
        picked = LatestPick(pointer_named.url, f"{profile.framework} follows the run's pointer")
    return picked


def _judge(
    ref: CheckpointRef,
    profile: ResumeProfile,
    pointer_named: CheckpointRef | None,
    digests: bool,
    progress: Progress,
) -> tuple[str | None, Checkpoint | None, list[str]]:
    """Why `ref` must not be resumed from (None when it can), the opened checkpoint, and run-level problems
    its verify reported (a `latest` pointer naming a missing tag concerns the run, not this checkpoint)."""
    if ref.state is CheckpointState.UNKNOWN:
        return ref.note or "not a layout ckptctl knows", None, []
    if ref.state is CheckpointState.IN_PROGRESS:
        return f"in progress: {ref.note or 'still being written'}", None, []
    if ref.state is CheckpointState.ABANDONED:
        return f"abandoned: {ref.note or 'a save that stopped'}", None, []
    if ref.state is CheckpointState.SUPERSEDED:  # the run went back and saved again: it follows that branch
        return ref.note or "superseded", None, []
    if ref.state is CheckpointState.BROKEN:
        return f"broken: {ref.note or 'incomplete'}", None, []
    if ref.state is CheckpointState.SLIM:  # `ckptctl slim` kept its model only
        return SLIM_NOTE, None, []
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
        problems = checkpoint_problems(layout, checkpoint)
        if ref.run_state:  # what a resume loads with the model folder is verified with it
            problems += run_state_problems(ref.run_state)
            checkpoint = with_run_state(replace(checkpoint, ref=replace(checkpoint.ref, run_state=ref.run_state)))
    except CkptctlError as exc:
        return f"fails verify: {exc.message}", None, []
    if digests:
        problems += _digest_problems(checkpoint, progress)
    outside = [p for p in problems if p.path.startswith("../")]
    errors = [p for p in problems if p.severity == "error" and p not in outside]
    run_problems = [f"{p.path}: {p.message}" for p in outside if p.severity == "error"]
    if checkpoint.role is Role.EXPORT:
        return f"model weights only ({profile.export_name}): a resume needs training state", checkpoint, run_problems
    if errors:
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        return f"fails verify: {_problem_text(errors[0])}{more}", checkpoint, run_problems
    if checkpoint.ref.state is CheckpointState.BROKEN:
        return f"broken: {checkpoint.ref.note}", checkpoint, run_problems
    return None, checkpoint, run_problems


def _blocker(
    ctx: PlanContext, profile: ResumeProfile, along: LoadedAlong, digests: bool, progress: Progress
) -> Blocker | None:
    """A blocker when what loads along with the chosen checkpoint does not load: missing, not complete, or
    failing its layout's structural verify (and digests, when asked), as a candidate would."""
    step = None
    try:
        layout, ref = detect(along.url, explain=False)
        step = ref.step
        if ref.state is not CheckpointState.COMPLETE:
            reason = f"is {ref.state.value}" + (f" ({ref.note})" if ref.note else "")
        else:
            checkpoint = layout.open(along.url)
            problems = checkpoint_problems(layout, checkpoint)
            if digests:
                problems += _digest_problems(checkpoint, progress)
            errors = [p for p in problems if p.severity == "error" and not p.path.startswith("../")]
            if not errors and checkpoint.ref.state is CheckpointState.COMPLETE:
                return None
            reason = f"fails verify: {_problem_text(errors[0])}" if errors else f"is broken ({checkpoint.ref.note})"
    except CheckpointNotFound:
        reason = "does not exist"
    except CkptctlError as exc:
        reason = f"cannot be read: {exc.message}"
    return Blocker(
        along.url,
        step,
        f"{along.what} {io.name_of(along.url)} {reason}: {profile.framework} loads it along with "
        f"{io.name_of(ctx.url)}, so the resume fails",
        along.fix,
    )


def _newer(a: CheckpointRef, b: CheckpointRef) -> bool:
    if a.step is not None and b.step is not None:
        return a.step > b.step
    return bool(a.created and b.created and a.created > b.created)


def _problem_text(problem: Problem) -> str:
    if problem.path and not problem.message.startswith(problem.path):
        return f"{problem.path}: {problem.message}"
    return problem.message


def _digest_problems(checkpoint: Checkpoint, progress: Progress) -> list[Problem]:
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
    found.update({str(k): v for k, v in checkpoint.progress.items() if type(v) in (int, float, str, bool)})
    return found


# --------------------------------------------------------------------------------------------------
# Warnings.
# --------------------------------------------------------------------------------------------------


def _warnings(
    ctx: PlanContext, profile: ResumeProfile, pointer_named: CheckpointRef | None, cuda: bool | None
) -> list[str]:
    found = list(profile.traps(ctx))
    if profile.follows_pointer:
        found += _pointer_warning(ctx, pointer_named)
    found += _rng_warnings(ctx, cuda)
    found += profile.notes(ctx)
    return found


def _pointer_warning(ctx: PlanContext, pointer_named: CheckpointRef | None) -> list[str]:
    if pointer_named is None or pointer_named.url == ctx.url:
        return []
    why = next((s.reason for s in ctx.skipped if s.url == pointer_named.url), "")
    return [
        f"`latest` names {io.name_of(pointer_named.url)}{f' ({why})' if why else ''}: a load without an explicit "
        f"tag would follow it; load {io.name_of(ctx.url)} by name, or write it into `latest`"
    ]


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
    cuda_keys = {"cuda", "torch_cuda_rng_state_all", "torch_cuda_rng_state", "torch_cuda_manual_seed"}
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
    """The top-level keys of the checkpoint's RNG state (None when it has none, or cannot tell), as its
    layout's profile reads them."""
    return profile_for(checkpoint.layout).rng_keys(checkpoint)
