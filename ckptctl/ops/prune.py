"""`prune`: delete the checkpoints of a run that a retention policy does not keep, safely (DESIGN §4).

Scan → plan → confirm → execute, as `hf cache prune` does:

- `plan_prune` (read-only) finds every checkpoint of the run, turns each into a retention `Candidate`
  with the protections found on disk, and lets `RetentionPolicy.plan` decide. A dry run stops here.
- `prune` takes the run's lock, plans, asks `confirm`, and deletes through `io.trash`: each checkpoint is
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
import re
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, Protocol, TypeVar

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState
from ckptctl.core.lock import LOCK_NAME, STALE_AFTER, LockUnusable, RunLock, read_lock, stale_reason
from ckptctl.core.retention import Candidate, RetentionPolicy
from ckptctl.errors import CheckpointNotFound, CkptctlError
from ckptctl.formats.documents import read_toml
from ckptctl.formats.manifest import DIGESTS_NAME
from ckptctl.io import trash
from ckptctl.io.trash import QUARANTINE_NAME
from ckptctl.layouts import DEFAULT_SCAN_DEPTH, all_layouts, detect, get_layout, scan_run
from ckptctl.layouts.slimming import slim_checkpoint, slimmable
from ckptctl.ops.report import SCHEMA_VERSION, NoProgress, Progress, display_path, flatten, iso
from ckptctl.ops.resume_plan import resume_targets
from ckptctl.units import format_age, format_size, parse_age

__all__ = [
    "DEFAULT_GRACE",
    "POLICY_FILE",
    "Planned",
    "PrunePlan",
    "PruneReport",
    "Skipped",
    "apply_planned",
    "changed_since_plan",
    "checkpoint_metrics",
    "delete_planned",
    "load_policy_file",
    "plan_prune",
    "prune",
]

#: Checkpoints with a file modified more recently than this are taken to be still written.
DEFAULT_GRACE = timedelta(minutes=10)
#: The policy file `prune` reads from the run folder when no rule is given on the command line.
POLICY_FILE = "ckptctl.toml"
_STAGING_NAME = re.compile(
    r"(?:^|[._-])(?:tmp|temp|staging|partial|incomplete|in[_-]?progress|writing)(?:$|[._-])", re.IGNORECASE
)
_LOCK_FILE = re.compile(r"^(?:\.?lock|LOCK|.+\.lock)$")


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


class Planned(Protocol):
    """An item of a plan that names its checkpoint (`PruneItem`, `SlimItem`)."""

    @property
    def ref(self) -> CheckpointRef: ...


Item = TypeVar("Item", bound=Planned)


@dataclass(frozen=True, slots=True)
class Skipped(Generic[Item]):
    """A planned change (`prune`'s deletion or slim, `slim`'s slim) left undone when its turn came.

    Attributes:
        item: the planned change.
        reason: why it was left (the prompt was declined, the checkpoint changed since the plan, or the change
            failed).
        error: True when the change failed (as opposed to a protection found at the last moment).
    """

    item: Item
    reason: str
    error: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"url": self.item.ref.url, "step": self.item.ref.step, "reason": self.reason, "error": self.error}


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
    trash = sum(_tree_size(t) - _tree_size(io.join(t, QUARANTINE_NAME)) for t in _trash_folders(run, items))
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


def _judged(ref: CheckpointRef, grace: timedelta) -> CheckpointRef:
    """`ref` in progress or abandoned as its layout judges it under this prune's `grace` (the scan judged
    it under the layout's own)."""
    if ref.state not in (CheckpointState.IN_PROGRESS, CheckpointState.ABANDONED):
        return ref
    why = get_layout(ref.layout).abandoned(ref, grace)
    if why:
        return replace(ref, state=CheckpointState.ABANDONED, note=f"an interrupted save: {why}")
    if ref.state is CheckpointState.ABANDONED:
        return replace(ref, state=CheckpointState.IN_PROGRESS, note=f"may still be written (grace {format_age(grace)})")
    return ref


def _examine(ref: CheckpointRef, run: str, now: datetime, grace: timedelta) -> _Found:
    ref = _judged(ref, grace)
    if not io.is_local(ref.url):
        return _Found(ref, ref.size_bytes, busy=_busy(ref, now, grace, _own_tree(ref)[1]))
    path = os.path.abspath(io.local_path(ref.url))
    run_real = os.path.realpath(io.local_path(run))
    real = os.path.realpath(path)
    expected = os.path.normpath(os.path.join(run_real, os.path.relpath(path, os.path.abspath(io.local_path(run)))))
    if real != expected:
        inside = real == run_real or real.startswith(run_real + os.sep)
        why = f"symbolic link to {real}, never followed" if inside else f"outside the run (symbolic link to {real})"
        return _Found(ref, 0, link=why, real=real)
    size, newest = _own_tree(ref)
    found = _Found(ref, size, real=real, busy=_busy(ref, now, grace, newest))
    if os.path.normpath(path) == os.path.normpath(os.path.abspath(io.local_path(run))):
        found.protected.append("the run folder itself")
    return found


