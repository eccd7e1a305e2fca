"""Scan → plan → confirm → execute, the skeleton that `prune`, `slim` and `repair` share.

`run_planned` is the whole of it: take the run's lock (`core.lock.RunLock`), plan under it, ask `confirm`
when the plan changes something, and execute while still holding the lock. `apply_planned` is the execute
step of `prune` and `slim`: a planned change is made to each checkpoint of the plan in turn, refreshing the
lock, only where the checkpoint did not change since the plan (`changed_since_plan`), and each one left undone
says why (`Skipped`). (`repair` executes its own actions, each after checking the lock is still its own.)

Planning and checking again at the last moment ask the same questions of a checkpoint, so they live here too:
whether it is being written right now (`busy`: in progress as its layout judges it under the plan's grace
(`judged`), a staging name, a live writer's lock, a file modified within the grace), and what deleting it
removes (`own_parts`, `own_tree`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, Protocol, TypeVar

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState
from ckptctl.core.lock import LOCK_NAME, STALE_AFTER, LockUnusable, RunLock, read_lock, stale_reason
from ckptctl.errors import CkptctlError
from ckptctl.layouts import all_layouts, detect, get_layout
from ckptctl.ops.report import NoProgress, Progress
from ckptctl.units import format_age

__all__ = [
    "DEFAULT_GRACE",
    "Planned",
    "Skipped",
    "apply_planned",
    "busy",
    "changed_since_plan",
    "judged",
    "own_parts",
    "own_tree",
    "run_planned",
]

#: Checkpoints with a file modified more recently than this are taken to be still written.
DEFAULT_GRACE = timedelta(minutes=10)
_STAGING_NAME = re.compile(
    r"(?:^|[._-])(?:tmp|temp|staging|partial|incomplete|in[_-]?progress|writing)(?:$|[._-])", re.IGNORECASE
)
_LOCK_FILE = re.compile(r"^(?:\.?lock|LOCK|.+\.lock)$")


class Planned(Protocol):
    """An item of a plan that names its checkpoint (`PruneItem`, `SlimItem`)."""

    @property
    def ref(self) -> CheckpointRef: ...


Item = TypeVar("Item", bound=Planned)
Plan = TypeVar("Plan")
Result = TypeVar("Result")


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


def run_planned(
    run: str,
    plan: Callable[[], Plan],
    execute: Callable[[Plan, RunLock], Result],
    declined: Callable[[Plan], Result],
    *,
    changes: Callable[[Plan], bool],
    confirm: Callable[[Plan], bool] | None,
    command: str,
    wait: float,
    warn: Callable[[str], None] | None = None,
) -> Result:
    """Take the run's lock, plan under it, confirm, and execute under it (the module docstring).

    Args:
        run: the run folder the lock is taken in.
        plan: makes the plan (under the lock: what it saw cannot change before `execute`); it may raise to
            refuse (a save being written).
        execute: makes the plan's changes, with the lock held (and just refreshed).
        declined: the result when `confirm` says no; nothing was changed.
        changes: whether the plan changes anything (only then is `confirm` asked).
        confirm: asked with the plan; False declines. None executes unasked.
        command, wait, warn: the lock's (`RunLock`).

    Raises:
        RunLocked: another process holds the run's lock (or took it over from us).
    """
    with RunLock(run, wait=wait, command=command, warn=warn) as lock:
        planned = plan()
        if changes(planned) and confirm is not None and not confirm(planned):
            return declined(planned)
        lock.refresh()
        return execute(planned, lock)


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
    if io.is_local(url):  # gone, or a link now: what only a local folder can become under us
        path = io.local_path(url)
        if not os.path.lexists(path):
            return "it is gone already"
        if os.path.islink(path):
            return "it is a symbolic link now"
    parent = io.parent_of(url)
    try:
        entries = io.list_dir(parent)
        _, ref = detect(url)
        ref = judged(ref, grace)
    except CkptctlError as exc:
        return f"it cannot be read now ({exc.message})"
    name = io.name_of(url)
    if any(layout.latest_pointer(parent, entries) == name for layout in all_layouts()):
        return "a latest pointer names it now"
    if ref.state is CheckpointState.COMPLETE and planned.state is not CheckpointState.COMPLETE:
        return "it has been completed since the plan"
    if ref.state is not planned.state:
        return f"it is {ref.state.value} now"
    writing = busy(ref, datetime.now(UTC), grace, own_tree(planned)[1])
    if writing:
        return writing
    if ref.created != planned.created:
        return "it has been rewritten since the plan"
    return ""


def judged(ref: CheckpointRef, grace: timedelta) -> CheckpointRef:
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


def busy(ref: CheckpointRef, now: datetime, grace: timedelta, newest: float | None) -> str:
    """Why the checkpoint is being written right now, or "" (`ref` as `judged`)."""
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


def own_parts(ref: CheckpointRef) -> list[io.DirEntry] | None:
    """What deleting `ref` removes when its folder holds checkpoints of its own (`ref.holds`), which stay:
    its files and its layout's member folders. None when the checkpoint is its whole folder."""
    if not ref.holds:
        return None
    entries = io.list_dir(ref.url)
    members = get_layout(ref.layout).members(ref.url, entries)
    return [e for e in entries if not e.is_dir or e.name in members]


def own_tree(ref: CheckpointRef) -> tuple[int, float | None]:
    """Bytes (on object stores: the ref's) and newest mtime of what deleting `ref` removes; links are not
    followed."""
    parts = own_parts(ref)
    urls = [ref.url] if parts is None else [io.join(ref.url, e.name) for e in parts]
    size, newest = 0, None
    for url in urls:
        part_size, part_newest = io.tree_usage(url)
        size += part_size
        if part_newest:
            newest = part_newest if newest is None else max(newest, part_newest)
    # An object store's listing gave the ref its size already; a local one measures what links hide.
    return (size if io.is_local(ref.url) else ref.size_bytes), newest
