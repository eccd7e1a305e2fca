"""The data model every layout produces and every command consumes (DESIGN §2).

Nothing here reads files: layouts build these objects from directory listings, headers and metadata.
Tensor data is never held here; a `TensorEntry` only says where its bytes are.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from ckptctl.errors import CkptctlError, UnsafePickle, UnsupportedClass


class CheckpointState(enum.StrEnum):
    """Whether a checkpoint can be trusted as a whole, judged from cheap evidence (listing, markers).

    - `complete`: committed and whole.
    - `in_progress`: being written (no completion marker yet), as far as anyone can tell.
    - `broken`: damaged or incomplete for good.
    - `abandoned`: what a save left when its writer stopped (killed, crashed): never to be completed, and
      deleted by the next save of the run or by `prune`.
    - `superseded`: committed and whole, but off the run's branch: the run went back to an older step and
      saved again, so a resume no longer picks it.
    - `unknown`: checkpoint-like files (torch.save zips, safetensors, DCP data) of a layout ckptctl does not
      know (`layouts.generic`): never "nothing here", never a fresh start, never deleted by `prune`.
    - `slim`: committed and whole as a model: `ckptctl slim` dropped its training-only state (optimizer,
      scheduler, RNG; `formats.slim_marker`), so it converts as before and a resume never picks it.
    """

    COMPLETE = "complete"
    IN_PROGRESS = "in_progress"
    BROKEN = "broken"
    ABANDONED = "abandoned"
    SUPERSEDED = "superseded"
    UNKNOWN = "unknown"
    SLIM = "slim"


class Component(enum.StrEnum):
    """What a part of a checkpoint is for; the same names across every layout."""

    MODEL = "model"
    OPTIMIZER = "optimizer"
    SCHEDULER = "scheduler"
    RNG = "rng"
    DATALOADER = "dataloader"
    TRAINER_STATE = "trainer_state"
    CONFIG = "config"
    TOKENIZER = "tokenizer"
    EXTRA = "extra"


#: The components a resumable training checkpoint is expected to hold; `inspect` reports the absent ones.
EXPECTED_COMPONENTS: tuple[Component, ...] = (
    Component.MODEL,
    Component.OPTIMIZER,
    Component.SCHEDULER,
    Component.RNG,
    Component.DATALOADER,
    Component.TRAINER_STATE,
    Component.CONFIG,
    Component.TOKENIZER,
)


class ChunkEncoding(enum.StrEnum):
    """How a chunk's bytes are stored inside its file."""

    #: Raw little-endian element bytes, row-major (safetensors).
    RAW = "raw"
    #: A whole `torch.save` zip archive holding one tensor (torch DCP items).
    TORCH_SAVE = "torch_save"


@dataclass(frozen=True, slots=True)
class TensorChunk:
    """One stored piece of a tensor.

    Attributes:
        file: path of the data file relative to the checkpoint folder.
        byte_offset: where the chunk's record starts in that file.
        byte_length: length of the record (for TORCH_SAVE, the whole zip archive).
        offsets: the chunk's position inside the full tensor, one entry per dimension.
        sizes: the chunk's shape.
        encoding: how the record is stored.
    """

    file: str
    byte_offset: int
    byte_length: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    encoding: ChunkEncoding = ChunkEncoding.RAW

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


class SizedTensor:
    """`numel` and `nbytes` of a tensor described by a `dtype` name and a `shape` (a base of the frozen
    dataclasses that describe one: `TensorEntry`, `capabilities.StateTensor`)."""

    __slots__ = ()
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class TensorEntry(SizedTensor):
    """A logical (full, unsharded) tensor of a checkpoint and where its chunks live.

    Attributes:
        name: the flattened key as the checkpoint stores it (e.g. `model.layers.0.weight`).
        component: what the tensor belongs to (model weights, optimizer state, ...).
        dtype: torch-style dtype name (`float32`, `bfloat16`, ...).
        shape: the full shape.
        chunks: where the bytes are; together they tile the full tensor.
    """

    name: str
    component: Component
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[TensorChunk, ...]


