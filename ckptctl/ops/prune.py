"""`prune`: delete the checkpoints of a run that a retention policy does not keep, safely (DESIGN §4).

Scan → plan → confirm → execute, as `hf cache prune` does:

- `plan_prune` (read-only) finds every checkpoint of the run, turns each into a retention `Candidate`
  with the protections found on disk, and lets `RetentionPolicy.plan` decide. A dry run stops here.
- `prune` takes the run's lock, plans, asks `confirm`, and deletes (`ops.planned`: each
  checkpoint that did not change since the plan, as `slim` slims) through `io.trash`: each checkpoint is
  renamed into the `.ckptctl-trash` folder beside it (same filesystem, atomic) and then deleted there, so
  a crash leaves either the whole checkpoint or a folder in the trash, never a half-deleted checkpoint
  that lists as complete; the next prune empties leftover trash, and an emptied trash folder goes too.
  On object stores (no rename) the files its layout names as completion markers go first, so that a
  partial delete reads as broken.

Never deleted, whatever the rules say (each kept checkpoint carries its reasons):
- the newest complete checkpoint of each folder, and pinned steps (the policy);
- what a `latest`-style pointer names (any layout's `latest_pointer`), what a framework's own files say to
  keep (each layout's `protections`: a best checkpoint its training loop goes back to), and what a symlink
  in the run points to;
- anything in progress: the layout says so (no completion marker yet), a staging name (hidden, `.tmp`,
  `staging`, ...), a live writer's lock file in or beside it, or a file modified within `grace`;
  unless its layout proves it abandoned (`Layout.abandoned`: a ckptctl staging folder whose writer is gone,
  or that nobody wrote to within `grace` and behind which a step was committed), which is deleted whatever
  the rules;
- anything whose real path lies outside the run, and symlinks: a checkpoint reached through a symlink is
  listed as kept and never followed, so neither the link nor what it points to is deleted;
- a checkpoint of a layout ckptctl does not know (state `unknown`, `layouts.generic`): whether it is whole,
  in progress or what a resume needs cannot be told.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState
from ckptctl.core.lock import RunLock
from ckptctl.core.retention import Candidate, RetentionPolicy
from ckptctl.errors import CheckpointNotFound, CkptctlError
from ckptctl.formats.documents import read_toml
from ckptctl.formats.manifest import DIGESTS_NAME
from ckptctl.io import trash
from ckptctl.io.trash import QUARANTINE_NAME
from ckptctl.layouts import DEFAULT_SCAN_DEPTH, all_layouts, get_layout, scan_run
from ckptctl.layouts.slimming import slim_checkpoint, slimmable
from ckptctl.ops.planned import (
    DEFAULT_GRACE,
    Skipped,
    apply_planned,
    busy,
    judged,
    own_parts,
    own_tree,
    run_planned,
)
from ckptctl.ops.report import SCHEMA_VERSION, Progress, display_path, flatten, iso
from ckptctl.ops.resume_plan import resume_targets
from ckptctl.units import format_size, parse_age

__all__ = [
    "POLICY_FILE",
    "PrunePlan",
    "PruneReport",
    "checkpoint_metrics",
    "delete_planned",
    "load_policy_file",
    "plan_prune",
    "prune",
]

#: The policy file `prune` reads from the run folder when no rule is given on the command line.
POLICY_FILE = "ckptctl.toml"


# ------------------------------------------------------------------------------------------ report


@dataclass(frozen=True, slots=True)
class PruneItem:
    """One checkpoint of the plan.

    Attributes:
        ref: the checkpoint as `list` sees it.
        keep: kept or deleted.
        reasons: what keeps it, or why it goes.
        size_bytes: bytes deleting it frees (symbolic links count 0; they are never followed).
        blocked: no rule keeps it; only a protection found on disk does (a pointer names it, ...).
        slim: kept without its training-only state (`keep_full_last`, `--slim`): the prune slims it.
        slim_bytes: bytes slimming it frees (planned: the files its slimmer drops; after: measured).
    """

    ref: CheckpointRef
    keep: bool
    reasons: tuple[str, ...]
    size_bytes: int
    blocked: bool = False
    slim: bool = False
    slim_bytes: int = 0

    @property
    def url(self) -> str:
        return self.ref.url

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.ref.url,
            "step": self.ref.step,
            "size_bytes": self.size_bytes,
            "reasons": list(self.reasons),
            "blocked": self.blocked,
            "slim": self.slim,
            "layout": self.ref.layout,
            "state": self.ref.state.value,
            "created": iso(self.ref.created),
        }


@dataclass(frozen=True, slots=True)
class PrunePlan:
    """What a prune would keep and delete, and why.

    Attributes:
        run: the run folder.
        policy: the rules applied.
        items: every checkpoint found, ordered by folder and step.
        grace: files modified this recently mark a checkpoint as still written.
        now: the time the plan was made.
        trash_bytes: leftover trash (from an interrupted deletion) the prune will empty.
        notes: remarks for a person (a metric `keep_best` found nowhere, ...).
    """

    run: str
    policy: RetentionPolicy
    items: tuple[PruneItem, ...]
    grace: timedelta
    now: datetime
    trash_bytes: int = 0
    notes: tuple[str, ...] = ()

    @property
    def keep(self) -> tuple[PruneItem, ...]:
        return tuple(i for i in self.items if i.keep)

    @property
    def delete(self) -> tuple[PruneItem, ...]:
        return tuple(i for i in self.items if not i.keep)

    @property
    def slim(self) -> tuple[PruneItem, ...]:
        """Kept checkpoints the prune slims (`keep_full_last`, `--slim`)."""
        return tuple(i for i in self.items if i.keep and i.slim)

    @property
    def total_bytes(self) -> int:
        return sum(i.size_bytes for i in self.items)

    @property
    def freed_bytes(self) -> int:
        return sum(i.size_bytes for i in self.delete) + sum(i.slim_bytes for i in self.slim)

    @property
    def over_budget_bytes(self) -> int:
        """How far the run stays above `max_total_size` after the plan (only protected ones are left)."""
        budget = self.policy.max_total_size
        if budget is None:
            return 0
        return max(0, self.total_bytes - self.freed_bytes - budget)

    @property
    def unmet(self) -> tuple[str, ...]:
        """What the policy wanted and cannot do, for a person: problems (exit code 1 of `prune`).

        A whole checkpoint that only a protection keeps is none of them (see `protected_notes`): that is the
        convention of the framework that wrote the run (OpenRLHF's best* tags, the Trainer's best model, a
        `latest` pointer), and a nightly prune of a healthy run must not fail for it. A protected checkpoint
        that is not whole is one: a pointer naming a broken checkpoint (a resume would load it), or a layout
        ckptctl cannot judge.
        """
        out = [_protected_text(i, self.run) for i in self.items if i.blocked and i.ref.state not in _WHOLE]
        if self.over_budget_bytes:
            out.append(
                f"the run stays {format_size(self.over_budget_bytes)} over max_total_size="
                f"{format_size(self.policy.max_total_size or 0)}: only protected checkpoints are left"
            )
        return tuple(out)

    @property
    def protected_notes(self) -> tuple[str, ...]:
        """Whole checkpoints kept only by a protection (a framework's convention, a pointer, a link): notes."""
        return tuple(_protected_text(i, self.run) for i in self.items if i.blocked and i.ref.state in _WHOLE)


def _protected_text(item: PruneItem, run: str) -> str:
    return f"{display_path(item.url, run)} is protected ({'; '.join(item.reasons)}) although no rule keeps it"


@dataclass(frozen=True, slots=True)
class PruneReport:
    """What a prune did (or, with `dry_run`, would do).

    Attributes:
        plan: the plan it executed.
        dry_run: nothing was changed.
        deleted: checkpoints deleted (with `dry_run`: those the plan deletes).
        skipped: planned deletions left in place, and why.
        trash_freed_bytes: leftover trash of an interrupted deletion emptied before starting.
        cancelled: the confirmation was declined; nothing was changed (the plan's deletions are `skipped`).
        slimmed: checkpoints slimmed (with `dry_run`: those the plan slims), with the bytes freed.
    """

    plan: PrunePlan
    dry_run: bool
    deleted: tuple[PruneItem, ...]
    skipped: tuple[Skipped[PruneItem], ...] = ()
    trash_freed_bytes: int = 0
    cancelled: bool = False
    slimmed: tuple[PruneItem, ...] = ()

    @property
    def freed_bytes(self) -> int:
        return sum(i.size_bytes for i in self.deleted) + sum(i.slim_bytes for i in self.slimmed)

    @property
    def failed(self) -> bool:
        return any(s.error for s in self.skipped)

    @property
    def unmet(self) -> tuple[str, ...]:
        """What the policy wanted and could not do (protections, the budget, checkpoints left in place)."""
        left = [f"{display_path(s.item.url, self.plan.run)} was not deleted: {s.reason}" for s in self.skipped]
        return self.plan.unmet + tuple(left)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "run": self.plan.run,
            "dry_run": self.dry_run,
            "cancelled": self.cancelled,
            "policy": self.plan.policy.to_json(),
            "grace_seconds": self.plan.grace.total_seconds(),
            "keep": [i.to_json() for i in self.plan.keep],
            "delete": [i.to_json() for i in self.deleted],
            "slim": [{**i.to_json(), "freed_bytes": i.slim_bytes} for i in self.slimmed],
            "skipped": [s.to_json() for s in self.skipped],
            "freed_bytes": self.freed_bytes,
            "total_bytes": self.plan.total_bytes,
            "remaining_bytes": self.plan.total_bytes - self.freed_bytes,
            "trash_freed_bytes": self.trash_freed_bytes,
            "unmet": list(self.unmet),
            "notes": [*self.plan.notes, *self.plan.protected_notes],
        }


