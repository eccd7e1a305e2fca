"""torch.distributed.checkpoint (DCP) folders: `.metadata` + `__{rank}_{n}.distcp` (LAYOUTS.md, DCP).

Listing, opening and structural verification read `.metadata` and directory listings only, never tensor
data, and need no torch: `.metadata` is parsed by `formats.dcp_metadata` with inert stand-ins for the
torch classes it names. Each tensor chunk is a torch.save archive at (file, offset, length), which the
index exposes as `ChunkEncoding.TORCH_SAVE` chunks for `formats.chunks.read_tensor`.

A save without collectives (`dcp.save(..., use_collectives=False)`) has no `.metadata` but one
`__{rank}.metadata` per rank, each describing what its rank wrote: read as their merge (`rank_metadata`).
torch loads such a save only rank by rank, each rank from its own file.

Many plugins keep DCP folders: the DCP plugin and torchtitan read one as the checkpoint (`DcpFolderLayout`,
which both subclass); the core's `step-N/dcp/`, the Trainer's and accelerate's FSDP folders, AReaL's
recover slot, Megatron, ROLL and Lightning hold them inside theirs: `dcp_tensor_index` and `verify_dcp`
take the folder URL and a path prefix that makes chunk files relative to the outer checkpoint. Reading
the metadata itself (cached) is `dcp_folder_metadata`.
"""

from __future__ import annotations

import pickletools
import re
import struct
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from functools import cache, lru_cache
from io import BytesIO

from ckptctl import io
from ckptctl.checkpoint import (
    Checkpoint,
    CheckpointRef,
    CheckpointState,
    ChunkEncoding,
    Component,
    Problem,
    ProblemKind,
    TensorChunk,
    TensorEntry,
    dtype_itemsize,
    raising_index,
)
from ckptctl.contract.base import LISTED_ABSENT, Layout, newest_mtime, step_from_name, timestamp
from ckptctl.contract.step_names import epoch_from_name
from ckptctl.contract.training_state import COUNTER_KEYS, TrainingState
from ckptctl.errors import (
    CheckpointInProgress,
    CheckpointNotFound,
    CkptctlError,
    CorruptCheckpoint,
    UnknownLayout,
)
from ckptctl.families.hf_folder import model_components
from ckptctl.formats.chunks import tiling_problem
from ckptctl.formats.dcp_folder_metadata import in_progress_error, load_dcp_metadata, parse_cached, rank_metadata
from ckptctl.formats.dcp_metadata import METADATA_NAME, RANK_METADATA, DcpMetadata, DcpTensor, merge_rank_metadata
from ckptctl.formats.safe_pickle import gc_paused
from ckptctl.formats.torch_save import read_object_archive
from ckptctl.io import DirEntry

__all__ = [
    "DISTCP_RE",
    "MTIME_SLACK_S",
    "RANK_METADATA_KEY",
    "DcpFolderLayout",
    "KeyClassifier",
    "component_classifier",
    "component_for_prefix",
    "data_newer_than_metadata",
    "dcp_tensor_index",
    "index_from_metadata",
    "one_component",
    "pickled_class",
    "verify_dcp",
    "verify_dcp_metadata",
    "world_size_of",
]

#: Components a DCP folder can hold as plain files beside its data (`convert --to dcp` copies them).
_BESIDE = frozenset({Component.CONFIG, Component.TOKENIZER})

#: The key of `Checkpoint.metadata` that counts the per-rank metadata files of a save without collectives.
RANK_METADATA_KEY = "per_rank_metadata_files"

#: Data files torch's FileSystemWriter creates: `__{rank}_{n}.distcp`.
DISTCP_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_TMP_METADATA = METADATA_NAME + ".tmp"

_PREFIXES: dict[str, Component] = {
    "model": Component.MODEL,
    "module": Component.MODEL,
    "optim": Component.OPTIMIZER,
    "optimizer": Component.OPTIMIZER,
    "scheduler": Component.SCHEDULER,
    "lr_scheduler": Component.SCHEDULER,
    "dataloader": Component.DATALOADER,
    "sampler": Component.DATALOADER,
    "trainer_state": Component.TRAINER_STATE,
    "train_state": Component.TRAINER_STATE,  # torchtitan
}