@dataclass(frozen=True, slots=True)
class CheckpointRef:
    """What `list` knows about a checkpoint from cheap evidence (names, sizes, markers).

    Attributes:
        url: local path or fsspec URL of the checkpoint folder.
        layout: name of the layout that recognised it.
        step: global step, or None when nothing says.
        epoch: epoch, or None when nothing says.
        created: modification time of the newest marker or file, or None.
        state: complete, in progress or broken.
        size_bytes: sum of the sizes of the files inside.
        latest: whether the run's own `latest`-style pointer names it.
        note: why the state is what it is, when that is not obvious.
        holds: the child folders that hold checkpoints of their own, as the run scan found them (an HF
            Trainer `output_dir` holding the final model and `checkpoint-N/`): they are not part of this
            checkpoint, and deleting it leaves them alone. Empty outside a scan.
        run_state: a run-level state file beside it that a resume loads with it (torchtune's `recipe_state.pt`
            beside `epoch_N/` model folders; `layouts.run_state`), or "". Set on the newest model folder by the
            run scan.
        roles: the models of an RL run the checkpoint holds, each in a folder of its own (verl's `actor` and
            `critic`), as its framework names them; empty for a checkpoint of one model.
    """

    url: str
    layout: str
    step: int | None
    epoch: float | None
    created: datetime | None
    state: CheckpointState
    size_bytes: int
    latest: bool = False
    note: str = ""
    holds: tuple[str, ...] = ()
    run_state: str = ""
    roles: tuple[str, ...] = ()


