"""ByteCheckpoint checkpoints (LAYOUTS.md, ByteCheckpoint; the names are `files`).

`bcp.save(ckpt_path, {"model": ..., "optimizer": ..., "extra_state": ...}, framework=..., global_steps=N)`
writes `ckpt_path/global_step_N/`: `model/` and `optimizer/` are torch DCP folders in shape (a `.metadata`
beside `__{rank}_{i}.distcp` files) but not in content: the data files hold raw tensor bytes (no torch.save
archive per item, so no CRC-32 to check) and `.metadata` pickles ByteCheckpoint's own class
(`frameworks.bytecheckpoint.metadata`). `extra_state/extra_state_rank_{R}.pt` is each rank's torch.save of its
extra state. Rank 0 writes `ckpt_path/latest_checkpointed_iteration.txt` only after its gRPC coordinator has
gathered that every rank's files are written: that tracker is the only record of a finished save (with
`fast_saving`, the second save of a model writes `.metadata` before the data). A step folder newer than the
tracker is a save under way, or one that died (`parts.in_progress`), never complete.

A multi-role trainer (an actor and a critic) saves each role into a folder of its own inside the step folder
(`global_step_N/{actor,critic}/{model,optimizer}/`): the step is the checkpoint, its roles are listed, and its
tensors are the actor's (the model people convert), as for verl. A `model/` or `optimizer/` folder given on
its own is that part of its save (the walk never lists it: it is a member of its step folder).

Tensors are read from the byte ranges the storage records give (RAW chunks), the model's under the names its
`state_dict()` has, the optimizer's under `optimizer.`; verify checks each record's pickled tensor header
against the metadata (the bytes are a contiguous shard of that dtype and shape).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache, partial
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import (
    Checkpoint,
    CheckpointRef,
    CheckpointState,
    ChunkEncoding,
    Component,
    Problem,
    ProblemKind,
    TensorEntry,
    dtype_itemsize,
)
from ckptctl.contract.base import (
    Layout,
    absent_numbers,
    every_child_folder,
    folder_size,
    list_files,
    newest_mtime,
    timestamp,
)
from ckptctl.contract.load_set import LoadMember, MemberKind
from ckptctl.errors import CkptctlError, CorruptCheckpoint, UnknownLayout
from ckptctl.families.dcp_folder import (
    DISTCP_RE,
    component_for_prefix,
    index_from_metadata,
    pickled_class,
    verify_dcp_metadata,
)
from ckptctl.families.in_progress import unfinished_state
from ckptctl.families.torch_file import torch_file_problems
from ckptctl.formats.dcp_metadata import METADATA_NAME
from ckptctl.formats.torch_pickle import open_torch_pickle
from ckptctl.formats.torch_zip import TorchArchive
from ckptctl.frameworks.bytecheckpoint.files import (
    COMPONENT_FOLDERS,
    EXTRA_STATE,
    EXTRA_STATE_RE,
    MODEL,
    OPTIMIZER,
    STEP_RE,
    TRACKER,
    read_tracker,
)
from ckptctl.frameworks.bytecheckpoint.metadata import (
    BCP_METADATA_CLASS,
    BcpMetadata,
    header_problem,
    load_bcp_metadata,
)
from ckptctl.io import DirEntry
from ckptctl.layouts import peek_dir

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = ["BytecheckpointLayout"]

_TMP_METADATA = METADATA_NAME + ".tmp"
#: The roles that hold the model people convert, best first.
_POLICY_ROLES = ("actor", "policy")
#: Extra-state keys that are the loop's counters (ByteCheckpoint leaves the extra state to the user).
_COUNTERS = frozenset({"step", "global_step", "global_steps", "iteration", "iter_num", "epoch", "consumed_samples"})
#: An extra-state key longer than this is no name.
_MAX_KEY = 200


# --------------------------------------------------------------------------------------------------
# A save folder (`global_step_N/`, or a role folder in it) from the listings of its component folders.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Save:
    """A save folder as its listings tell.

    Attributes:
        role: the role folder's name ("" for the checkpoint folder itself).
        listings: each component folder present (`model`, `optimizer`, `extra_state`) -> its listing.
        newest: the newest mtime of its files.
        alone: the component the checkpoint folder itself is (a `model/` folder given on its own), or "".
    """

    role: str
    listings: Mapping[str, Sequence[DirEntry]]
    newest: float | None
    alone: str = ""

    @property
    def prefix(self) -> str:
        return f"{self.role}/" if self.role else ""

    def label(self, component: str) -> str:
        """What the paths of a component folder's files start with, relative to the checkpoint."""
        return "" if component == self.alone else f"{self.prefix}{component}/"

    def folder(self, url: str, component: str) -> str:
        """The component folder of the checkpoint at `url`."""
        label = self.label(component)
        return io.join(url, label.rstrip("/")) if label else url

    def data_ranks(self, component: str) -> set[int]:
        return {
            int(m.group(1)) for e in self.listings.get(component, ()) if not e.is_dir and (m := DISTCP_RE.match(e.name))
        }

    def extra_ranks(self) -> set[int]:
        return {
            int(m.group(1))
            for e in self.listings.get(EXTRA_STATE, ())
            if not e.is_dir and (m := EXTRA_STATE_RE.match(e.name))
        }

    @property
    def world_size(self) -> int | None:
        """The highest rank any file names, plus one: every rank writes its extra state and a data file of each
        component (DCP's one `__{rank}_0.distcp` per rank), so a file one rank lost leaves the others to tell."""
        ranks = self.extra_ranks() | self.data_ranks(MODEL) | self.data_ranks(OPTIMIZER)
        return max(ranks) + 1 if ranks else None

    def problems(self) -> list[str]:
        """What its listings show missing (empty when they show a whole save)."""
        found = [] if MODEL in self.listings or self.alone else [f"{self.prefix}{MODEL}/ missing"]
        for component in COMPONENT_FOLDERS:
            listing = self.listings.get(component)
            if listing is None:
                continue
            names = {e.name for e in listing if not e.is_dir}
            if _TMP_METADATA in names:
                found.append(f"{self.label(component)}{_TMP_METADATA} present: being written")
            elif METADATA_NAME not in names:
                found.append(f"no {self.label(component)}{METADATA_NAME} yet")
        if MODEL in self.listings and OPTIMIZER in self.listings:
            model, optimizer = self.data_ranks(MODEL), self.data_ranks(OPTIMIZER)
            for component, missing in ((OPTIMIZER, model - optimizer), (MODEL, optimizer - model)):
                if missing:  # named as the file the rank writes first (see `world_size`): verify names it
                    rank = min(missing)
                    found.append(f"no {self.prefix}{component}/__{rank}_0.distcp (the data file of rank {rank})")
        world = self.world_size
        extra = self.extra_ranks()
        if extra and world is not None and len(extra) < world:
            absent = min(set(range(world)) - extra)
            found.append(f"{self.prefix}{EXTRA_STATE}/extra_state_rank_{absent}.pt missing")
        return found