def component_for_prefix(prefix: str) -> Component | None:
    """The component a state-dict key's first segment names (`optim` → OPTIMIZER), or None."""
    found = _PREFIXES.get(prefix)
    if found is None and prefix.startswith("rng"):
        return Component.RNG
    return found


class KeyClassifier:
    """Assigns the flattened keys of one save to components (see `component_classifier`).

    Calling it classifies one key; `components` holds the components of all the keys it was built from,
    found from their distinct prefixes rather than key by key.
    """

    def __init__(self, depth: int, fallback: Component, segments: Iterable[str]) -> None:
        self._depth = depth
        self._fallback = fallback
        # 100k keys share a handful of prefixes: remember each prefix's answer.
        self._memo: dict[str, Component] = {}
        self.components = frozenset(map(self._segment, segments))

    def _segment(self, segment: str) -> Component:
        component = self._memo.get(segment)
        if component is None:
            component = self._memo[segment] = component_for_prefix(segment) or self._fallback
        return component

    def __call__(self, key: str) -> Component:
        segment = key.split(".", 2)[1] if self._depth and "." in key else key.partition(".")[0]
        component = self._memo.get(segment)
        return component if component is not None else self._segment(segment)


def component_classifier(keys: Iterable[str]) -> KeyClassifier:
    """How to assign the keys of one save to components, decided from all of its keys.

    Keys are classified by their first dotted segment. Two conventions are common enough to handle:
    one wrapper segment around everything (`app.model.*`, AReaL's `dcp.model.*`) is skipped; and keys
    with no recognised prefix are model weights unless the save is namespaced (a `model.*` namespace
    next to another recognised one, such as `optim.*`): a raw `dcp.save(model.state_dict())` (whose top
    module may itself be called `model`), or torchtitan's flattened model next to `optimizer.*`.
    """
    keys = keys if isinstance(keys, Collection) else list(keys)
    segments = {key.partition(".")[0] for key in keys}
    depth = 0
    if len(segments) == 1 and component_for_prefix(next(iter(segments))) is None:
        seconds = {key.partition(".")[2].partition(".")[0] for key in keys}
        if any(component_for_prefix(s) is not None for s in seconds):
            depth, segments = 1, seconds
    found = {component_for_prefix(p) for p in segments}
    # `model.*` next to `lm_head.*` with no optimizer, scheduler or other namespace is a raw
    # `dcp.save(model.state_dict())` of a `...ForCausalLM`: its unrecognised keys are model weights too.
    namespaced = Component.MODEL in found and len(found - {None}) > 1
    return KeyClassifier(depth, Component.EXTRA if namespaced else Component.MODEL, segments)


def _rank_metadata_state(entries: Sequence[DirEntry], per_rank: Sequence[DirEntry]) -> tuple[CheckpointState, str]:
    """Complete when every rank that wrote data also wrote its `__{rank}.metadata` (after its data)."""
    written = {int(m.group(1)) for e in entries if not e.is_dir and (m := DISTCP_RE.match(e.name))}
    described = {int(m.group(1)) for e in per_rank if (m := RANK_METADATA.match(e.name))}
    pending = sorted(written - described)
    if pending or any(e.name.endswith(f"{METADATA_NAME}.tmp") for e in entries):
        shown = ", ".join(f"__{r}{METADATA_NAME}" for r in pending[:4]) or f"a rank's {METADATA_NAME}.tmp"
        return CheckpointState.IN_PROGRESS, f"saved without collectives, {shown} not written yet"
    return CheckpointState.COMPLETE, "saved without collectives: per-rank metadata, loads only on the same ranks"


def world_size_of(entries: Sequence[DirEntry], referenced: Mapping[str, int] | None = None) -> int | None:
    """The number of ranks that wrote the save, from `__{rank}_{n}.distcp` names.

    Args:
        entries: the folder's listing.
        referenced: `DcpMetadata.referenced_files()` when the metadata is readable. Then files it does
            not reference are left out unless empty: a rank with nothing to write still leaves an empty
            file, while non-empty unreferenced files are stale leftovers of an earlier save.
    """
    names = [e.name for e in entries if referenced is None or e.name in referenced or e.size == 0]
    ranks = {int(m.group(1)) for name in (*names, *(referenced or ())) if (m := DISTCP_RE.match(name))}
    return max(ranks) + 1 if ranks else None


