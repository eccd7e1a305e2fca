"""`repair`: make the framework's own resume logic land on the newest checkpoint of a run whose every role
verifies (DESIGN §4 `repair`).

The target is what `resume-plan` picks (newest first, skipping what is in progress, broken or failing
structural verify), stepping further back while another role the framework loads with it (OpenRLHF's
critic tag of the same step, verl's role folders, AReaL's critic slot) does not verify. The change is the
smallest one the framework's loader honours, as its pointer writer (`contract.capabilities.PointerWriter`)
says: its pointer files rewritten to name the target, or, where it picks by name, what it would pick over
the target moved into the run's quarantine (`RUN/.ckptctl-trash/quarantine/`, `io.trash.quarantine`). Before
the first change, what each pointer held (byte for byte, or that there was none) is recorded in the quarantine
too (`io.trash.record_pointers`). `repair --undo` moves the quarantined entries back and puts each pointer back
as it was, so that the run is byte-identical to what it was before the repair and the framework resumes where it
did; then it removes its records (and the quarantine, when empty). Nothing is ever deleted.

Planning changes nothing. Applying takes the run's lock (the one `prune` takes), plans again under it, and
refuses while a save is being written; each pointer is written atomically (temporary file, fsync, rename,
fsync of the folder), never through a link, and each quarantine is one rename after its record is on disk,
so a process killed at any moment leaves every pointer and every checkpoint as it was or as planned; a
second `repair` finishes what a killed one began.

Nothing here names a framework: the target comes from `ops.resume_plan`, the change from the layout's
pointer writer.
"""

from __future__ import annotations

import base64
import errno
import functools
import json
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState
from ckptctl.contract.capabilities import POINTER_WRITER, Pointer, PointerWriter
from ckptctl.contract.resume import Skipped
from ckptctl.core.lock import RunLock
from ckptctl.errors import CheckpointNotFound, CkptctlError, UnknownLayout, UnsafePath
from ckptctl.io import trash
from ckptctl.layouts import capability
from ckptctl.ops.planned import run_planned
from ckptctl.ops.report import SCHEMA_VERSION
from ckptctl.ops.resume_plan import plan_resume
from ckptctl.ops.verification import verify_checkpoint
from ckptctl.quoting import shell

__all__ = ["LINK", "POINTER", "QUARANTINE", "RESTORE", "RepairAction", "RepairPlan", "RunBusy", "plan_repair", "repair"]

#: The kinds of `RepairAction` (`link`: a pointer that is a symbolic link; JSON calls it a pointer too).
POINTER = "pointer"
LINK = "link"
QUARANTINE = "quarantine"
RESTORE = "restore"

#: A pointer file is a tag name or a number; anything longer is not one (nor kept in a repair's record: refused).
_MAX_POINTER_BYTES = 4096


class RunBusy(CkptctlError):
    """A save of the run is being written: repairing now could point a resume away from it or move it
    (exit code 1: the command could not do its work now, as a held lock)."""

    exit_code = 1


@dataclass(frozen=True, slots=True)
class RepairAction:
    """One change of a repair.

    Attributes:
        kind: `pointer` (a pointer file rewritten), `link` (a pointer that is a symbolic link, pointed
            anew), `quarantine` (an entry moved into the run's
            quarantine) or `restore` (`--undo`: a quarantined entry moved back).
        path: the pointer file, or the entry moved.
        before: the pointer's content (None: no pointer yet), or where the entry is.
        after: what the pointer will hold (None, in an undo: the pointer is removed, as there was none before
            the repair), or where the entry goes.
        data: the exact bytes `after` stands for where they may not be text (an undo puts a pointer back byte
            for byte); None: `after` encoded.
    """

    kind: str
    path: str
    before: str | None
    after: str | None
    data: bytes | None = None

    def to_json(self) -> dict[str, Any]:
        kind = POINTER if self.kind == LINK else self.kind
        return {"kind": kind, "path": self.path, "before": self.before, "after": self.after, "link": self.kind == LINK}


