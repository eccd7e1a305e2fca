"""A checkpoint's *load set*: the files its framework's own load reads, and checking that each is there and whole.

`verify`'s promise is that exit 0 means the framework's own load succeeds and loses nothing it saved (DESIGN
§4). A layout's structural rules say whether the files it found fit together; the load set says which files
must be there at all, which is what a torn save gets wrong: the Trainer resumes a `checkpoint-N` without
`optimizer.pt` with a fresh optimizer and no error, accelerate loads a folder without `scheduler.bin` with a
fresh schedule. Each framework plugin declares its load set (`Layout.load_set`) from the checkpoint's own
facts (world size, roles, what its writer was asked to save), citing the framework's code that reads each
member; `check_load_set` checks each member the same way for every framework:

- present, else a problem naming the file: an error when the framework then fails or loads with state
  silently lost, a warning when it goes on with only a warning of its own (`Need.WARNS`),
- whole, by what its kind allows without reading its bytes: a torch.save zip's directory and records lie
  inside the file (their CRC-32s are `verify`'s content pass), a safetensors header parses and covers the
  file, a JSON document parses (a truncated `tokenizer.json` fails `AutoTokenizer`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptctl import io
from ckptctl.checkpoint import Problem, ProblemKind
from ckptctl.errors import CkptctlError
from ckptctl.formats.documents import read_json
from ckptctl.formats.safetensors import read_header

if TYPE_CHECKING:
    from ckptctl.formats.torch_zip import ReadAt

__all__ = ["LoadMember", "MemberKind", "Need", "check_load_set", "members_of"]


class MemberKind(enum.StrEnum):
    """How much of a member can be checked without reading its bytes."""

    #: A torch.save zip archive (`.pt`, `.pth`, `.bin`, accelerate's `.pkl`): directory and records inside it.
    TORCH_SAVE = "torch_save"
    #: A safetensors file: its header parses and its tensors cover the file.
    SAFETENSORS = "safetensors"
    #: A JSON document: it parses.
    JSON = "json"
    #: Any other file (a text pointer, a pickle of another writer): present.
    FILE = "file"


class Need(enum.StrEnum):
    """What the framework's own load does without the member (decided from its code, cited where declared)."""

    #: It fails, or goes on with state silently lost (a fresh optimizer, a restarted schedule): an error.
    REQUIRED = "required"
    #: It goes on and says so (the Trainer's missing `rng_state_R.pth`): a warning.
    WARNS = "warns"


@dataclass(frozen=True, slots=True)
class LoadMember:
    """One file a framework's own load reads of a checkpoint.

    Attributes:
        path: relative to the checkpoint, with `/`.
        kind: how it is checked.
        what: what it holds, for a person ("the optimizer state").
        read_by: the framework's code that reads it, for a person ("transformers Trainer._load_optimizer_and_scheduler").
        need: what happens without it.
        missing: what its absence means, said instead of the default ("... reads it, and fails or resumes with
            this state lost") where that does not fit: a file the writer always writes before its completion
            marker, whose absence shows the folder is not what it wrote (the Trainer's `training_args.bin`).
    """

    path: str
    kind: MemberKind
    what: str
    read_by: str
    need: Need = Need.REQUIRED
    missing: str = ""


def check_load_set(
    url: str, members: Iterable[LoadMember], files: Mapping[str, int], reported: Iterable[Problem] = ()
) -> list[Problem]:
    """The problems of a checkpoint's load set: each member missing, or not whole as far as its kind shows.

    Args:
        url: the checkpoint.
        members: its load set (`Layout.load_set`).
        files: its files, relative path -> size (`Checkpoint.files`).
        reported: problems already found (the layout's own rules): a file they name as an error is not
            reported again.
    """
    already = {p.path for p in reported if p.severity == "error"}
    problems: list[Problem] = []
    seen: set[str] = set()
    for member in members:
        if member.path in seen or member.path in already:
            continue
        seen.add(member.path)
        if member.path not in files:
            problems.append(_missing(member))
            continue
        problem = _damage(io.join(url, member.path), member, files[member.path])
        if problem is not None:
            problems.append(problem)
    return problems


def _missing(member: LoadMember) -> Problem:
    severity = "warning" if member.need is Need.WARNS else "error"
    if member.missing:
        return Problem(ProblemKind.MISSING_FILE, member.path, f"{member.what} is missing: {member.missing}", severity)
    if member.need is Need.WARNS:
        consequence = f"{member.read_by} goes on without it with a warning"
        return Problem(ProblemKind.MISSING_FILE, member.path, f"{member.what} is missing: {consequence}", "warning")
    consequence = f"{member.read_by} reads it, and fails or resumes with this state lost"
    return Problem(ProblemKind.MISSING_FILE, member.path, f"{member.what} is missing: {consequence}")


def _damage(url: str, member: LoadMember, size: int) -> Problem | None:
    """Why the member at `url` is not whole, or None."""
    try:
        if member.kind is MemberKind.JSON:
            read_json(url)
        elif member.kind is MemberKind.SAFETENSORS:
            read_header(url, size)
        elif member.kind is MemberKind.TORCH_SAVE:
            # The zip reader is imported for a torch.save member only: a safetensors checkpoint has none.
            from ckptctl.formats.torch_zip import archive_members, is_zip

            if size == 0:
                return Problem(ProblemKind.TRUNCATED, member.path, f"{member.what} is empty")
            if is_zip(io.read_bytes(url, 0, min(size, 4))):
                archive_members(_reader(url), size, 0, member.path)
            # else a legacy (non-zip) torch.save: nothing to check without unpickling it; the reader's
            # own rules and the content pass judge it.
        elif size == 0:
            return Problem(ProblemKind.TRUNCATED, member.path, f"{member.what} is empty")
    except CkptctlError as exc:
        return Problem.from_error(exc, member.path)
    return None


def _reader(url: str) -> ReadAt:
    def read_at(start: int, n: int) -> bytes:
        return io.read_bytes(url, start, n)

    return read_at


def members_of(
    paths: Sequence[str], kind: MemberKind, what: str, read_by: str, need: Need = Need.REQUIRED
) -> list[LoadMember]:
    """One member per path, all of the same kind and reader (the per-rank files of one save)."""
    return [LoadMember(path, kind, what, read_by, need) for path in paths]