class UnknownMetric(CkptctlError):
    """`keep_best` names a metric that no checkpoint of the run records (bad usage: exit code 2)."""


# ------------------------------------------------------------------------------------------ policy file


def load_policy_file(run: str) -> tuple[RetentionPolicy, timedelta | None] | None:
    """The `[retention]` table of `RUN/ckptctl.toml` as a policy (and its `grace`, if it sets one); a `[slim]`
    table's `keep_full` is its `keep_full_last`.

    Returns None when the run has no policy file.

    Raises:
        CkptctlError: the file is not TOML, has no `[retention]` table, or holds an unknown or bad rule.
    """
    url = io.join(run, POLICY_FILE)
    if not io.exists(url):
        return None
    doc = read_toml(url)
    table = doc.get("retention")
    if not isinstance(table, dict):
        raise CkptctlError(f"{url} has no [retention] table", "write the rules under [retention], e.g. keep_last = 3")
    rules = dict(table)
    grace = rules.pop("grace", None)
    slim = doc.get("slim")
    if isinstance(slim, dict) and "keep_full" in slim:  # the [slim] table's rule, for the manager and cron
        rules.setdefault("keep_full_last", slim["keep_full"])
    try:
        policy = RetentionPolicy.from_mapping(rules)
        grace_age = None if grace is None else parse_age(str(grace))
    except ValueError as exc:
        raise CkptctlError(f"{url}: {exc}") from exc
    return policy, grace_age