def one_component(component: Component) -> Callable[[str], Component]:
    """A `component_of` that puts every key in `component`: a folder that holds one kind of state only (a
    framework's separate model and optimizer folders)."""
    return lambda _key: component


def dcp_tensor_index(
    url: str, component_of: Callable[[str], Component], path_prefix: str = ""
) -> tuple[TensorEntry, ...]:
    """The tensor index of the DCP folder at `url`, from `.metadata` only.

    Args:
        url: the DCP folder.
        component_of: assigns each flattened key to a component (see `component_classifier`).
        path_prefix: prepended to chunk file names, so that they are relative to an outer checkpoint
            (the native layout passes `"dcp/"`).

    Returns:
        One entry per tensor, in stored order, with TORCH_SAVE chunks. Chunks without a storage record
        are left out (verify reports them; `read_tensor` refuses the incomplete tensor).

    Raises:
        CheckpointInProgress, UnsafePickle, CorruptCheckpoint: as `load_dcp_metadata`.
    """
    return index_from_metadata(load_dcp_metadata(url), component_of, path_prefix)


def index_from_metadata(
    metadata: DcpMetadata,
    component_of: Callable[[str], Component],
    path_prefix: str = "",
    encoding: ChunkEncoding = ChunkEncoding.TORCH_SAVE,
) -> tuple[TensorEntry, ...]:
    """`dcp_tensor_index` for metadata already parsed; `encoding` is how the records store their chunks (a
    library that writes DCP's metadata over raw element bytes, ByteCheckpoint, passes RAW)."""
    storage = metadata.storage.get
    files: dict[str, str] = {}
    entries: list[TensorEntry] = []
    append = entries.append
    chunk_of, entry_of = TensorChunk, TensorEntry
    with gc_paused():  # 100k entries: see gc_paused
        for key, tensor in metadata.entries.items():
            if type(tensor) is not DcpTensor:
                continue
            chunks = []
            for chunk in tensor.chunks:
                record = storage((key, chunk.offsets))
                if record is None:
                    continue
                file = record.relative_path
                if path_prefix:
                    file = files.get(file) or files.setdefault(file, path_prefix + file)
                chunks.append(chunk_of(file, record.offset, record.length, chunk.offsets, chunk.sizes, encoding))
            append(entry_of(key, component_of(key), tensor.dtype, tensor.size, tuple(chunks)))
    return tuple(entries)


# --------------------------------------------------------------------------------------------------
# Verify.
# --------------------------------------------------------------------------------------------------


def verify_dcp(url: str, path_prefix: str = "") -> list[Problem]:
    """Structural problems of the DCP folder at `url`, from `.metadata` and the listing only.

    Checks: `.metadata` present (else IN_PROGRESS), parses (BAD_METADATA) and is safe (UNSAFE_PICKLE);
    every storage file present (MISSING_FILE) and long enough for its records (TRUNCATED); every chunk of
    every tensor has a storage record and the chunks tile the tensor (COVERAGE, OUT_OF_BOUNDS); each
    record is at least as long as its chunk's raw bytes (SIZE_MISMATCH); every bytes item has a record;
    `.distcp` files no record references are reported as warnings (UNEXPECTED_FILE: stale leftovers of
    an in-place overwrite).

    Args:
        url: the DCP folder.
        path_prefix: prepended to the file names in problem paths (the native layout passes `"dcp/"`).
    """
    try:
        entries = io.list_dir(url)
    except CheckpointNotFound:
        return [Problem(ProblemKind.MISSING_FILE, path_prefix or ".", f"the DCP folder {url} is missing")]
    by_name = {e.name: e for e in entries if not e.is_dir}
    meta_path = path_prefix + METADATA_NAME
    meta_entry = by_name.get(METADATA_NAME)
    per_rank = rank_metadata(entries) if meta_entry is None else []
    if per_rank:
        return _verify_rank_metadata(url, entries, per_rank, path_prefix)
    if meta_entry is None:
        pending = _TMP_METADATA in by_name or any(DISTCP_RE.match(n) for n in by_name)
        message = (
            f"no {METADATA_NAME}: the save has not finished (or was interrupted)"
            if pending
            else f"no {METADATA_NAME} and no data files: not a DCP checkpoint"
        )
        return [Problem(ProblemKind.IN_PROGRESS if pending else ProblemKind.MISSING_FILE, meta_path, message)]
    try:
        metadata = load_dcp_metadata(url, meta_entry)
    except CorruptCheckpoint as exc:
        return [Problem.of_unreadable(exc, meta_path, ProblemKind.BAD_METADATA)]
    return verify_dcp_metadata(url, metadata, by_name, path_prefix)