def _busy(ref: CheckpointRef, now: datetime, grace: timedelta, newest: float | None) -> str:
    """Why the checkpoint is being written right now, or "" (`ref` as `_judged`)."""
    name = io.name_of(ref.url)
    if ref.state is CheckpointState.ABANDONED:  # its layout proved it: a staging name says nothing more
        return ""
    if ref.state is CheckpointState.IN_PROGRESS:
        return f"in progress: {ref.note}" if ref.note else "in progress"
    if name.startswith(".") or _STAGING_NAME.search(name):
        return f"in progress (staging name {name!r})"
    lock = _live_writer_lock(ref.url)
    if lock:
        return f"in progress (locked by {lock})"
    if newest is not None and grace.total_seconds() > 0:
        age = now.timestamp() - newest
        if age < grace.total_seconds():
            return f"modified {format_age(timedelta(seconds=max(0, age)))} ago (within grace {format_age(grace)})"
    return ""


def _live_writer_lock(url: str) -> str:
    """A live lock file inside the checkpoint folder or beside it (`NAME.lock`), described; or ""."""
    candidates = [io.join(io.parent_of(url), f"{io.name_of(url)}.lock")]
    with contextlib.suppress(CkptctlError):
        candidates += [
            io.join(url, e.name)
            for e in io.list_dir(url)
            if not e.is_dir and _LOCK_FILE.match(e.name) and e.name != LOCK_NAME
        ]
    for lock_url in candidates:
        try:
            found = read_lock(lock_url)
        except LockUnusable:  # a FIFO or device where a writer's lock goes: keep the checkpoint to be safe
            return f"{io.name_of(lock_url)}, which is not a regular file"
        if found is None:
            continue
        info, mtime = found
        if stale_reason(info, mtime, stale_after=STALE_AFTER) is None:
            return info.describe() if info else io.name_of(lock_url)
    return ""


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


def _own_parts(ref: CheckpointRef) -> list[io.DirEntry] | None:
    """What deleting `ref` removes when its folder holds checkpoints of its own (`ref.holds`), which stay:
    its files and its layout's member folders. None when the checkpoint is its whole folder."""
    if not ref.holds:
        return None
    entries = io.list_dir(ref.url)
    members = get_layout(ref.layout).members(ref.url, entries)
    return [e for e in entries if not e.is_dir or e.name in members]


def _own_tree(ref: CheckpointRef) -> tuple[int, float | None]:
    """Bytes (on object stores: the ref's) and newest mtime of what deleting `ref` removes; links are not
    followed."""
    parts = _own_parts(ref)
    if not io.is_local(ref.url):
        if parts is None:
            return ref.size_bytes, _remote_newest(ref.url)
        times = [_remote_newest(io.join(ref.url, e.name)) if e.is_dir else e.mtime for e in parts]
        return ref.size_bytes, max((t for t in times if t), default=None)
    if parts is None:
        return _local_tree(io.local_path(ref.url))
    size, newest = 0, None
    for entry in parts:
        path = os.path.join(io.local_path(ref.url), entry.name)
        if entry.is_dir:
            part_size, part_newest = _local_tree(path)
        else:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            part_size, part_newest = (st.st_size if stat.S_ISREG(st.st_mode) else 0), st.st_mtime
        size += part_size
        if part_newest is not None:
            newest = part_newest if newest is None else max(newest, part_newest)
    return size, newest