# ------------------------------------------------------------------------------------------ metrics


def checkpoint_metrics(ref: CheckpointRef) -> dict[str, Any]:
    """The metrics recorded with a checkpoint (`Checkpoint.metrics`, as its layout reads them), flattened
    (`{"eval": {"loss": 1}}` -> `eval.loss`); none when it does not open."""
    try:
        return flatten(get_layout(ref.layout).open(ref.url).metrics)
    except CkptctlError:
        return {}


# ------------------------------------------------------------------------------------------ scanning


@dataclass(slots=True)
class _Found:
    """A checkpoint being examined: its ref and what the disk says about it."""

    ref: CheckpointRef
    size: int
    link: str = ""  # why it is only reached through a symbolic link, or ""
    real: str = ""  # its real path (local only)
    protected: list[str] = field(default_factory=list)
    busy: str = ""


def plan_prune(
    run: str,
    policy: RetentionPolicy,
    *,
    grace: timedelta = DEFAULT_GRACE,
    now: datetime | None = None,
    max_depth: int = DEFAULT_SCAN_DEPTH,
    require_metrics: bool = False,
    slim_instead: bool = False,
) -> PrunePlan:
    """Plan a prune of `run`: read-only (directory listings, markers, metrics when `keep_best` asks).

    Args:
        run: the run folder (local path or fsspec URL); checkpoints in nested folders are found too, and
            the rules apply to each folder's checkpoints apart (`_actor/` and `_critic/`).
        policy: the rules.
        grace: a checkpoint with a file modified within this is taken to be still written.
        now: the current time (tests fix it).
        max_depth: how deep to look for checkpoints.
        require_metrics: a `keep_best` metric that no complete checkpoint records is an error rather than a
            note (a typo on the command line would otherwise keep nothing by it).
        slim_instead: complete checkpoints the rules delete are slimmed instead (`prune --slim`): each keeps
            its model; one that cannot be slimmed stays whole, with why. Broken and abandoned ones still go.

    Raises:
        CheckpointNotFound: `run` is not a folder.
        UnknownMetric: with `require_metrics`, a `keep_best` metric no complete checkpoint records.
    """
    now = now or datetime.now(UTC)
    refs = scan_run(run, max_depth=max_depth)
    found = [_examine(ref, run, now, grace) for ref in refs]
    notes = _protect(found, run)
    metrics: dict[str, Mapping[str, Any]] = {}
    if policy.keep_best:
        for f in found:
            if not f.link and f.ref.state in _WHOLE:
                metrics[f.ref.url] = checkpoint_metrics(f.ref)
        for best in policy.keep_best:
            if not any(best.value(m) is not None for m in metrics.values()):
                if require_metrics and metrics:
                    recorded = sorted({name for m in metrics.values() for name in m})
                    raise UnknownMetric(
                        f"no checkpoint of {run} records the metric {best.metric!r}: keep_best={best} would keep nothing",
                        f"metrics recorded: {', '.join(recorded)}" if recorded else "no checkpoint records any metric",
                    )
                notes.append(f"no checkpoint records the metric {best.metric!r}: keep_best={best} keeps nothing")
    candidates = [
        Candidate(
            step=f.ref.step,
            url=f.ref.url,
            series=io.parent_of(f.ref.url),
            created=f.ref.created,
            size_bytes=f.size,
            complete=f.ref.state in _WHOLE,
            metrics=metrics.get(f.ref.url, {}),
            protected=tuple(f.protected),
            busy=f.busy,
            note=f.ref.note if f.ref.state in _OFF_BRANCH else "",
            abandoned=f.ref.state is CheckpointState.ABANDONED,
            epoch=f.ref.epoch,
            slim=f.ref.state is CheckpointState.SLIM,
        )
        for f in found
        if not f.link
    ]
    by_url = {f.ref.url: f for f in found}
    items = [
        PruneItem(by_url[d.url].ref, d.keep, d.reasons, by_url[d.url].size, d.blocked, d.slim)
        for d in policy.plan(candidates, now=now)
    ]
    if slim_instead:
        items = [_slim_instead(i) for i in items]
    items = _slim_plans(run, items)
    items += [PruneItem(f.ref, True, (f.link,), 0) for f in found if f.link]
    items.sort(key=lambda i: (io.parent_of(i.url), i.ref.step is not None, i.ref.step or 0, i.ref.epoch or 0, i.url))
    # `repair`'s quarantine is no leftover: it is never emptied here, so it frees nothing.
    trash = sum(io.tree_usage(t)[0] - io.tree_usage(io.join(t, QUARANTINE_NAME))[0] for t in _trash_folders(run, items))
    return PrunePlan(run, policy, tuple(items), grace, now, trash, tuple(notes))