def _verify_rank_metadata(
    url: str, entries: Sequence[DirEntry], per_rank: Sequence[DirEntry], path_prefix: str
) -> list[Problem]:
    """`verify_dcp` of a save without collectives: a `__{rank}.metadata` for every rank that wrote data
    (each rank writes its own after its data), then the rules of `.metadata` on their merge."""
    by_name = {e.name: e for e in entries if not e.is_dir}
    written = {int(m.group(1)) for name in by_name if (m := DISTCP_RE.match(name))}
    described = {int(m.group(1)) for e in per_rank if (m := RANK_METADATA.match(e.name))}
    problems = [
        Problem(
            ProblemKind.IN_PROGRESS,
            f"{path_prefix}__{rank}{METADATA_NAME}",
            f"rank {rank} wrote data but no __{rank}{METADATA_NAME}: its save has not finished (or was interrupted)",
        )
        for rank in sorted(written - described)[:LISTED_ABSENT]
    ]
    problems += [
        Problem(
            ProblemKind.IN_PROGRESS,
            path_prefix + name,
            f"{name} exists: rank {name[2:].partition('.')[0]}'s save is under way or was interrupted",
        )
        for name in sorted(by_name)
        if name.endswith(f"{METADATA_NAME}.tmp") and RANK_METADATA.match(name.removesuffix(".tmp"))
    ]
    parts = []
    for entry in per_rank:
        path = path_prefix + entry.name
        try:
            parts.append((entry.name, parse_cached(io.join(url, entry.name), entry)))
        except CorruptCheckpoint as exc:
            problems.append(Problem.of_unreadable(exc, path, ProblemKind.BAD_METADATA))
    if len(parts) < len(per_rank):
        return problems
    try:
        metadata = merge_rank_metadata(parts)
    except CorruptCheckpoint as exc:
        return [*problems, Problem(ProblemKind.BAD_METADATA, path_prefix + per_rank[0].name, exc.message)]
    return problems + verify_dcp_metadata(url, metadata, by_name, path_prefix)


def verify_dcp_metadata(
    url: str, metadata: DcpMetadata, by_name: dict[str, DirEntry], path_prefix: str
) -> list[Problem]:
    """The rules `verify_dcp` checks on parsed metadata (`by_name`: the folder's files by name): storage files,
    coverage, bytes items, stale files. Also for a library that writes DCP's metadata classes under its own."""
    problems: list[Problem] = []
    if _TMP_METADATA in by_name:
        problems.append(
            Problem(
                ProblemKind.IN_PROGRESS,
                path_prefix + _TMP_METADATA,
                f"{_TMP_METADATA} exists: a save into this folder is under way or was interrupted, so the data "
                f"files may not match {METADATA_NAME}",
            )
        )
    referenced = metadata.referenced_files()
    storage_problems = _storage_problems(url, referenced, by_name, path_prefix)
    problems += storage_problems
    problems += _coverage_problems(metadata, path_prefix)
    damaged = {p.path for p in storage_problems}
    problems += _bytes_item_problems(url, metadata, lambda name: path_prefix + name not in damaged, path_prefix)
    for name, entry in by_name.items():
        if DISTCP_RE.match(name) and name not in referenced and entry.size > 0:
            problems.append(
                Problem(
                    ProblemKind.UNEXPECTED_FILE,
                    path_prefix + name,
                    f"{entry.size} bytes that {METADATA_NAME} does not reference (stale data of an earlier save?)",
                    severity="warning",
                )
            )
    return problems