class Role(enum.StrEnum):
    """What a checkpoint is for, as far as a resume is concerned."""

    #: Training state a run resumes from.
    TRAINING = "training"
    #: Model weights a run exported beside its training state (an HF export, a snapshot): nothing to resume.
    EXPORT = "export"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint opened by its layout: components, parallelism facts and a tensor index.

    Commands decide from the typed fields; `metadata` is for people (`inspect` shows it, `diff`
    compares it).

    Attributes:
        ref: the listing facts.
        components: components present.
        world_size: ranks that wrote it, or None when not recorded.
        metadata: framework facts worth showing (config summary, counters, metrics, versions).
        tensor_index: returns the tensor index; layouts pass a cached function that reads headers on
            first use, so that opening a checkpoint stays cheap when nobody asks for tensors.
        files: data and metadata files of the checkpoint, relative path -> size in bytes.
        metrics: what the training recorded with the checkpoint to judge it by (losses, evaluation
            scores; nested mappings allowed), which `prune --keep-best` ranks checkpoints by.
        role: training state, or model weights exported beside it.
        progress: the counters a resume continues from beyond step and epoch (consumed samples,
            optimizer steps, ...), as the framework names them; `resume-plan` shows the scalar ones.
        rng_keys: the top-level keys of its RNG state when the layout read them at open (None: no RNG
            state, or not read; a layout's resume profile may read them on demand).
    """

    ref: CheckpointRef
    components: frozenset[Component]
    world_size: int | None
    metadata: Mapping[str, Any]
    tensor_index: Callable[[], tuple[TensorEntry, ...]] = field(repr=False)
    files: Mapping[str, int] = field(default_factory=dict)
    metrics: Mapping[str, Any] = field(default_factory=dict)
    role: Role = Role.TRAINING
    progress: Mapping[str, Any] = field(default_factory=dict)
    rng_keys: frozenset[str] | None = None

    @property
    def url(self) -> str:
        return self.ref.url

    @property
    def layout(self) -> str:
        return self.ref.layout

    @property
    def missing_components(self) -> tuple[Component, ...]:
        return tuple(c for c in EXPECTED_COMPONENTS if c not in self.components)

    def tensors(self, component: Component | None = None) -> Iterator[TensorEntry]:
        """The tensor index, optionally only one component's tensors."""
        for entry in self.tensor_index():
            if component is None or entry.component == component:
                yield entry

    @classmethod
    def unreadable(
        cls, ref: CheckpointRef, error: CkptctlError, files: Mapping[str, int], facts: Mapping[str, Any] | None = None
    ) -> Checkpoint:
        """A checkpoint whose own metadata did not read at open (`error` says why), opened all the same so that
        `verify` can report it: broken, nothing known of its content, a tensor index that raises `error` again.

        Args:
            facts: what is known without it, shown before the error in `metadata`.
        """
        return cls(
            ref=replace(ref, state=CheckpointState.BROKEN, note=error.message),
            components=frozenset(),
            world_size=None,
            metadata={**(facts or {}), "error": error.message},
            tensor_index=raising_index(error),
            files=files,
        )


def raising_index(error: CkptctlError) -> Callable[[], tuple[TensorEntry, ...]]:
    """The tensor index of a checkpoint whose metadata did not read at open: asking for it raises why."""

    def index() -> tuple[TensorEntry, ...]:
        raise error

    return index


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a checkpoint, as `verify` reports it.

    Attributes:
        kind: a stable machine-readable category (see `ProblemKind`).
        path: the file or tensor concerned, relative to the checkpoint, or "" for the whole.
        message: what is wrong, for a person.
        severity: `error` makes verify fail; `warning` is reported but the checkpoint still verifies
            (stale files left by an in-place overwrite, for example).
        record: the record inside the file, when the problem is one record of a zip archive
            (`archive/data/0`).
        entry: the state-dict entry concerned inside the file (a tensor's dotted path, a DCP key), when
            known.
    """

    kind: str
    path: str
    message: str
    severity: str = "error"
    record: str = ""
    entry: str = ""

    @classmethod
    def of_unreadable(cls, exc: CkptctlError, path: str, otherwise: str) -> Problem:
        """The problem of a file whose pickle or metadata did not read: a forgery's global (`unsafe_pickle`), a
        class ckptctl was not taught (`unsupported_class`), else `otherwise`."""
        if isinstance(exc, UnsafePickle):
            return cls(ProblemKind.UNSAFE_PICKLE, path, exc.message)
        if isinstance(exc, UnsupportedClass):
            return cls(ProblemKind.UNSUPPORTED_CLASS, path, exc.message)
        return cls(otherwise, path, exc.message)

    @classmethod
    def from_error(cls, exc: CkptctlError, path: str) -> Problem:
        """The problem a file that failed to read has: a refused pickle, a truncated file, or bad metadata."""
        return cls.of_unreadable(
            exc, path, ProblemKind.TRUNCATED if "truncated" in str(exc) else ProblemKind.BAD_METADATA
        )


class ProblemKind(enum.StrEnum):
    """Stable `kind` values of `Problem` (scripts match on them; `docs/cli.md` lists them)."""

    MISSING_FILE = "missing_file"
    TRUNCATED = "truncated"
    SIZE_MISMATCH = "size_mismatch"
    DIGEST_MISMATCH = "digest_mismatch"
    #: A record of a torch.save zip archive does not match the CRC-32 torch recorded when writing it.
    CRC_MISMATCH = "crc_mismatch"
    #: A torch.save archive records no CRC-32s (written with torch's CRC computation off): only a manifest
    #: can vouch for its content (a warning).
    NO_CRC = "no_crc"
    BAD_METADATA = "bad_metadata"
    UNSAFE_PICKLE = "unsafe_pickle"
    COVERAGE = "coverage"
    OUT_OF_BOUNDS = "out_of_bounds"
    UNREADABLE = "unreadable"
    NOT_FINITE = "not_finite"
    IN_PROGRESS = "in_progress"
    ABANDONED = "abandoned"
    UNEXPECTED_FILE = "unexpected_file"
    #: Checkpoint-like files of a layout ckptctl does not know: whether they make a whole checkpoint cannot be
    #: told (verify exits 2).
    UNKNOWN_LAYOUT = "unknown_layout"
    #: A pickled object of a class ckptctl was not taught (a known library's), read as an opaque value (a warning).
    UNSUPPORTED_CLASS = "unsupported_class"
    #: `verify --latest`: what the framework's own latest-finder picks (the Trainer's highest `checkpoint-N`, what a
    #: `latest` pointer names) does not load; the message names the checkpoint to resume from instead.
    LATEST_NOT_LOADABLE = "latest_not_loadable"


_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}


def known_dtypes() -> frozenset[str]:
    """Every torch-style dtype name the data model understands."""
    return frozenset(_ITEMSIZE)


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a torch-style dtype name.

    Raises:
        KeyError: for a dtype name the data model does not know; parsers validate before building entries.
    """
    return _ITEMSIZE[dtype]