def _slim_instead(item: PruneItem) -> PruneItem:
    """A planned deletion of a complete checkpoint turned into a slim (`--slim`)."""
    if item.keep or item.ref.state is not CheckpointState.COMPLETE:
        return item
    return replace(item, keep=True, slim=True, reasons=(*item.reasons, "slimmed instead of deleted (--slim)"))


def _slim_plans(run: str, items: list[PruneItem]) -> list[PruneItem]:
    """The planned slims with the bytes each frees; one that a resume would load or whose layout cannot slim
    it stays whole, saying why."""
    planned = [i for i in items if i.slim]
    if not planned:
        return items
    resumed = resume_targets(run, [i.ref for i in planned])
    out = []
    for item in items:
        if item.slim:
            found = slimmable(item.ref) if item.ref.url not in resumed else resumed[item.ref.url]
            if isinstance(found, str):
                item = replace(item, slim=False, reasons=(*item.reasons, f"stays whole: {found}"))
            else:
                item = replace(item, slim_bytes=sum(found.drop_sizes.values()))
        out.append(item)
    return out


#: States the rules count as checkpoints to keep: a slim one holds its model as a complete one does.
_WHOLE = (CheckpointState.COMPLETE, CheckpointState.SLIM)

#: Why `prune` keeps a checkpoint of a layout ckptctl does not know.
UNKNOWN_KEPT = "unknown layout: ckptctl cannot tell whether it is whole or what a resume needs, so it never deletes it"