def _local_tree(path: str) -> tuple[int, float | None]:
    """Bytes of the files below `path` and the newest mtime of anything there; links are not followed. A
    checkpoint that is one file (a Lightning `.ckpt`) is its own size and mtime."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            return st.st_size, st.st_mtime
    size, newest = 0, None
    for root, _dirs, files in os.walk(path):
        for name in (root, *(os.path.join(root, n) for n in files)):
            try:
                st = os.lstat(name)
            except FileNotFoundError:
                continue
            newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
    return size, newest


def _remote_newest(url: str) -> float | None:
    newest = None
    with contextlib.suppress(CkptctlError):
        for entry in io.list_dir(url):
            mtime = _remote_newest(io.join(url, entry.name)) if entry.is_dir else entry.mtime
            if mtime:
                newest = mtime if newest is None else max(newest, mtime)
    return newest


def _tree_size(url: str) -> int:
    if io.is_local(url):
        return _local_tree(io.local_path(url))[0] if os.path.isdir(io.local_path(url)) else 0
    with contextlib.suppress(CkptctlError):
        return sum(e.size if not e.is_dir else _tree_size(io.join(url, e.name)) for e in io.list_dir(url))
    return 0


def _trash_folders(run: str, items: Iterable[PruneItem]) -> list[str]:
    """The trash folders of the run and of each folder holding checkpoints, that exist.

    Raises:
        UnsafePath: one is a symbolic link (or not a folder): the plan stops before anything is deleted.
    """
    folders = {run, *(io.parent_of(i.url) for i in items if i.ref.url != run)}
    found = []
    for folder in sorted(folders):
        bin_ = io.join(folder, trash.TRASH_NAME)
        if io.is_local(bin_):
            if os.path.lexists(io.local_path(bin_)):
                trash.check_trash(io.local_path(bin_))
                found.append(bin_)
        elif io.is_dir(bin_):
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
    with RunLock(run, wait=wait, command=f"ckptctl prune ({policy.describe()})", warn=warn) as lock:
        plan = plan_prune(
            run, policy, grace=grace, max_depth=max_depth, require_metrics=require_metrics, slim_instead=slim_instead
        )
        if (plan.delete or plan.slim) and confirm is not None and not confirm(plan):
            declined = tuple(Skipped(i, "not confirmed") for i in plan.delete + plan.slim)
            return PruneReport(plan, dry_run=False, deleted=(), skipped=declined, cancelled=True)
        lock.refresh()
        trash_freed = _empty_trash(_trash_folders(run, plan.items))
        deleted, skipped = apply_planned(
            plan.delete, delete_planned, lock, plan.grace, "deleting", progress=progress, weight=lambda i: i.size_bytes
        )
        slimmed, not_slimmed = apply_planned(plan.slim, _slim, lock, plan.grace, "slimming")
        return PruneReport(
            plan, False, tuple(deleted), tuple(skipped + not_slimmed), trash_freed, slimmed=tuple(slimmed)
        )


def _slim(item: PruneItem) -> PruneItem:
    return replace(item, slim_bytes=slim_checkpoint(item.ref))


def apply_planned(
    items: Sequence[Item],
    act: Callable[[Item], Item],
    lock: RunLock,
    grace: timedelta,
    doing: str,
    *,
    fatal: tuple[type[BaseException], ...] = (),
    progress: Progress | None = None,
    weight: Callable[[Item], int] = lambda _: 1,
) -> tuple[list[Item], list[Skipped[Item]]]:
    """Run a planned change (`act`) on each item whose checkpoint did not change since the plan
    (`changed_since_plan`), refreshing the run's lock before each.

    Args:
        items, act: the plan's items, and the change (it returns the item as done, with what it measured).
        lock, grace: the run's lock held, and the plan's grace (see `changed_since_plan`).
        doing: the change, for progress and failures (`deleting`).
        fatal: errors of `act` that stop everything; other OSErrors and CkptctlErrors leave the item undone.
        progress: where `{doing} N checkpoint(s)` goes, advanced by each done item's `weight`.

    Returns:
        What `act` returned for the items done, and the items left undone with why.
    """
    done: list[Item] = []
    left: list[Skipped[Item]] = []
    sink = progress or NoProgress()
    sink.start(f"{doing} {len(items)} checkpoint(s)", sum(weight(i) for i in items) or None)
    try:
        for item in items:
            lock.refresh()
            why = changed_since_plan(item.ref, grace)
            if why:
                left.append(Skipped(item, why))
                continue
            try:
                done.append(act(item))
            except fatal:
                raise
            except (OSError, CkptctlError) as exc:
                left.append(Skipped(item, f"{doing} failed: {exc}", error=True))
                continue
            sink.advance(weight(item))
    finally:
        sink.finish()
    return done, left


def changed_since_plan(planned: CheckpointRef, grace: timedelta) -> str:
    """Why a planned change of a checkpoint (`prune`'s deletion, `slim`'s swap) must not happen now: the run
    changed since the plan (a pointer names it now, it is being written or was rewritten); or ""."""
    url = planned.url
    if io.is_local(url):
        path = io.local_path(url)
        if not os.path.lexists(path):
            return "it is gone already"
        if os.path.islink(path):
            return "it is a symbolic link now"
    parent = io.parent_of(url)
    try:
        entries = io.list_dir(parent)
        _, ref = detect(url)
        ref = _judged(ref, grace)
    except CkptctlError as exc:
        return f"it cannot be read now ({exc.message})"
    name = io.name_of(url)
    if any(layout.latest_pointer(parent, entries) == name for layout in all_layouts()):
        return "a latest pointer names it now"
    if ref.state is CheckpointState.COMPLETE and planned.state is not CheckpointState.COMPLETE:
        return "it has been completed since the plan"
    if ref.state is not planned.state:
        return f"it is {ref.state.value} now"
    busy = _busy(ref, datetime.now(UTC), grace, _own_tree(planned)[1])
    if busy:
        return busy
    if ref.created != planned.created:
        return "it has been rewritten since the plan"
    return ""


def delete_planned(item: PruneItem) -> PruneItem:
    """Delete one planned checkpoint folder (`prune`, `sync --keep-local`) so that no moment shows it
    half-deleted and complete (`io.trash`); of a folder that holds checkpoints of its own, only what is the
    checkpoint's (`_own_parts`)."""
    ref = item.ref
    parts = _own_parts(ref)
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