def _storage_problems(url: str, referenced: dict[str, int], by_name: dict[str, DirEntry], prefix: str) -> list[Problem]:
    problems = []
    # Each message names the metadata file too (with its folder): a name or an offset in it may be what is
    # damaged (a flipped byte in a pickled file name), not the data file it points at.
    metadata = prefix + METADATA_NAME
    for name, end in sorted(referenced.items()):
        entry = by_name.get(name)
        if entry is not None:
            size = entry.size
        elif "/" in name and io.exists(io.join(url, name)):  # a custom writer's sub-folder
            size = io.file_size(io.join(url, name))
        else:
            problems.append(Problem(ProblemKind.MISSING_FILE, prefix + name, f"referenced by {metadata} but missing"))
            continue
        if end > size:
            problems.append(
                Problem(
                    ProblemKind.TRUNCATED,
                    prefix + name,
                    f"{metadata} places data up to byte {end} but the file has {size} bytes",
                )
            )
    return problems


#: Bytes items of one data file are written together (before its tensors); read them in one request when
#: they span at most this much.
_BYTES_SPAN_READ = 64 << 20
#: A bytes item larger than this is no optimizer hyperparameter; it is not read.
_MAX_BYTES_ITEM = 16 << 20


#: Counter items read at most (each one small read), and the most bytes one may claim.
_MAX_COUNTER_ITEMS = 32
_MAX_COUNTER_BYTES = 1 << 16


def bytes_counters(url: str, metadata: DcpMetadata) -> dict[str, int | float]:
    """The loop counters a DCP save holds as non-tensor items (`epochs_run`, `step`, `steps_run`, `global_step`,
    ..., `contract.training_state.COUNTER_KEYS`) at its top level or under a trainer-state namespace
    (`trainer_state.step`), read through the allowlisting reader; an item that cannot be read is left out
    (verify reports it)."""
    found: dict[str, int | float] = {}
    wanted = [key for key in metadata.bytes_keys if _counter_name(key) is not None][:_MAX_COUNTER_ITEMS]
    for key in wanted:
        record = metadata.storage.get((key, None))
        if record is None or record.transforms or record.length > _MAX_COUNTER_BYTES:
            continue
        try:
            blob = io.read_bytes(io.join(url, record.relative_path), record.offset, record.length)
            value = read_object_archive(blob, f"{record.relative_path}: item {key!r}")
        except CkptctlError:
            continue
        if type(value) in (int, float):
            found[key] = value
    return found


def _counter_name(key: str) -> str | None:
    head, _, name = key.rpartition(".")
    if name not in COUNTER_KEYS or head.count(".") > 0:
        return None
    return name if not head or component_for_prefix(head) in (None, Component.TRAINER_STATE) else None