#: States whose note says why the checkpoint goes (a broken one just goes as broken).
_OFF_BRANCH = (CheckpointState.ABANDONED, CheckpointState.SUPERSEDED)


def _examine(ref: CheckpointRef, run: str, now: datetime, grace: timedelta) -> _Found:
    ref = judged(ref, grace)
    if not io.is_local(ref.url):  # an object store has no links: nothing to resolve, and its listing sized it
        return _Found(ref, ref.size_bytes, busy=busy(ref, now, grace, own_tree(ref)[1]))
    path = os.path.abspath(io.local_path(ref.url))
    run_real = os.path.realpath(io.local_path(run))
    real = os.path.realpath(path)
    expected = os.path.normpath(os.path.join(run_real, os.path.relpath(path, os.path.abspath(io.local_path(run)))))
    if real != expected:
        inside = real == run_real or real.startswith(run_real + os.sep)
        why = f"symbolic link to {real}, never followed" if inside else f"outside the run (symbolic link to {real})"
        return _Found(ref, 0, link=why, real=real)
    size, newest = own_tree(ref)
    found = _Found(ref, size, real=real, busy=busy(ref, now, grace, newest))
    if os.path.normpath(path) == os.path.normpath(os.path.abspath(io.local_path(run))):
        found.protected.append("the run folder itself")
    return found


def _protect(found: list[_Found], run: str) -> list[str]:
    """Mark what pointers name (`latest`-style files, symlinks in the run) and what each layout's
    `protections` keep, folder by folder; returns the layouts' notes."""
    notes: list[str] = []
    by_real = {f.real: f for f in found if f.real and not f.link}
    for f in found:
        if f.link and f.real in by_real:
            by_real[f.real].protected.append(f"named by the symbolic link {display_path(f.ref.url, run)}")
    series: dict[str, list[_Found]] = {}
    for f in found:
        if not f.link:
            series.setdefault(io.parent_of(f.ref.url), []).append(f)
            if f.ref.latest:
                f.protected.append("named by the run's latest pointer")
            if f.ref.state is CheckpointState.UNKNOWN:
                f.protected.append(UNKNOWN_KEPT)
    layouts = all_layouts()
    for members in series.values():
        by_url = {f.ref.url: f for f in members}
        refs = [f.ref for f in members]
        for layout in layouts:
            kept = layout.protections(refs)
            for url, reasons in kept.reasons.items():
                if url in by_url:
                    by_url[url].protected.extend(reasons)
            notes.extend(kept.notes)
    return notes


def _trash_folders(run: str, items: Iterable[PruneItem]) -> list[str]:
    """The trash folders of the run and of each folder holding checkpoints, that exist.

    Raises:
        UnsafePath: one is a symbolic link (or not a folder): the plan stops before anything is deleted.
    """
    folders = {run, *(io.parent_of(i.url) for i in items if i.ref.url != run)}
    found = []
    for folder in sorted(folders):
        bin_ = io.join(folder, trash.TRASH_NAME)
        if trash.present(bin_):
            found.append(bin_)
    return found


# ------------------------------------------------------------------------------------------ executing