def _is_bcp_folder(url: str, listing: Sequence[DirEntry]) -> bool:
    """Whether a component folder's `.metadata` pickles ByteCheckpoint's class (read from its first bytes)."""
    meta = next((e for e in listing if e.name == METADATA_NAME and not e.is_dir), None)
    return meta is not None and pickled_class(io.join(url, METADATA_NAME), meta.size, meta.mtime) == BCP_METADATA_CLASS


def _save(url: str, entries: Sequence[DirEntry], role: str, step_folder: bool) -> _Save | None:
    """The save folder at `url`, or None when it is none: a `model/` or `optimizer/` folder of which one holds
    ByteCheckpoint's `.metadata` (ByteCheckpoint saves no checkpoint without a model: one without is broken); or,
    in a step folder, a `model/` that has none yet beside the other folders `bcp.save` creates with it (a save
    under way)."""
    folders = {e.name for e in entries if e.is_dir}
    if MODEL not in folders and OPTIMIZER not in folders:
        return None
    listings = {
        name: listing
        for name in (*COMPONENT_FOLDERS, EXTRA_STATE)
        if name in folders and (listing := peek_dir(io.join(url, name))) is not None
    }
    ours = any(_is_bcp_folder(io.join(url, name), listings.get(name, ())) for name in COMPONENT_FOLDERS)
    if not ours:
        model = listings.get(MODEL)
        started = (
            model is not None
            and not any(e.name == METADATA_NAME for e in model)
            and (OPTIMIZER in folders or EXTRA_STATE in folders)
        )
        if not (step_folder and started):
            return None
    newest = max((t for listing in listings.values() if (t := newest_mtime(listing))), default=None)
    return _Save(role, listings, newest)


