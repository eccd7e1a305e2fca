"""`slim`: drop the training-only state of old checkpoints and keep each one's model (DESIGN §4 `slim`).

Scan → plan → confirm → execute, as `prune` does, and on the same plan: `plan_slim` asks `plan_prune` with a
`RetentionPolicy` of `keep_last=keep_full` (and `older_than`), so that what prune would never delete (the
newest complete checkpoint, what a `latest` pointer names, what a framework protects such as the best
checkpoint, anything in progress, links, unknown layouts) is never slimmed either. On top of that a slim
plan keeps:

- what a resume would load (`plan_resume`, per folder of checkpoints), whatever the rules say;
- checkpoints that are not complete (broken, superseded, abandoned: nothing to keep a model of), already slim,
  or whose folder holds other checkpoints;
- checkpoints of a layout without a slimmer (`capability(layout, SLIMMER)`), or whose slimmer refuses them,
  with the reason.

Executing, per checkpoint, holding the run's lock (the one `prune` takes), after checking that it did not
change since the plan: `layouts.slimming.slim_checkpoint` builds the slim version beside it and swaps it in
atomically, so that a kill at any moment leaves the whole original or the whole slim checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState, Problem, ProblemKind
from ckptctl.contract.capabilities import SLIMMER
from ckptctl.core.lock import RunLock
from ckptctl.core.retention import RetentionPolicy
from ckptctl.errors import CheckpointNotFound, CkptctlError, UnsafePath
from ckptctl.formats.documents import read_toml
from ckptctl.formats.slim_marker import SLIM_MARKER, read_slim_marker
from ckptctl.io import trash
from ckptctl.layouts import DEFAULT_SCAN_DEPTH, capability, scan_run
from ckptctl.layouts.slimming import slim_checkpoint, slimmable
from ckptctl.ops.planned import DEFAULT_GRACE, Skipped, apply_planned, run_planned
from ckptctl.ops.prune import POLICY_FILE, PruneItem, plan_prune
from ckptctl.ops.report import SCHEMA_VERSION, Progress, iso
from ckptctl.ops.resume_plan import RESUME_TARGET, resume_targets
from ckptctl.units import parse_age

__all__ = [
    "DEFAULT_KEEP_FULL",
    "RESUME_TARGET",
    "SlimItem",
    "SlimPlan",
    "SlimReport",
    "dropped_files",
    "load_slim_settings",
    "plan_slim",
    "slim",
    "slim_problems",
]

#: How many of the newest complete checkpoints of each folder stay whole by default.
DEFAULT_KEEP_FULL = 1
#: A test hook: `slim` kills its own process (SIGKILL) when it reaches the point this names (`staged`,
#: `marked`, `installed`), so that tests prove what a kill at that moment leaves.
KILL_AT_ENV = "CKPTCTL_TEST_SLIM_KILL_AT"

ALREADY_SLIM = "already slim"


# ------------------------------------------------------------------------------------------ results


@dataclass(frozen=True, slots=True)
class SlimItem:
    """One checkpoint of the plan.

    Attributes:
        ref: the checkpoint as `list` sees it.
        slim: slimmed (or to be), else kept whole.
        reasons: why it is kept whole (empty when slimmed).
        size_bytes: its bytes now.
        freed_bytes: bytes slimming it frees (planned: the dropped files; after the swap: measured).
        dropped: what the dropped files held (`optimizer`, `scheduler`, `rng`).
        drop_files: the files dropped, relative to the checkpoint.
    """

    ref: CheckpointRef
    slim: bool
    reasons: tuple[str, ...] = ()
    size_bytes: int = 0
    freed_bytes: int = 0
    dropped: tuple[str, ...] = ()
    drop_files: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return self.ref.url

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "url": self.ref.url,
            "step": self.ref.step,
            "layout": self.ref.layout,
            "state": self.ref.state.value,
            "size_bytes": self.size_bytes,
        }
        if self.slim:
            doc.update(freed_bytes=self.freed_bytes, dropped=list(self.dropped), dropped_files=list(self.drop_files))
        else:
            doc["reasons"] = list(self.reasons)
        return doc


@dataclass(frozen=True, slots=True)
class SlimPlan:
    """What a slim would do, and why.

    Attributes:
        run: the run folder (the folder holding CKPT when one checkpoint was named).
        keep_full: the newest N complete checkpoints of each folder stay whole.
        older_than: only checkpoints older than this are slimmed.
        items: every checkpoint considered, ordered by folder and step.
        now: when the plan was made.
        grace: files modified this recently mark a checkpoint as still written.
        notes: remarks for a person.
    """

    run: str
    keep_full: int
    older_than: timedelta | None
    items: tuple[SlimItem, ...]
    now: datetime
    grace: timedelta = DEFAULT_GRACE
    notes: tuple[str, ...] = ()

    @property
    def slim(self) -> tuple[SlimItem, ...]:
        return tuple(i for i in self.items if i.slim)

    @property
    def keep(self) -> tuple[SlimItem, ...]:
        return tuple(i for i in self.items if not i.slim)

    @property
    def freed_bytes(self) -> int:
        return sum(i.freed_bytes for i in self.slim)


@dataclass(frozen=True, slots=True)
class SlimReport:
    """What a slim did (with `dry_run`: would do).

    Attributes:
        plan: the plan it executed.
        dry_run: nothing was changed.
        slimmed: checkpoints slimmed (with `dry_run`: those the plan slims), with the bytes freed.
        skipped: planned ones left whole, and why.
        cancelled: the confirmation was declined; nothing was changed.
    """

    plan: SlimPlan
    dry_run: bool
    slimmed: tuple[SlimItem, ...]
    skipped: tuple[Skipped[SlimItem], ...] = ()
    cancelled: bool = False

    @property
    def freed_bytes(self) -> int:
        return sum(i.freed_bytes for i in self.slimmed)

    @property
    def failed(self) -> bool:
        return any(s.error for s in self.skipped)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "run": self.plan.run,
            "dry_run": self.dry_run,
            "cancelled": self.cancelled,
            "keep_full": self.plan.keep_full,
            "older_than_seconds": None if self.plan.older_than is None else self.plan.older_than.total_seconds(),
            "slim": [i.to_json() for i in self.slimmed],
            "keep": [i.to_json() for i in self.plan.keep],
            "skipped": [s.to_json() for s in self.skipped],
            "freed_bytes": self.freed_bytes,
            "created": iso(self.plan.now),
            "notes": list(self.plan.notes),
        }


# ------------------------------------------------------------------------------------------ settings


def load_slim_settings(run: str) -> tuple[int | None, timedelta | None]:
    """`keep_full` and `older_than` of the `[slim]` table of `RUN/ckptctl.toml` (None for each it does not
    set, or without the file or table), for cron: `ckptctl slim RUN` uses them when given no option.

    Raises:
        CkptctlError: the file is not TOML, or the table holds an unknown key or a bad value.
    """
    url = io.join(run, POLICY_FILE)
    if not io.exists(url):
        return None, None
    table = read_toml(url).get("slim")
    if table is None:
        return None, None
    if not isinstance(table, dict) or set(table) - {"keep_full", "older_than"}:
        raise CkptctlError(f"{url}: [slim] takes keep_full and older_than only")
    keep_full, older_than = table.get("keep_full"), table.get("older_than")
    if keep_full is not None and (isinstance(keep_full, bool) or not isinstance(keep_full, int) or keep_full < 1):
        raise CkptctlError(f"{url}: [slim] keep_full must be a positive integer, not {keep_full!r}")
    try:
        age = None if older_than is None else parse_age(str(older_than))
    except ValueError as exc:
        raise CkptctlError(f"{url}: [slim] older_than: {exc}") from exc
    return keep_full, age


# ------------------------------------------------------------------------------------------ planning


def plan_slim(
    target: str,
    *,
    keep_full: int = DEFAULT_KEEP_FULL,
    older_than: timedelta | None = None,
    grace: timedelta = DEFAULT_GRACE,
    now: datetime | None = None,
    max_depth: int = DEFAULT_SCAN_DEPTH,
) -> SlimPlan:
    """Plan a slim of a run, or of one checkpoint of it: read-only (listings, markers, structural verify of
    the resume candidates, the slimmers' metadata reads).

    Args:
        target: a run folder, or one checkpoint folder (then its folder is the run and only it is considered).
        keep_full: the newest N complete checkpoints of each folder stay whole (at least 1).
        older_than: only checkpoints older than this are slimmed.
        grace: a checkpoint with a file modified within this is taken to be still written.
        now: the current time (tests fix it).
        max_depth: how deep to look for checkpoints.

    Raises:
        CheckpointNotFound: `target` is not a folder.
        ValueError: `keep_full` < 1.
    """
    now = now or datetime.now(UTC)
    run, only = _run_of(target, max_depth)
    policy = RetentionPolicy(keep_last=keep_full, older_than=older_than)
    pruning = plan_prune(run, policy, grace=grace, now=now, max_depth=max_depth)
    considered = [i for i in pruning.items if only is None or i.url == only]
    resumed = resume_targets(run, [i.ref for i in considered])
    items = tuple(_decide(item, resumed) for item in considered)
    notes = list(pruning.notes)
    if only is not None and not considered:
        notes.append(f"{target} is not a checkpoint the run's scan finds")
    return SlimPlan(run, keep_full, older_than, items, now, grace, tuple(notes))


def _run_of(target: str, max_depth: int) -> tuple[str, str | None]:
    """(the run folder, the one checkpoint asked for or None): a folder that is one checkpoint holding no
    others, or a file (a Lightning `.ckpt`), is a checkpoint of the folder above it."""
    if io.exists(target) and not io.is_dir(target):
        return io.parent_of(target), target
    refs = scan_run(target, max_depth=max_depth)
    if len(refs) == 1 and refs[0].url == target and not refs[0].holds:
        return io.parent_of(target), target
    return target, None


def _decide(item: PruneItem, resumed: Mapping[str, str]) -> SlimItem:
    ref = item.ref
    whole = SlimItem(ref, slim=False, size_bytes=item.size_bytes)
    if ref.state is CheckpointState.SLIM:
        return replace(whole, reasons=(ALREADY_SLIM,))
    rules = tuple(r.replace("keep_last=", "keep_full=") for r in item.reasons) if item.keep else ()
    if ref.url in resumed:
        return replace(whole, reasons=(resumed[ref.url], *rules))
    if item.keep:
        return replace(whole, reasons=rules)
    if ref.state is not CheckpointState.COMPLETE:
        return replace(whole, reasons=(f"{ref.state.value}: only complete checkpoints are slimmed",))
    found = slimmable(ref)
    if isinstance(found, str):
        return replace(whole, reasons=(found,))
    return SlimItem(
        ref,
        slim=True,
        size_bytes=item.size_bytes,
        freed_bytes=sum(found.drop_sizes.values()) + found.recipe.shed_bytes,
        dropped=found.recipe.dropped,
        drop_files=found.recipe.drop,
    )


# ------------------------------------------------------------------------------------------ executing


def slim(
    target: str,
    *,
    keep_full: int = DEFAULT_KEEP_FULL,
    older_than: timedelta | None = None,
    grace: timedelta = DEFAULT_GRACE,
    dry_run: bool = False,
    confirm: Callable[[SlimPlan], bool] | None = None,
    wait: float = 30.0,
    max_depth: int = DEFAULT_SCAN_DEPTH,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> SlimReport:
    """Plan and (unless `dry_run`) slim, holding the run's lock (see the module docstring).

    Args:
        target, keep_full, older_than, grace, max_depth: see `plan_slim`.
        dry_run: plan only; nothing is locked or changed.
        confirm: called with the plan when it slims something; False cancels. None slims unasked.
        wait: seconds to wait for another prune or slim of the run to finish.
        progress: where progress goes (checkpoints).
        warn: where a stale lock's takeover is reported.

    Raises:
        RunLocked: another prune or slim holds the run's lock.
        CheckpointNotFound: `target` is not a folder.
        UnsafePath: the run's trash, where slim versions are built, is a link.
    """
    options = {"keep_full": keep_full, "older_than": older_than, "grace": grace, "max_depth": max_depth}
    if dry_run:
        plan = plan_slim(target, **options)  # type: ignore[arg-type]
        return SlimReport(plan, dry_run=True, slimmed=plan.slim)
    if not io.exists(target):
        raise CheckpointNotFound(f"no such run or checkpoint folder: {target}")
    run, _ = _run_of(target, max_depth)

    def execute(plan: SlimPlan, lock: RunLock) -> SlimReport:
        for item in plan.slim:  # refuse a link where any slim version would be built, before changing anything
            trash.check_trash(trash.trash_of(item.url))
        done, left = apply_planned(
            plan.slim, _slim_one, lock, plan.grace, "slimming", fatal=(UnsafePath,), progress=progress
        )
        return SlimReport(plan, False, tuple(done), tuple(left))

    def declined(plan: SlimPlan) -> SlimReport:
        skipped = tuple(Skipped(i, "not confirmed") for i in plan.slim)
        return SlimReport(plan, dry_run=False, slimmed=(), skipped=skipped, cancelled=True)

    return run_planned(
        run,
        lambda: plan_slim(target, **options),  # type: ignore[arg-type]
        execute,
        declined,
        changes=lambda plan: bool(plan.slim),
        confirm=confirm,
        command=f"ckptctl slim (keep_full={keep_full})",
        wait=wait,
        warn=warn,
    )


def _slim_one(item: SlimItem) -> SlimItem:
    return replace(item, freed_bytes=slim_checkpoint(item.ref, kill_at=os.environ.get(KILL_AT_ENV)))


# ------------------------------------------------------------------------------------------ verify


def slim_problems(layout: str, url: str, problems: list[Problem]) -> list[Problem]:
    """`verify` of a slim checkpoint of `layout`: what its reader reports about the files `slim` dropped (and
    what its slimmer says the drop explains) is left out; the files the marker records as kept must be there
    with their sizes."""
    try:
        marker = read_slim_marker(url)
    except CkptctlError as exc:
        return [*problems, Problem(ProblemKind.BAD_METADATA, SLIM_MARKER, exc.message)]
    if marker is None:
        return problems
    dropped = set(marker.dropped_files)
    slimmer = capability(layout, SLIMMER)

    def expected(problem: Problem) -> bool:
        if problem.path in dropped or (problem.path == SLIM_MARKER and problem.severity != "error"):
            return True
        return slimmer is not None and slimmer.expected(problem)

    kept = [p for p in problems if not expected(p)]
    files = {rel: e.size for rel, e in io.list_tree(url).items()}
    for rel, size in sorted(marker.kept_files.items()):
        if rel not in files:
            kept.append(Problem(ProblemKind.MISSING_FILE, rel, f"{rel} is missing (the slim marker records it kept)"))
        elif files[rel] != size:
            kind = ProblemKind.TRUNCATED if files[rel] < size else ProblemKind.SIZE_MISMATCH
            kept.append(Problem(kind, rel, f"{rel} has {files[rel]} bytes, the slim marker recorded {size}"))
    return kept


def dropped_files(url: str) -> frozenset[str]:
    """The files `slim` dropped from the checkpoint at `url` (none when it is not slim or its marker is bad)."""
    try:
        marker = read_slim_marker(url)
    except CkptctlError:
        return frozenset()
    return frozenset() if marker is None else frozenset(marker.dropped_files)