def _bytes_item_problems(
    url: str, metadata: DcpMetadata, readable: Callable[[str], bool], prefix: str
) -> list[Problem]:
    """Read every non-tensor ("bytes") item through the allowlisting reader.

    torch DCP unpickles these items with `torch.load(weights_only=False)` when it loads the checkpoint, so
    a crafted one runs code in the trainer that resumes from it: verify must refuse what restore would
    refuse. They are small (learning rates, betas, parameter names); `readable` says which data files
    are whole enough to read (missing and truncated ones are already reported).
    """
    by_file: dict[str, list[tuple[str, int, int]]] = {}
    problems: list[Problem] = []
    for key in metadata.bytes_keys:
        record = metadata.storage.get((key, None))
        if record is None or not readable(record.relative_path):
            continue
        if record.transforms:
            problems.append(
                Problem(
                    ProblemKind.UNREADABLE,
                    prefix + record.relative_path,
                    f"item {key!r} is stored with transforms {list(record.transforms)}, which ckptctl cannot check",
                    severity="warning",
                )
            )
        elif record.length > _MAX_BYTES_ITEM:
            problems.append(
                Problem(
                    ProblemKind.BAD_METADATA,
                    prefix + record.relative_path,
                    f"non-tensor item {key!r} claims {record.length} bytes, more than any such value holds",
                )
            )
        else:
            by_file.setdefault(record.relative_path, []).append((key, record.offset, record.length))
    for name, items in sorted(by_file.items()):
        path = io.join(url, name)
        lo = min(offset for _, offset, _ in items)
        hi = max(offset + length for _, offset, length in items)
        span = io.read_bytes(path, lo, hi - lo) if hi - lo <= _BYTES_SPAN_READ else None
        for key, offset, length in items:
            blob = span[offset - lo : offset - lo + length] if span is not None else io.read_bytes(path, offset, length)
            try:
                read_object_archive(blob, f"{prefix}{name}: item {key!r}")
            except CorruptCheckpoint as exc:
                problems.append(Problem.of_unreadable(exc, prefix + name, ProblemKind.UNREADABLE))
    return problems


def _coverage_problems(metadata: DcpMetadata, prefix: str) -> list[Problem]:
    problems = []
    storage = metadata.storage
    for key, item in metadata.entries.items():
        if not isinstance(item, DcpTensor):
            if (key, None) not in storage:
                problems.append(Problem(ProblemKind.COVERAGE, key, "non-tensor value without a storage record"))
            continue
        problems += _tensor_problems(key, item, metadata, prefix)
    return problems


def _tensor_problems(key: str, tensor: DcpTensor, metadata: DcpMetadata, prefix: str) -> list[Problem]:
    problems = []
    itemsize = dtype_itemsize(tensor.dtype)
    for chunk in tensor.chunks:
        record = metadata.storage.get((key, chunk.offsets))
        if record is None:
            problems.append(Problem(ProblemKind.COVERAGE, key, f"chunk at {list(chunk.offsets)} has no storage record"))
        elif not record.transforms and record.length < chunk.numel * itemsize:
            # A torch.save archive holds the raw elements plus its zip directory; never fewer bytes.
            problems.append(
                Problem(
                    ProblemKind.SIZE_MISMATCH,
                    key,
                    f"chunk at {list(chunk.offsets)} is stored in {record.length} bytes of "
                    f"{prefix}{record.relative_path} but {tensor.dtype}{list(chunk.sizes)} needs "
                    f"{chunk.numel * itemsize}",
                )
            )
    problem = tiling_problem(tensor.size, [(c.offsets, c.sizes) for c in tensor.chunks])
    if problem is not None:
        kind = ProblemKind.OUT_OF_BOUNDS if "outside" in problem else ProblemKind.COVERAGE
        problems.append(Problem(kind, key, problem))
    return problems


# --------------------------------------------------------------------------------------------------
# The layout.
# --------------------------------------------------------------------------------------------------


#: Timestamps closer than this (seconds) are taken as equal: clocks and the mtime granularity of shared file
#: systems and object stores (whole seconds). One value for every rule that compares a DCP folder's times.
MTIME_SLACK_S = 1.0


def data_newer_than_metadata(entries: Sequence[DirEntry]) -> list[str]:
    """The `.distcp` files of a DCP folder's listing modified after its `.metadata`, beyond the slack.

    torch writes `.metadata` last, so data newer than it means the folder was overwritten in place by a
    save that did not finish: the OLD metadata describes (partly) NEW data, which structural verify cannot
    tell. AReaL's recover slot and every DCP folder a resume would load are checked with this one rule.
    """
    meta = next((e for e in entries if e.name == METADATA_NAME and not e.is_dir), None)
    if meta is None or not meta.mtime:
        return []
    return sorted(
        e.name
        for e in entries
        if not e.is_dir and DISTCP_RE.match(e.name) and e.mtime and e.mtime > meta.mtime + MTIME_SLACK_S
    )


#: The class a torch DCP `.metadata` pickles first (its top-level object).
_DCP_METADATA_CLASS = ("torch.distributed.checkpoint.metadata", "Metadata")
#: Enough of a `.metadata` to hold its first global (a protocol-4 frame header, then module and class names).
_METADATA_HEAD = 512
_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"})