def _saves(url: str, entries: Sequence[DirEntry]) -> list[_Save]:
    """The checkpoint folder's saves: itself, or (a step folder of a multi-role trainer) its role folders,
    the policy first."""
    step_folder = STEP_RE.match(io.name_of(url)) is not None
    own = _save(url, entries, "", step_folder)
    if own is not None:
        return [own]
    name = io.name_of(url)
    if name in COMPONENT_FOLDERS and _is_bcp_folder(url, entries):
        return [_Save("", {name: entries}, newest_mtime(entries), alone=name)]
    if not step_folder:
        return []
    roles = [
        found
        for e in entries
        if e.is_dir
        and not e.name.startswith(".")
        and (listing := peek_dir(io.join(url, e.name))) is not None
        and (found := _save(io.join(url, e.name), listing, e.name, True)) is not None
    ]
    return sorted(roles, key=lambda s: (_POLICY_ROLES.index(s.role) if s.role in _POLICY_ROLES else 2, s.role))


def _tracker(url: str) -> int | None:
    """The step the tracker beside a step folder names (None without one)."""
    run = io.parent_of(url)
    entries = peek_dir(run) if run else None
    return None if entries is None else read_tracker(run, entries)


def _state(url: str, saves: Sequence[_Save]) -> tuple[CheckpointState, str]:
    """Whole when its listings are and, for a step folder of one save, when the tracker has reached its step."""
    problems = [p for s in saves for p in s.problems()]
    newest = max((s.newest for s in saves if s.newest), default=None)
    m = STEP_RE.match(io.name_of(url))
    tracked = m is not None and len(saves) == 1 and not saves[0].role
    tracker = _tracker(url) if tracked else None
    if m is not None and tracker is not None and int(m.group(1)) > tracker:
        unfinished = f"newer than the tracker's step {tracker}: not every rank finished this save"
        return unfinished_state(newest), "; ".join([unfinished, *problems])
    if problems:
        # The tracker reached this step (or there is none to tell): what is missing now was lost after the save.
        state = CheckpointState.BROKEN if tracker is not None else unfinished_state(newest)
        return state, "; ".join(problems)
    if tracked and tracker is None:
        return CheckpointState.COMPLETE, f"no {TRACKER} beside it: completion not recorded"
    return CheckpointState.COMPLETE, ""


# --------------------------------------------------------------------------------------------------
# The tensor index and the extra state.
# --------------------------------------------------------------------------------------------------


def _metadata(url: str, listing: Sequence[DirEntry]) -> BcpMetadata:
    """The parsed `.metadata` of a component folder.

    Raises:
        CorruptCheckpoint: there is none (the save has not finished), or it does not parse.
        UnsafePickle: it names a global outside the allowlist.
    """
    meta = next((e for e in listing if e.name == METADATA_NAME and not e.is_dir), None)
    if meta is None:
        raise CorruptCheckpoint(f"{url} has no {METADATA_NAME}: the save has not finished (or was interrupted)")
    return load_bcp_metadata(io.join(url, METADATA_NAME), meta)


def _index(url: str, save: _Save) -> tuple[TensorEntry, ...]:
    """The model's tensors under their stored names, the optimizer's under `optimizer.`, as RAW chunks.

    Raises:
        CorruptCheckpoint, UnsafePickle: a `.metadata` is missing or unreadable, or a record's length is not
            its chunk's element bytes.
    """
    entries: list[TensorEntry] = []
    for component, kind, prefix in ((MODEL, Component.MODEL, ""), (OPTIMIZER, Component.OPTIMIZER, "optimizer.")):
        listing = save.listings.get(component)
        if listing is None:
            continue
        folder = save.folder(url, component)
        metadata = _metadata(folder, listing)
        if component == MODEL and metadata.flat_parameters:
            raise CorruptCheckpoint(
                f"{folder} holds FSDP1 flat parameters (save_decomposed_model_optimizer), which ckptctl does not "
                "unflatten",
                "merge it with ByteCheckpoint's scripts/merge_bcp.py --fsdp_save_decomposed_model",
            )
        for entry in index_from_metadata(metadata.dcp, _all_of(kind), save.label(component), ChunkEncoding.RAW):
            itemsize = dtype_itemsize(entry.dtype)
            for chunk in entry.chunks:
                if chunk.byte_length != chunk.numel * itemsize:
                    raise CorruptCheckpoint(
                        f"{folder}: {entry.name} at {list(chunk.offsets)} is stored in {chunk.byte_length} bytes, "
                        f"its elements take {chunk.numel * itemsize}"
                    )
            entries.append(replace(entry, name=prefix + entry.name) if prefix else entry)
    return tuple(entries)