@dataclass(frozen=True, slots=True)
class RepairPlan:
    """What `repair` changes (or changed) so that the framework's resume lands on `target`.

    Attributes:
        run: the run folder.
        target: the checkpoint the resume lands on afterwards; None when nothing of the run can be resumed
            (or, for `--undo`, nothing is quarantined).
        framework: who reads it back.
        actions: the changes, in the order they are made.
        skipped: the newer checkpoints a resume must not load, with the reason.
        notes: what a person should know (why nothing can be changed, what to do instead).
        refusal: why no change of the framework's files makes its resume land on `target` (the resume as it
            stands loads something else), with what to do instead; None when the actions do.
        dry_run: nothing was changed.
        undo: the plan moves quarantined entries back and puts rewritten pointers back.
        left: (undo) what stays as it is, and why (an entry whose place is taken, a pointer written anew since
            the repair): the undo is not whole.
        records: (undo) the pointer records (`io.trash.pointer_records` names) the undo puts back and then
            removes.
    """

    run: str
    target: CheckpointRef | None
    framework: str | None
    actions: tuple[RepairAction, ...]
    skipped: tuple[Skipped, ...] = ()
    notes: tuple[str, ...] = ()
    dry_run: bool = True
    undo: bool = False
    refusal: str | None = None
    left: tuple[str, ...] = ()
    records: tuple[str, ...] = ()

    @property
    def needed(self) -> bool:
        """Whether the run needs changes before a resume lands on a good checkpoint (or, for `--undo`,
        anything is quarantined): also when no change can get it there (no target)."""
        return bool(self.actions) or self.refusal is not None or (self.target is None and not self.undo)

    def to_json(self) -> dict[str, Any]:
        target = self.target
        return {
            "schema_version": SCHEMA_VERSION,
            "run": self.run,
            "dry_run": self.dry_run,
            "undo": self.undo,
            "needed": self.needed,
            "target": None if target is None else {"url": target.url, "step": target.step, "layout": target.layout},
            "framework": self.framework,
            "actions": [a.to_json() for a in self.actions],
            "skipped": [s.to_json() for s in self.skipped],
            "notes": list(self.notes),
            "left": list(self.left),
            "refusal": self.refusal,
        }


# --------------------------------------------------------------------------------------------------
# Planning.
# --------------------------------------------------------------------------------------------------


def plan_repair(run: str) -> RepairPlan:
    """What `repair` would change in the run at `run` (see the module docstring); changes nothing.

    Raises:
        CheckpointNotFound: `run` is not a folder.
        UnknownLayout: the run holds only checkpoints of a layout ckptctl does not know, or the layout of its
            target keeps a resume ckptctl cannot redirect while newer checkpoints would be loaded instead.
        UnsafePath: a link is where a pointer file is (nothing is followed or changed).
    """
    rejected: dict[str, str] = {}
    while True:
        resume = plan_resume(run, rejected=rejected, cuda=False)
        chosen = resume.checkpoint
        if chosen is None:
            if resume.unknown_layout:
                names = ", ".join(io.name_of(s.url) for s in resume.unknown_layout[:4])
                raise UnknownLayout(
                    f"{run} holds checkpoints of a layout ckptctl does not know ({names}): nothing can be repaired",
                    f"see `{shell('ckptctl', 'list', run)}`",
                )
            return RepairPlan(run, None, None, (), resume.skipped, (_nothing_resumable(run, resume.skipped),))
        writer = capability(chosen.layout, POINTER_WRITER)
        if writer is None:
            if not resume.skipped:  # the newest checkpoint is good: whatever the loader picks, nothing to do
                return RepairPlan(run, chosen, resume.framework, ())
            raise UnknownLayout(
                f"repair does not know how {resume.framework} ({chosen.layout}) chooses what it resumes from, "
                f"so it cannot make it skip {io.name_of(resume.skipped[0].url)}",
                f"resume from {chosen.url} explicitly: {resume.resume_hint}",
            )
        torn = _torn_role(writer, chosen.url)
        if torn is None:
            break
        rejected[chosen.url] = torn
    refusal = writer.refusal(chosen.url)
    actions = [] if refusal else _actions(run, writer, chosen.url)
    notes = [refusal] if refusal else []
    busy = [s for s in resume.skipped if s.state is CheckpointState.IN_PROGRESS]
    notes += [f"{s.url} is being written ({s.reason}): repair refuses to change the run until it is done" for s in busy]
    return RepairPlan(run, chosen, resume.framework, tuple(actions), resume.skipped, tuple(notes), refusal=refusal)