def _foreign_metadata(module: str, name: str) -> bool:
    """Whether a pickled class is another checkpointing library's metadata (`bytecheckpoint.checkpointer.
    meta_type.Metadata`), as opposed to anything else a `.metadata` may hold (a damaged or hostile pickle,
    which verify reports as such)."""
    return name.endswith("Metadata") and module.partition(".")[0] not in ("torch", "builtins", "__builtin__")


@lru_cache(maxsize=4096)
def pickled_class(url: str, size: int, mtime: float) -> tuple[str, str] | None:
    """The (module, class) a `.metadata` pickles first, from its first bytes (None: not a pickle, or unreadable).

    `list` tells a torch DCP folder from another library's folder of `.distcp` files (ByteCheckpoint pickles a
    class of its own) and from a `.metadata` that cannot be read, without parsing the whole file; cached by
    size and time, as the walk may ask twice.
    """
    try:
        head = io.read_bytes(url, 0, min(size, _METADATA_HEAD))
    except CkptctlError:
        return None
    strings: list[str] = []
    try:
        for op, arg, _ in pickletools.genops(BytesIO(head)):
            if op.name in _STRING_OPS and isinstance(arg, str):
                strings.append(arg)
            elif op.name == "STACK_GLOBAL":
                return (strings[-2], strings[-1]) if len(strings) >= 2 else None
            elif op.name == "GLOBAL" and isinstance(arg, str):
                module, _, name = arg.partition(" ")
                return module, name
    except (ValueError, EOFError, struct.error):  # a truncated head, or no pickle at all
        return None
    return None