def _all_of(kind: Component) -> Callable[[str], Component]:
    """A folder's keys all belong to one component (ByteCheckpoint saves the model and the optimizer apart)."""

    def component_of(_key: str) -> Component:
        return kind

    return component_of


def _extra_state(url: str, save: _Save) -> dict[str, Any]:
    """Rank 0's extra state, read through the allowlist ({} when there is none or it does not read)."""
    listing = save.listings.get(EXTRA_STATE, ())
    entry = next((e for e in listing if e.name == "extra_state_rank_0.pt"), None)
    if entry is None:
        return {}
    try:
        root = open_torch_pickle(io.join(url, save.prefix + EXTRA_STATE, entry.name), entry.size).root
    except CkptctlError:
        return {}
    return root if isinstance(root, dict) else {}


def _extra_components(state: Mapping[Any, Any]) -> tuple[set[Component], dict[str, Any]]:
    """What the extra state's keys hold (the RNG, a scheduler, counters...) and its scalar counters."""
    components: set[Component] = set()
    counters: dict[str, Any] = {}
    for key, value in state.items():
        if type(key) is not str or len(key) > _MAX_KEY:
            continue
        if key in _COUNTERS:
            components.add(Component.TRAINER_STATE)
            if type(value) in (int, float):
                counters[key] = value
            continue
        found = component_for_prefix(key)
        if found is not None and found not in (Component.MODEL, Component.OPTIMIZER):
            components.add(found)
    return components, counters


# --------------------------------------------------------------------------------------------------
# The layout.
# --------------------------------------------------------------------------------------------------


