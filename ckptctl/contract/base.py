"""The Layout protocol: what every on-disk layout module implements (DESIGN §1–2).

A layout recognises its folders from a directory listing (cheap, no file reads beyond tiny markers),
opens one into a `Checkpoint` (headers and metadata only), and checks its completeness rules. The
shared contract test in `tests/layouts/test_contract.py` runs against every registered layout.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, Problem
from ckptctl.contract.load_set import LoadMember, check_load_set
from ckptctl.contract.step_names import step_from_name  # noqa: F401  (re-exported: the layouts use one rule set)
from ckptctl.errors import CkptctlError, UnknownLayout
from ckptctl.formats.torch_zip import TorchArchive
from ckptctl.io import DirEntry

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile


class Layout:
    """One on-disk checkpoint layout: everything ckptctl knows about the checkpoints one framework writes.

    A framework package (`ckptctl/frameworks/<name>/`) subclasses this and registers it in
    `ckptctl.layouts.registry._REGISTRY`. The three methods without a default are the reader; every other hook has a
    default that suits a layout without that feature, so a new framework overrides only what it has. What
    a framework does beyond reading (the model `convert` takes from its checkpoints, ...) is a capability
    of its own (`ckptctl.contract.capabilities`), not a hook. Commands (`ckptctl.ops`) ask these hooks and
    the capabilities and never name a framework.
    """

    #: Short stable name shown in `list`/`inspect` and accepted by `--layout`.
    name: str = ""
    #: Endings of the names of files that are whole checkpoints of this layout (Lightning's `.ckpt`), which
    #: the run walker hands to `identify_file`; empty for a layout whose checkpoints are folders.
    checkpoint_files: tuple[str, ...] = ()

    # ---------------------------------------------------------------------------------------- reading

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """The folder's ref if it is a checkpoint of this layout, else None.

        Must decide from `entries` (the folder's listing) and at most a few tiny reads, because `list`
        calls it for every folder of a run.
        """
        raise NotImplementedError

    def identify_file(self, url: str, entry: DirEntry) -> CheckpointRef | None:
        """The ref of the file at `url` (`entry`: its listing entry) if it is a whole checkpoint of this layout,
        else None. Asked for the files whose names end in one of `checkpoint_files`, in the folders the run
        walker lists that are not checkpoints themselves, and for a file given as a checkpoint: like
        `identify`, it decides from the name and at most a few small reads.
        """
        return None

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """The name of the child (a folder, or a file checkpoint) a `latest`-style pointer in this folder
        names, if any."""
        return None

    def open(self, url: str) -> Checkpoint:
        """Open a checkpoint identified by this layout: components, metadata, lazy tensor index."""
        raise NotImplementedError

    def identified(self, url: str, entries: Sequence[DirEntry], what: str) -> CheckpointRef:
        """`open`'s first step: the ref `identify` gives the folder `url` (`entries`: its listing).

        Args:
            what: what a checkpoint of this layout is, for the error (`a verl checkpoint (global_step_N/ ...)`).

        Raises:
            UnknownLayout: `identify` does not recognise the folder ("{url} is not {what}").
        """
        ref = self.identify(url, entries)
        if ref is None:
            raise UnknownLayout(f"{url} is not {what}")
        return ref

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """Structural problems: missing or short files, metadata that does not parse or cover its data."""
        raise NotImplementedError

    def load_set(self, checkpoint: Checkpoint) -> Sequence[LoadMember]:
        """The files the framework's own load reads of this checkpoint (`contract.load_set`), decided from the
        checkpoint's own facts (world size, roles, what its writer was asked to save), each with the
        framework's code that reads it and whether the load fails, loses state or only warns without it.

        `verify` checks every member is present and whole after the layout's own rules (`verify`), so that
        exit 0 means the framework's load succeeds. The default is empty: a layout whose `verify` already
        requires every file its framework reads need not repeat them.
        """
        return ()

    def torch_archives(self, checkpoint: Checkpoint) -> Sequence[TorchArchive]:
        """The torch.save zip archives of a checkpoint, whose recorded CRC-32s `verify` checks.

        The default finds them by name among `checkpoint.files`: every file named as torch.save files are
        (`.pt`, `.pth`, `.bin`, `.ckpt`: DeepSpeed's `*_states.pt`, the Trainer's `optimizer.pt`, a
        `pytorch_model.bin`), and every item of every torch DCP folder (a `.metadata` beside its `.distcp`
        files, at any depth). A file so named that is not a zip (a legacy pickle) is passed over by the
        check. A layout overrides this only when its archives are named otherwise.
        """
        return default_torch_archives(checkpoint)

    # ------------------------------------------------------------------------------------ the run walk

    def companions(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """Child folders of the folder `url` that belong to checkpoints kept beside them (open-instruct's
        shared `ref_policy/`, AReaL's `recover_info/`): neither listed nor walked."""
        return frozenset()

    def members(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """Child folders of the checkpoint at `url` that are part of it (a Trainer `checkpoint-N`'s DeepSpeed
        `global_stepN/`, the native layout's `dcp/`).

        The run walker records a folder that is a checkpoint and goes on walking its other child folders,
        which may hold checkpoints of their own (an HF Trainer `output_dir` holds the final model and the
        `checkpoint-N/` folders). A checkpoint is made of its own files and its member folders: that is
        what its size counts and what `prune` deletes when its folder holds other checkpoints, and its
        `Checkpoint.files` never include a file of another child folder. The default suits a layout whose
        checkpoints are flat folders of files.

        Args:
            url: the checkpoint folder (this layout identified it).
            entries: its listing.
        """
        return frozenset()

    # ------------------------------------------------------------------------------------------ prune

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """The files of a checkpoint folder of this layout without which it does not read as complete (or
        that describe its content, like a shard index), in the order its writer adds them.

        Where a folder cannot be renamed into place or out of sight at once (object stores), a writer
        uploads these last, in this order, and a deleter removes them first, the last one first: no moment
        of either passes for a complete checkpoint.

        Args:
            files: the folder's files, relative path (with `/`) -> size in bytes.
        """
        return ()

    def abandoned(self, ref: CheckpointRef, grace: timedelta) -> str | None:
        """Why a checkpoint of this layout that is not complete (`in_progress` or `abandoned` in `ref`) is
        what a save left when its writer stopped, so that `prune` may delete it; None while a writer may
        still be at it.

        A layout whose writers leave proof of who they are (a record of the writing process) or whose
        unfinished saves are otherwise recognisable overrides this; the default never says so, and such a
        checkpoint stays in progress for `prune`.

        Args:
            ref: the checkpoint as the scan found it.
            grace: how long after its last write an unfinished save may still be being written, when
                nothing proves its writer gone.
        """
        return None

    def protections(self, series: Sequence[CheckpointRef]) -> Protections:
        """What this framework's files say `prune` must keep among `series`, the checkpoints of one folder
        (a best checkpoint its training loop goes back to, ...).

        Asked of every layout for every folder, whatever layouts its checkpoints have, as `latest_pointer`
        is: the evidence is on disk, not in the layout that recognised a folder.
        """
        return Protections()

    # ---------------------------------------------------------------------------------------- metrics

    def metric_history(self, checkpoint: Checkpoint) -> tuple[Mapping[str, object], ...]:
        """The metrics the training logged up to this checkpoint, one mapping per logged step (each with an
        integer `step`), where the framework keeps such a log in its checkpoints (the Trainer's
        `log_history`); `report` draws the run's curves from it. The default: none, so the curves are the
        checkpoints' own `metrics`."""
        return ()

    # ---------------------------------------------------------------------------------------- resume

    def resume_profile(self) -> ResumeProfile:
        """How the framework that wrote this layout's checkpoints resumes from them (`resume-plan`): its
        setting, world-size rules, what it restores and its traps. The default is a generic plan."""
        from ckptctl.contract.resume import generic_profile

        return generic_profile(self.name)


#: Suffixes of the files torch.save writes as frameworks name them.
TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def checkpoint_problems(layout: Layout, checkpoint: Checkpoint) -> list[Problem]:
    """The structural problems of an opened checkpoint: its layout's rules (`Layout.verify`), then its load set
    (`Layout.load_set`, checked by `load_set.check_load_set`). What `verify` and `resume-plan` judge a
    checkpoint by, so that both say the same."""
    problems = list(layout.verify(checkpoint))
    return problems + check_load_set(checkpoint.url, layout.load_set(checkpoint), checkpoint.files, problems)


def default_torch_archives(checkpoint: Checkpoint) -> tuple[TorchArchive, ...]:
    """`Layout.torch_archives`' default: torch.save files by name, and the items of DCP folders (a
    `.metadata`, or the per-rank `__{rank}.metadata` of a save without collectives).

    A DCP folder whose metadata does not parse contributes nothing (structural verify reports why).
    """
    archives: list[TorchArchive] = []
    folders = set()
    # Both metadata names end so; the DCP readers are imported only where such a file is (a command's fixed cost).
    named = [rel for rel in checkpoint.files if rel.endswith(".metadata")]
    if named:
        from ckptctl.formats.dcp_folder_metadata import dcp_item_archives
        from ckptctl.formats.dcp_metadata import METADATA_NAME, RANK_METADATA
    for rel in named:
        folder, _, name = rel.rpartition("/")
        if name == METADATA_NAME or RANK_METADATA.match(name):
            folders.add(folder)
    for folder in sorted(folders):
        url = io.join(checkpoint.url, folder) if folder else checkpoint.url
        try:
            archives += dcp_item_archives(url, f"{folder}/" if folder else "")
        except CkptctlError:
            continue
    archives += (TorchArchive(rel) for rel in sorted(checkpoint.files) if rel.endswith(TORCH_SAVE_SUFFIXES))
    return tuple(archives)


def every_child_folder(entries: Sequence[DirEntry]) -> frozenset[str]:
    """The names of all child folders of a listing: `members` of a layout whose framework writes and
    deletes its checkpoint folder as a whole, so that anything inside belongs to the checkpoint."""
    return frozenset(e.name for e in entries if e.is_dir)


@dataclass(frozen=True, slots=True)
class Protections:
    """Checkpoints a framework's own files say must be kept (`Layout.protections`).

    Attributes:
        reasons: checkpoint URL -> why it is kept, for a person.
        notes: what a person should know (a best checkpoint that is named but not there, ...).
    """

    reasons: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


#: How many absent ranks or shards a layout names one by one (`absent_numbers`); the rest are counted.
LISTED_ABSENT = 20


def absent_numbers(present: Iterable[int], count: int, limit: int = LISTED_ABSENT) -> tuple[list[int], int]:
    """The first `limit` numbers of 0..count-1 missing from `present`, and how many are missing in all.

    Ranks and shard counts come from file names and metadata that a damaged or hostile checkpoint may set
    to billions (`rng_state_99999999999.pth`): this never loops over more than `len(present) + limit`
    numbers, where listing every number below `count` would never end.
    """
    have = {n for n in present if 0 <= n < count}
    listed = list(itertools.islice((n for n in range(count) if n not in have), limit))
    return listed, max(0, count) - len(have)


def timestamp(mtime: float | None) -> datetime | None:
    """A UTC datetime from a POSIX mtime (None or 0 means unknown)."""
    return datetime.fromtimestamp(mtime, tz=UTC) if mtime else None


def folder_size(url: str, entries: Sequence[DirEntry] | None = None) -> int:
    """Total size of the files below a folder (recursive).

    `entries`, the folder's listing when the caller has it, saves a request when it holds no folder.
    """
    if entries is not None and not any(e.is_dir for e in entries):
        return sum(e.size for e in entries)
    return sum(e.size for e in io.list_tree(url).values())


def newest_mtime(entries: Sequence[DirEntry]) -> float | None:
    """The newest modification time of the files in a listing (None for an empty listing)."""
    times = [e.mtime for e in entries if not e.is_dir and e.mtime]
    return max(times) if times else None


def list_files(url: str) -> dict[str, int]:
    """Every file below a folder: relative path (with `/`) -> size in bytes (one listing on object stores)."""
    return {rel: entry.size for rel, entry in sorted(io.list_tree(url).items())}