def _nothing_resumable(run: str, skipped: Sequence[Skipped]) -> str:
    if not skipped:
        return f"{run} holds no checkpoint to resume from"
    return (
        f"no checkpoint of {run} verifies in every role: nothing to point a resume at; start the run afresh, or "
        "restore a good copy of a checkpoint from elsewhere (see `ckptctl resume-plan` for why each was skipped)"
    )


def _torn_role(writer: PointerWriter, url: str) -> str | None:
    """Why a resume from `url` fails because another checkpoint the framework loads with it does not
    verify, or None when every role does."""
    for role in writer.roles(url)[1:]:
        try:
            result = verify_checkpoint(role)
        except CheckpointNotFound:
            return f"its role {io.name_of(io.parent_of(role))}/{io.name_of(role)} does not exist"
        except CkptctlError as exc:
            return f"its role {role} cannot be read: {exc.message}"
        errors = [p for p in result.problems if p.severity == "error" and not p.path.startswith("../")]
        if errors:
            return f"its role {role} fails verify: {errors[0].path}: {errors[0].message}"
    return None


def _actions(run: str, writer: PointerWriter, target: str) -> list[RepairAction]:
    """Quarantines first (a name-picking loader then finds the target), then pointers (each already holding
    what it should is left alone)."""
    picked = writer.picked_over(target)
    if picked and not io.is_local(run):  # a quarantine is one rename, which an object store does not have
        raise CkptctlError(
            f"repair would move {io.name_of(picked[0])} into quarantine, which it does only in local runs "
            "(an object store has no rename)",
            f"resume from {target} explicitly, or move the newer checkpoints away with your storage's tools",
        )
    found = [
        RepairAction(QUARANTINE, path, path, io.join(run, trash.TRASH_NAME, trash.QUARANTINE_NAME, io.name_of(path)))
        for path in picked
    ]
    for pointer in writer.pointers(target):
        before = read_link(pointer.path) if pointer.link else read_pointer(pointer.path)
        if before is None or before.strip() != pointer.content.strip():
            found.append(RepairAction(LINK if pointer.link else POINTER, pointer.path, before, pointer.content))
    return found


def read_link(path: str) -> str | None:
    """The target of a pointer that is a symbolic link (None when there is none).

    Raises:
        UnsafePath: something else than a link is where it should be.
    """
    local = io.local_path(path)
    if not os.path.lexists(local):
        return None
    if not os.path.islink(local):
        raise UnsafePath(f"{path} is not a symbolic link where the framework keeps one: refusing to replace it")
    return os.readlink(local)


def read_pointer(path: str) -> str | None:
    """The content of a pointer file (None when there is none), read without following a link.

    Raises:
        UnsafePath: a link (or a folder) is where the pointer is.
    """
    data = pointer_bytes(path, _MAX_POINTER_BYTES)
    return None if data is None else data.decode("utf-8", "replace")