class BytecheckpointLayout(Layout):
    """A ByteCheckpoint save folder (`global_step_N/`, or the folder `bcp.save` was given without
    `global_steps`), a step folder holding one such folder per role, or one `model/` or `optimizer/` folder
    given on its own (the walk never lists those: they are members of their save)."""

    name = "bytecheckpoint"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A folder with a `model/` folder of ByteCheckpoint's (its `.metadata` pickles ByteCheckpoint's class),
        a `global_step_N` folder holding role folders that are, or such a component folder itself."""
        saves = _saves(url, entries)
        if not saves:
            return None
        state, note = _state(url, saves)
        roles = [s.role for s in saves if s.role]
        if roles:
            note = "; ".join(filter(None, [f"roles: {', '.join(roles)}", note]))
        m = STEP_RE.match(io.name_of(io.parent_of(url) if saves[0].alone else url))
        if saves[0].alone:
            note = "; ".join(filter(None, [f"the {saves[0].alone} of a ByteCheckpoint save alone", note]))
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=int(m.group(1)) if m else None,
            epoch=None,
            created=timestamp(max((s.newest for s in saves if s.newest), default=None)),
            state=state,
            size_bytes=folder_size(url, entries),
            note=note,
        )

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """The `global_step_N` folder the tracker names (what `find_latest_ckpt_path` loads)."""
        step = read_tracker(url, entries)
        child = None if step is None else f"global_step_{step}"
        return child if child is not None and any(e.name == child and e.is_dir for e in entries) else None

    def members(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """Every child folder: the component folders, and a step's role folders."""
        return every_child_folder(entries)

    def open(self, url: str) -> Checkpoint:
        """Components, world size, roles and counters from the listings, `.metadata` and rank 0's extra state;
        a lazy tensor index of the policy's (the only role's) model and optimizer."""
        entries = io.list_dir(url)
        ref = self.identify(url, entries)
        saves = _saves(url, entries)
        if ref is None or not saves:
            raise UnknownLayout(f"{url} is not a ByteCheckpoint checkpoint (no model/ with its .metadata)")
        main = saves[0]
        components: set[Component] = set()
        for save in saves:
            components |= {Component.MODEL} if MODEL in save.listings else set()
            components |= {Component.OPTIMIZER} if OPTIMIZER in save.listings else set()
        extra = _extra_state(url, main)
        found, counters = _extra_components(extra)
        components |= found
        info: dict[str, Any] = {
            "format": "bytecheckpoint",
            "roles": [s.role for s in saves if s.role],
            "tensors_of": main.role or None,
            "saved": {s.role or ".": sorted(s.listings) for s in saves},
            "extra_state_keys": sorted(k for k in extra if type(k) is str and len(k) <= _MAX_KEY),
            "framework": "not recorded (bcp.save's framework: fsdp, fsdp2 or ddp)",
        }
        try:
            info["bytecheckpoint_version"] = _metadata(main.folder(url, MODEL), main.listings.get(MODEL, ())).version
        except CkptctlError as exc:
            info["error"] = exc.message
            if ref.state is CheckpointState.COMPLETE:
                ref = replace(ref, state=CheckpointState.BROKEN, note=exc.message)
        if STEP_RE.match(io.name_of(url)):
            info["tracker_step"] = _tracker(url)
        progress = dict(counters)
        if ref.step is not None:
            progress.setdefault("global_step", ref.step)
        info["progress"] = progress

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            return _index(url, main)

        return Checkpoint(
            ref=ref,
            components=frozenset(components),
            world_size=main.world_size,
            metadata=info,
            tensor_index=tensor_index,
            files=list_files(url),
            progress=progress,
        )

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """Every component folder's `.metadata` safe and whole, every data file it names present and long enough,
        chunks tiling each tensor, each record's tensor header agreeing with it; each rank's extra state
        present and safe; a step folder not newer than the tracker."""
        url = checkpoint.url
        entries = io.list_dir(url)
        saves = _saves(url, entries)
        problems: list[Problem] = []
        for save in saves:
            problems += _save_problems(url, save)
        m = STEP_RE.match(io.name_of(url))
        if m is not None and len(saves) == 1 and not saves[0].role:
            tracker = _tracker(url)
            if tracker is None:
                problems.append(
                    Problem(
                        ProblemKind.MISSING_FILE,
                        f"../{TRACKER}",
                        f"no {TRACKER} beside the step folder: nothing records that every rank finished the save",
                        severity="warning",
                    )
                )
            elif int(m.group(1)) > tracker:
                problems.append(
                    Problem(
                        ProblemKind.IN_PROGRESS,
                        "",
                        f"{TRACKER} names step {tracker}: rank 0 writes it only once every rank has written its "
                        "files, so this newer save is under way or did not finish",
                    )
                )
        return problems

    def load_set(self, checkpoint: Checkpoint) -> Sequence[LoadMember]:
        """Each rank's `extra_state/extra_state_rank_{R}.pt` of a save that wrote extra state (the model and
        optimizer folders are the layout's own rules). The ranks present are read by `verify`; the members
        named here are the absent ones of the save's world size (the first `LISTED_ABSENT`).

        bcp 0.0.2 `FSDPCheckpointer.load` (and the FSDP2 and DDP checkpointers', `checkpointer/fsdp_checkpointer.py`)
        reads `extra_state_rank_{dist.get_rank()}.pt` and, when that file does not exist, rank 0's in its place
        without a word: the rank resumes with rank 0's RNG and sampler state, its own silently lost. So a missing
        rank's file is an error, not a warning.
        """
        members: list[LoadMember] = []
        for save in _saves(checkpoint.url, io.list_dir(checkpoint.url)):
            world = save.world_size
            if EXTRA_STATE not in save.listings or world is None:
                continue
            missing, _ = absent_numbers(save.extra_ranks(), world)
            members += [
                LoadMember(
                    f"{save.prefix}{EXTRA_STATE}/extra_state_rank_{rank}.pt",
                    MemberKind.TORCH_SAVE,
                    f"rank {rank}'s extra state (of {world} ranks)",
                    "bcp.load (FSDPCheckpointer.load, which loads rank 0's file in its place)",
                )
                for rank in missing
            ]
        return members

    def torch_archives(self, checkpoint: Checkpoint) -> Sequence[TorchArchive]:
        """Each rank's extra state and the non-tensor items (`param_groups`), torch.save archives; tensor data
        is raw bytes, with no CRC-32 to check."""
        archives = [TorchArchive(rel) for rel in sorted(checkpoint.files) if rel.endswith(".pt")]
        entries = io.list_dir(checkpoint.url)
        for save in _saves(checkpoint.url, entries):
            for component in COMPONENT_FOLDERS:
                listing = save.listings.get(component)
                if listing is None:
                    continue
                try:
                    metadata = _metadata(save.folder(checkpoint.url, component), listing).dcp
                except CkptctlError:
                    continue
                for key in metadata.bytes_keys:
                    record = metadata.storage.get((key, None))
                    if record is not None:
                        file = f"{save.label(component)}{record.relative_path}"
                        archives.append(TorchArchive(file, record.offset, record.length, key))
        return archives

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """Each component folder's `.metadata` (without it the folder reads as a save under way); the tracker
        that records the save lies outside the checkpoint."""
        return tuple(sorted(name for name in files if name.rpartition("/")[2] == METADATA_NAME))

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.bytecheckpoint.resume`."""
        from ckptctl.frameworks.bytecheckpoint.resume import PROFILE

        return PROFILE


def _save_problems(url: str, save: _Save) -> list[Problem]:
    """`verify` of one save folder of the checkpoint at `url` (problem paths relative to the checkpoint)."""
    problems: list[Problem] = []
    if MODEL not in save.listings and not save.alone:
        problems.append(Problem(ProblemKind.MISSING_FILE, f"{save.prefix}{MODEL}/", "no model folder"))
    for component in COMPONENT_FOLDERS:
        listing = save.listings.get(component)
        if listing is not None:
            problems += _component_problems(save.folder(url, component), listing, save.label(component))
    for entry in save.listings.get(EXTRA_STATE, ()):
        if not entry.is_dir and EXTRA_STATE_RE.match(entry.name):
            problems += _extra_state_problems(io.join(url, save.prefix + EXTRA_STATE, entry.name), entry, save.prefix)
    return problems


def _component_problems(url: str, listing: Sequence[DirEntry], prefix: str) -> list[Problem]:
    """A model or optimizer folder: its `.metadata`, the data it names (DCP's rules), each record's header."""
    by_name = {e.name: e for e in listing if not e.is_dir}
    if _TMP_METADATA in by_name or METADATA_NAME not in by_name:
        return [
            Problem(
                ProblemKind.IN_PROGRESS,
                prefix + METADATA_NAME,
                f"no {METADATA_NAME} yet ({_TMP_METADATA} present)"
                if _TMP_METADATA in by_name
                else f"no {METADATA_NAME}: the save has not finished (or was interrupted)",
            )
        ]
    try:
        metadata = load_bcp_metadata(io.join(url, METADATA_NAME), by_name[METADATA_NAME])
    except CorruptCheckpoint as exc:
        return [Problem.of_unreadable(exc, prefix + METADATA_NAME, ProblemKind.BAD_METADATA)]
    problems = verify_dcp_metadata(url, metadata.dcp, by_name, prefix)
    for key, tensor in metadata.dcp.tensors():
        for chunk in tensor.chunks:
            if (key, chunk.offsets) not in metadata.dcp.storage:
                continue  # reported by the coverage rule
            why = header_problem(metadata, (key, chunk.offsets), tensor, chunk.sizes)
            if why is not None:
                problems.append(
                    Problem(ProblemKind.SIZE_MISMATCH, f"{prefix}{key}", f"chunk at {list(chunk.offsets)}: {why}")
                )
    return problems


def _extra_state_problems(url: str, entry: DirEntry, prefix: str) -> list[Problem]:
    path = f"{prefix}{EXTRA_STATE}/{entry.name}"
    _, problems = torch_file_problems(
        path, partial(open_torch_pickle, url, entry.size), unreadable=ProblemKind.UNREADABLE
    )
    return problems