def prune(
    run: str,
    policy: RetentionPolicy,
    *,
    grace: timedelta = DEFAULT_GRACE,
    dry_run: bool = False,
    confirm: Callable[[PrunePlan], bool] | None = None,
    wait: float = 30.0,
    max_depth: int = DEFAULT_SCAN_DEPTH,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
    require_metrics: bool = False,
    slim_instead: bool = False,
) -> PruneReport:
    """Plan and (unless `dry_run`) delete what the policy does not keep (and slim what it keeps slim),
    holding the run's lock.

    Args:
        run: the run folder (local path or fsspec URL).
        policy: the rules.
        grace: see `plan_prune`.
        dry_run: plan only; nothing is locked or changed.
        confirm: called with the plan when it deletes something; False cancels. None deletes unasked.
        wait: seconds to wait for another prune of the run to finish.
        max_depth: how deep to look for checkpoints.
        progress: where deletion progress goes (bytes).
        warn: where a stale lock's takeover is reported.
        require_metrics, slim_instead: see `plan_prune`.

    Raises:
        RunLocked: another prune holds the run's lock (or took it over from us).
        CheckpointNotFound: `run` is not a folder.
    """
    if dry_run:
        plan = plan_prune(
            run, policy, grace=grace, max_depth=max_depth, require_metrics=require_metrics, slim_instead=slim_instead
        )
        return PruneReport(plan, dry_run=True, deleted=plan.delete, slimmed=plan.slim)
    if not io.is_dir(run):
        raise CheckpointNotFound(f"no such run folder: {run}")

    def execute(plan: PrunePlan, lock: RunLock) -> PruneReport:
        trash_freed = _empty_trash(_trash_folders(run, plan.items))
        deleted, skipped = apply_planned(
            plan.delete, delete_planned, lock, plan.grace, "deleting", progress=progress, weight=lambda i: i.size_bytes
        )
        slimmed, not_slimmed = apply_planned(plan.slim, _slim, lock, plan.grace, "slimming")
        return PruneReport(
            plan, False, tuple(deleted), tuple(skipped + not_slimmed), trash_freed, slimmed=tuple(slimmed)
        )

    def declined(plan: PrunePlan) -> PruneReport:
        skipped = tuple(Skipped(i, "not confirmed") for i in plan.delete + plan.slim)
        return PruneReport(plan, dry_run=False, deleted=(), skipped=skipped, cancelled=True)

    return run_planned(
        run,
        lambda: plan_prune(
            run, policy, grace=grace, max_depth=max_depth, require_metrics=require_metrics, slim_instead=slim_instead
        ),
        execute,
        declined,
        changes=lambda plan: bool(plan.delete or plan.slim),
        confirm=confirm,
        command=f"ckptctl prune ({policy.describe()})",
        wait=wait,
        warn=warn,
    )


def _slim(item: PruneItem) -> PruneItem:
    return replace(item, slim_bytes=slim_checkpoint(item.ref))


def delete_planned(item: PruneItem) -> PruneItem:
    """Delete one planned checkpoint folder (`prune`, `sync --keep-local`) so that no moment shows it
    half-deleted and complete (`io.trash`); of a folder that holds checkpoints of its own, only what is the
    checkpoint's (`own_parts`)."""
    ref = item.ref
    parts = own_parts(ref)
    if parts is None:
        trash.delete(ref.url, functools.partial(_markers_to_delete, ref))
    else:
        trash.delete_parts(ref.url, _parts_in_order(ref, parts))
    return item


def _parts_in_order(ref: CheckpointRef, parts: Sequence[io.DirEntry]) -> list[io.DirEntry]:
    """Some entries of a checkpoint folder (the rest are the checkpoints it holds), in an order that keeps
    the checkpoint from reading as complete at any moment while they go one by one: the files that mark
    it complete first, the last written first (`_markers_to_delete`: of a sharded model, a shard before
    its index, since the shards without their index would read as a whole set while a set missing a shard
    reads as broken); then files from the largest; then member folders."""
    markers = [name for (name,) in _markers_to_delete(ref, {e.name: e.size for e in parts if not e.is_dir})]

    def order(entry: io.DirEntry) -> tuple[int, bool, int, str]:
        first = markers.index(entry.name) if entry.name in markers else len(markers)
        return (first, entry.is_dir, -entry.size, entry.name)

    return sorted(parts, key=order)


def _markers_to_delete(ref: CheckpointRef, files: Mapping[str, int]) -> list[tuple[str]]:
    """The digests, then the completion markers of the checkpoint's layout among `files` (relative path ->
    size), the last one its writer adds first; one at a time (`io.trash.Markers`)."""
    markers = [DIGESTS_NAME] if DIGESTS_NAME in files else []
    return [(name,) for name in markers + list(reversed(get_layout(ref.layout).completion_markers(files)))]


def _empty_trash(folders: Iterable[str]) -> int:
    """Delete what trash folders hold (left by an interrupted deletion), and the folders themselves."""
    freed = 0
    for folder in folders:
        with contextlib.suppress(CkptctlError):
            freed += trash.empty(folder)
    return freed