def pointer_bytes(path: str, cap: int) -> bytes | None:
    """Up to `cap` bytes of a pointer file (None when there is none), read without following a link.

    Raises:
        UnsafePath: a link (or a folder) is where the pointer is.
    """
    if not io.is_local(path):  # an object store has no links: a plain read is one that follows none
        try:
            return io.read_bytes(path, max_size=cap)
        except CheckpointNotFound:
            return None
    local = io.local_path(path)
    try:
        fd = os.open(local, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise CkptctlError(f"cannot read {path}: {exc.strerror}") from exc
        raise _link_refused(path) from exc
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise UnsafePath(f"{path} is not a file: refusing to rewrite it; nothing was changed")
        return f.read(cap)


def _held(path: str, link: bool) -> bytes | None:
    """Exactly what the pointer at `path` holds now (a link: its target), None when there is none.

    Raises:
        UnsafePath: a link where a file should be, or the other way round.
        CkptctlError: it is longer than a repair keeps a copy of.
    """
    if link:
        target = read_link(path)
        return None if target is None else os.fsencode(target)
    data = pointer_bytes(path, _MAX_POINTER_BYTES + 1)
    if data is not None and len(data) > _MAX_POINTER_BYTES:
        raise CkptctlError(
            f"{path} holds over {_MAX_POINTER_BYTES} bytes: not a pointer file whose content repair can keep "
            "to put back; nothing was changed",
            "move it away (keep it if you need it), then run repair again",
        )
    return data


def _link_refused(path: str) -> UnsafePath:
    return UnsafePath(
        f"{path} is a symbolic link where a pointer file should be: refusing to rewrite it; nothing was changed",
        "replace it with a file holding the name it should (or remove it) after checking who put it there",
    )


# --------------------------------------------------------------------------------------------------
# Applying.
# --------------------------------------------------------------------------------------------------


def _no_hook(action: RepairAction) -> None:
    return None


#: Called after each change is made (tests stop the process there).
after_action: Callable[[RepairAction], None] = _no_hook


def repair(
    run: str, *, confirm: Callable[[RepairPlan], bool] | None = None, wait: float = 30.0, undo: bool = False
) -> RepairPlan:
    """Plan under the run's lock and make the changes (`undo`: move the quarantined entries back).

    Args:
        run: the run folder.
        confirm: called with the plan when it changes something; False cancels (the plan is returned as a
            dry run). None changes unasked.
        wait: seconds to wait for a prune or another repair of the run to finish.
        undo: see `plan_undo`.

    Raises:
        RunBusy: a save of the run is being written (nothing was changed).
        RunLocked: another prune or repair holds the run's lock.
        UnsafePath: a link is where a pointer, the trash or the quarantine should be (nothing was changed).
        CkptctlError: a folder to change is not writable (nothing was changed), or a change failed.
    """
    if not io.is_dir(run):
        raise CheckpointNotFound(f"no such run folder: {run}")
    _check_writable(run)

    def checked_plan() -> RepairPlan:
        plan = plan_undo(run) if undo else plan_repair(run)
        busy = [s for s in plan.skipped if s.state is CheckpointState.IN_PROGRESS]
        if busy and plan.actions:
            raise RunBusy(
                f"{busy[0].url} is being written ({busy[0].reason}): refusing to repair the run now; nothing was changed",
                "run repair again once the save has finished or stopped",
            )
        return plan

    return run_planned(
        run,
        checked_plan,
        functools.partial(_execute, run, undo=undo),
        lambda plan: plan,  # declined: the plan, as a dry run
        changes=lambda plan: bool(plan.actions),
        confirm=confirm,
        command="ckptctl repair" + (" --undo" if undo else ""),
        wait=wait,
    )


def _execute(run: str, plan: RepairPlan, lock: RunLock, *, undo: bool) -> RepairPlan:
    """Make the plan's changes, holding the run's lock (`repair`)."""
    if not plan.actions:
        if plan.records:  # pointers a killed repair never changed: nothing to put back
            _forget(run, plan.records)
            return replace(plan, dry_run=False)
        return plan
    for action in plan.actions:
        _check_writable(io.parent_of(action.path) if action.kind != RESTORE else io.parent_of(action.after or ""))
    record = f"repair-{datetime.now(UTC):%Y%m%dT%H%M%S%fZ}-{secrets.token_hex(4)}"  # sorts by time
    if not undo and any(a.kind in (POINTER, LINK) for a in plan.actions):
        trash.record_pointers(run, record, _pointer_record(run, plan))
    done = []
    for action in plan.actions:
        lock.check()
        done.append(_apply(run, action, plan, record))
        after_action(done[-1])
    if undo:
        _forget(run, plan.records)
    return replace(plan, actions=tuple(done), dry_run=False)


def _check_writable(folder: str) -> None:
    if not io.writable(folder):
        raise CkptctlError(f"{folder} is not writable: repair cannot change it; nothing was changed")


def _pointer_record(run: str, plan: RepairPlan) -> bytes:
    """The record of what each pointer the plan rewrites holds now, byte for byte (`existed` false: there is
    none), and what the repair writes, for `repair --undo` to put back."""
    pointers = []
    for action in plan.actions:
        if action.kind not in (POINTER, LINK):
            continue
        held = _held(action.path, action.kind == LINK)
        pointers.append(
            {
                "path": io.relative_to(action.path, run),
                "link": action.kind == LINK,
                "existed": held is not None,
                "before": None if held is None else held.decode("utf-8", "replace"),  # for a person reading it
                "before_base64": None if held is None else base64.b64encode(held).decode(),
                "after": action.after,
            }
        )
    return json.dumps(
        {
            "schema_version": SCHEMA_VERSION,
            "by": "ckptctl repair",
            "repaired": datetime.now(UTC).isoformat(timespec="seconds"),
            "resume_target": None if plan.target is None else plan.target.url,
            "pointers": pointers,
        },
        indent=1,
    ).encode()


def _apply(run: str, action: RepairAction, plan: RepairPlan, repair_id: str) -> RepairAction:
    if action.kind in (POINTER, LINK):
        if action.after is None:  # an undo: there was no pointer before the repair
            _remove_pointer(action.path, link=action.kind == LINK)
        elif action.data is not None:
            _put_back(action.path, action.data, link=action.kind == LINK)
        else:
            write_pointer(Pointer(action.path, action.after, link=action.kind == LINK))
        return action
    if action.kind == QUARANTINE:
        record = {
            "schema_version": SCHEMA_VERSION,
            "origin": io.relative_to(action.path, run),
            "quarantined": datetime.now(UTC).isoformat(timespec="seconds"),
            "by": "ckptctl repair",
            "repair": repair_id,  # its pointers, if it rewrote any, are in `<repair>.pointers.json`
            "resume_target": None if plan.target is None else plan.target.url,
        }
        where = trash.quarantine(io.local_path(action.path), run, json.dumps(record, indent=1).encode())
        return replace(action, after=where)
    assert action.after is not None
    try:
        trash.unquarantine(run, io.name_of(action.path), io.local_path(action.after))
    except FileExistsError as exc:
        raise CkptctlError(
            f"{action.after} exists again: cannot move {action.path} back; it stays quarantined",
            "move what is there now away first, then run `repair --undo` again",
        ) from exc
    return action


def write_pointer(pointer: Pointer) -> None:
    """Write a pointer file atomically (temporary file, fsync, rename, fsync of the folder), refusing a link
    (or anything but a file) in its place."""
    if not pointer.link:
        read_pointer(pointer.path)  # refuses a link or a folder before anything is written
        io.write_bytes_atomic(pointer.path, pointer.content.encode())
        return
    read_link(pointer.path)  # refuses a file or a folder where the link is
    _symlink_atomic(pointer.path, pointer.content)


def _symlink_atomic(path: str, target: str) -> None:
    local = io.local_path(path)
    folder = os.path.dirname(os.path.abspath(local))
    temporary = os.path.join(folder, f".{os.path.basename(local)}.tmp-{os.getpid()}")
    os.symlink(target, temporary)
    os.replace(temporary, local)
    io.fsync_dir(folder)


def _put_back(path: str, data: bytes, *, link: bool) -> None:
    """Write a pointer's old bytes back as `write_pointer` writes (atomically, refusing a link where a file
    was, or the other way round)."""
    if link:
        read_link(path)
        _symlink_atomic(path, os.fsdecode(data))
        return
    read_pointer(path)
    io.write_bytes_atomic(path, data)


def _remove_pointer(path: str, *, link: bool) -> None:
    """Remove a pointer the repair created (none was there before), never what a link names."""
    if link:
        if read_link(path) is not None:
            os.unlink(io.local_path(path))
            io.fsync_dir(os.path.dirname(os.path.abspath(io.local_path(path))))
        return
    if read_pointer(path) is None:  # refuses a link or a folder
        return
    io.delete_file(path)
    io.fsync_dir(io.parent_of(path))


# --------------------------------------------------------------------------------------------------
# Undo.
# --------------------------------------------------------------------------------------------------


def plan_undo(run: str) -> RepairPlan:
    """Moving each entry of the run's quarantine back where its record says it came from, then putting each
    pointer a repair rewrote back as it was (the newest repair's first, so that the oldest one's `before`
    is what is left), where it still holds what the repair wrote.

    Raises:
        CheckpointNotFound: `run` is not a folder.
        UnsafePath: the trash or the quarantine is a link, or a link is where a pointer file was (or the other
            way round).
    """
    if not io.is_dir(run):
        raise CheckpointNotFound(f"no such run folder: {run}")
    box = io.join(run, trash.TRASH_NAME, trash.QUARANTINE_NAME)
    actions, notes, left = [], [], []
    unrecorded = []
    for name, data in trash.quarantined(run):
        record = _parsed(data)
        origin = _inside(record.get("origin"))
        if origin is None:
            left.append(f"{io.join(box, name)}: its record does not say where it came from; left in quarantine")
            continue
        destination = io.join(run, origin)
        if io.lexists(destination):
            left.append(f"{io.join(box, name)}: {destination} exists again; left in quarantine")
            continue
        actions.append(RepairAction(RESTORE, io.join(box, name), io.join(box, name), destination))
        if "repair" not in record:
            unrecorded.append(name)
    if unrecorded:
        notes.append(
            f"{', '.join(unrecorded)}: quarantined by an older ckptctl, which kept no record of the pointers a "
            "repair rewrote: moved back, and any pointer is left as it is now; "
            f"see `{shell('ckptctl', 'resume-plan', run)}` for where a resume lands"
        )
    pointers: list[RepairAction] = []
    records: list[str] = []
    now: dict[str, bytes | None] = {}
    for name, data in reversed(trash.pointer_records(run)):
        recorded = _recorded_pointers(_parsed(data))
        if recorded is None:
            left.append(f"{io.join(box, name + trash.POINTERS_SUFFIX)}: not a record ckptctl can read; left as it is")
            continue
        records.append(name)
        for rel, link, before, after in reversed(recorded):
            path = io.join(run, rel)
            held = now[path] if path in now else _held(path, link)
            if held == before:  # a killed repair never got to it, or a newer record's undo put it back
                continue
            if held != after:
                was = "none" if before is None else repr(_text(before))
                left.append(
                    f"{path} holds {_text(held)!r} now, not {_text(after)!r} as the repair left it: written anew "
                    f"since, so left as it is (before the repair: {was})"
                )
                now[path] = held
                continue
            kind = LINK if link else POINTER
            pointers.append(RepairAction(kind, path, _text(held), None if before is None else _text(before), before))
            now[path] = before
    return RepairPlan(
        run, None, None, (*actions, *pointers), notes=tuple(notes), undo=True, left=tuple(left), records=tuple(records)
    )


def _forget(run: str, records: Sequence[str]) -> None:
    """Remove the pointer records an undo has put back, then the quarantine and the trash where empty."""
    for name in records:
        trash.drop_pointer_record(run, name)
    trash.remove_empty_quarantine(run)


def _text(data: bytes | None) -> str:
    return "" if data is None else data.decode("utf-8", "replace")


def _parsed(record: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(record)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _recorded_pointers(record: dict[str, Any]) -> list[tuple[str, bool, bytes | None, bytes]] | None:
    """(path inside the run, link, bytes before the repair or None when there was none, bytes it wrote) of each
    pointer of a pointer record, or None when the record is not one ckptctl wrote whole."""
    found = []
    for item in record.get("pointers") or ():
        if not isinstance(item, dict):
            return None
        rel, link, existed = _inside(item.get("path")), item.get("link"), item.get("existed")
        before, after = item.get("before_base64"), item.get("after")
        if (
            rel is None
            or not isinstance(link, bool)
            or not isinstance(after, str)
            or existed is not (before is not None)
        ):
            return None
        try:
            old = None if before is None else base64.b64decode(before, validate=True)
        except (ValueError, TypeError):
            return None
        found.append((rel, link, old, os.fsencode(after) if link else after.encode()))
    return found if found else None


def _inside(origin: object) -> str | None:
    """A path inside the run a record names, or None when it names none (or one outside, or in the trash)."""
    if not isinstance(origin, str) or not origin or os.path.isabs(origin) or "://" in origin:
        return None
    parts = origin.split("/")
    return None if ".." in parts or "" in parts or "." in parts or parts[0] == trash.TRASH_NAME else origin