class DcpFolderLayout(Layout):
    """The reader of a torch DCP checkpoint folder written by `torch.distributed.checkpoint.save`
    (FileSystemWriter): the DCP plugin's layout and torchtitan's (a DCP folder with torchtitan's keys)
    subclass it with their own resume profiles.

    FileSystemWriter writes files only: a child folder is not part of the checkpoint (`Layout.members`'
    default), and the walker looks inside it (an HF export kept in `step-N/hf/`).
    """

    name = "dcp"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A DCP ref when the folder holds `.metadata` (or per-rank `__R.metadata`) or `__R_N.distcp` files.

        Judged from the listing, and on local disks from the first bytes of `.metadata` too: one that pickles
        another library's metadata class (ByteCheckpoint's) makes no DCP folder (the generic reader lists it
        `unknown`), and one that is no pickle of DCP metadata is `broken`. On object stores that read would
        cost a request per folder, so a folder there is judged from the listing alone (verify reads it).
        """
        ref = self._listed(url, entries)
        if ref is None or ref.state is not CheckpointState.COMPLETE or not io.is_local(url):
            return ref
        meta = next((e for e in entries if e.name == METADATA_NAME and not e.is_dir), None)
        if meta is None:  # saved without collectives: per-rank `__R.metadata` files, judged from the listing
            return ref
        found = pickled_class(io.join(url, METADATA_NAME), meta.size, meta.mtime)
        if found == _DCP_METADATA_CLASS:
            return ref
        if found is not None and _foreign_metadata(*found):
            return None
        return replace(ref, state=CheckpointState.BROKEN, note=f"{METADATA_NAME} is not a pickle of DCP metadata")

    def _listed(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """`identify` from the listing alone (`open` reads the whole `.metadata` anyway)."""
        meta = tmp = None
        has_data = False
        size = 0
        for entry in entries:
            if entry.is_dir:
                continue
            size += entry.size
            if entry.name == METADATA_NAME:
                meta = entry
            elif entry.name == _TMP_METADATA:
                tmp = entry
            elif not has_data and DISTCP_RE.match(entry.name):
                has_data = True
        per_rank = rank_metadata(entries) if meta is None else []
        if meta is None and tmp is None and not has_data and not per_rank:
            return None
        note = ""
        if per_rank and tmp is None:
            state, note = _rank_metadata_state(entries, per_rank)
            meta = max(per_rank, key=lambda e: e.mtime or 0)
        elif meta is None:
            state = CheckpointState.IN_PROGRESS
            note = f"no {METADATA_NAME} yet"
        elif tmp is not None:
            # An in-place overwrite keeps the old .metadata until its very end: it proves nothing now.
            state = CheckpointState.IN_PROGRESS
            note = f"{_TMP_METADATA} present: being overwritten"
        else:
            state = CheckpointState.COMPLETE
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=step_from_name(io.name_of(url)),
            epoch=epoch_from_name(io.name_of(url)),
            created=timestamp(meta.mtime if meta is not None else newest_mtime(entries)),
            state=state,
            size_bytes=size,
            note=note,
        )

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """DCP has no `latest` pointer of its own."""
        return None

    def open(self, url: str) -> Checkpoint:
        """Open the folder: components and world size from `.metadata` (read once), a lazy tensor index.

        A folder without a readable `.metadata` still opens (so that `verify` can report why); its
        tensor index then raises the reason (CheckpointInProgress, UnsafePickle or CorruptCheckpoint).
        """
        entries = io.list_dir(url)
        ref = self._listed(url, entries)
        if ref is None:
            raise UnknownLayout(f"{url} is not a DCP checkpoint (no {METADATA_NAME} and no .distcp files)")
        files = {e.name: e.size for e in entries if not e.is_dir}
        meta_entry = next((e for e in entries if e.name == METADATA_NAME and not e.is_dir), None)
        per_rank = rank_metadata(entries) if meta_entry is None else []
        try:
            if meta_entry is None and not per_rank:
                raise in_progress_error(url)
            metadata = load_dcp_metadata(url, meta_entry)
        except (CheckpointInProgress, CorruptCheckpoint) as exc:
            if not isinstance(exc, CheckpointInProgress) and ref.state == CheckpointState.COMPLETE:
                ref = replace(ref, state=CheckpointState.BROKEN, note=exc.message)
            return Checkpoint(
                ref=ref,
                components=frozenset(),
                world_size=world_size_of(entries),
                metadata={"error": exc.message},
                tensor_index=raising_index(exc),
                files=files,
            )
        classify = component_classifier(metadata.entries)
        components = classify.components | (model_components(set(files)) & _BESIDE)
        bytes_keys = metadata.bytes_keys
        referenced = metadata.referenced_files()
        info: dict[str, object] = {
            "format": "torch.distributed.checkpoint",
            "dcp_version": metadata.version,
            "keys": len(metadata.entries),
            "tensors": len(metadata.entries) - len(bytes_keys),
            "bytes_items": len(bytes_keys),
            "storage_files": len(referenced),
            "save_id": metadata.save_id,
        }
        if per_rank:
            info["save_id"] = None  # each rank draws its own
            info[RANK_METADATA_KEY] = len(per_rank)

        counters = bytes_counters(url, metadata)
        if counters:
            # The loop's counters saved beside the model (`{"model", "optim", "epochs_run"}`): its trainer state.
            components |= {Component.TRAINER_STATE}
            info.update({f"counter {key}": value for key, value in counters.items()})
            facts = TrainingState(counters=counters)
            ref = replace(
                ref,
                step=ref.step if ref.step is not None else facts.step,
                epoch=ref.epoch if ref.epoch is not None else facts.epoch,
            )

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            return index_from_metadata(metadata, classify)

        return Checkpoint(
            ref=ref,
            components=components,
            world_size=world_size_of(entries, referenced),
            metadata=info,
            tensor_index=tensor_index,
            files=files,
            progress=counters,
        )

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """Structural verification (see `verify_dcp`); reads `.metadata` and the listing only."""
        return verify_dcp(checkpoint.url)

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """`.metadata`, which `dcp.save` writes after every rank's data (without it the folder is in progress);
        for a save without collectives, every rank's `__{rank}.metadata`, written after that rank's data."""
        if METADATA_NAME in files:
            return (METADATA_NAME,)
        ranks = sorted((int(m.group(1)), name) for name in files if (m := RANK_METADATA.match(name)))
        return tuple(name for _, name in ranks)
