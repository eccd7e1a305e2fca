"""The capabilities `reshard` fills and reads (DESIGN §4 `reshard`): a `TrainingStateWriter` writes one framework's
resumable state for a world size; a `TrainingStateSource` gives another framework's state parameter by parameter
(`ParamState`), which such a writer reads. `contract.capabilities` types their slots."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ckptctl.checkpoint import Checkpoint, SizedTensor

if TYPE_CHECKING:
    from ckptctl.formats.manifest import FileRecord
    from ckptctl.formats.torch_save_writer import RawTensor


@dataclass(frozen=True, slots=True)
class NotCarried:
    """A part of a training state that `reshard` could not carry to the target, and why (DESIGN §4
    `not_carried`): a data-loader position, an RNG stream, a scheduler whose state depends on the world size.

    Attributes:
        what: the part, as the source names it (`extra_state.rng`, `data.pt`, `lr_scheduler`).
        why: one sentence a person acts on (what the target gets instead, what to pass to the framework).
    """

    what: str
    why: str


@dataclass(frozen=True, slots=True)
class ReshardRequest:
    """One `reshard` job, as `ops.reshard` hands it to a `TrainingStateWriter`.

    Attributes:
        source: the opened source checkpoint (any layout the writer `accepts`).
        staging: an empty local folder the writer fills with exactly what the target framework is pointed at
            (DESIGN §4 `reshard`: a DeepSpeed save folder, a verl run folder, a DCP folder); `ops.reshard`
            commits it to DST afterwards with the commit protocol, so the writer never renames or deletes.
        world_size: the number of ranks the target loads on; None keeps the source's where that means something.
        workers: processes/threads the writer may use for reading and writing.
    """

    source: Checkpoint
    staging: str
    world_size: int | None
    workers: int = 1


@dataclass(frozen=True, slots=True)
class WrittenState:
    """What a `TrainingStateWriter` wrote (`ReshardResult` in `ops.reshard` adds the paths).

    Attributes:
        tensors: tensors written (each shard of one tensor counted once per tensor).
        bytes: tensor bytes written.
        files: the files written, relative to the staging folder, in the order a commit may publish them
            (markers, trackers and pointers last).
        world_size: the world size the written state loads on (None: any).
        not_carried: what the target did not get, and why.
        resume_hint: the setting to pass to the target framework to resume from DST, or None.
        digests: size and blake3 of the files the writer hashed while writing them (by the same relative
            path): the commit's digests file takes them as they are, and hashes only the others.
    """

    tensors: int
    bytes: int
    files: tuple[str, ...]
    world_size: int | None
    not_carried: tuple[NotCarried, ...] = ()
    resume_hint: str | None = None
    digests: Mapping[str, FileRecord] = field(default_factory=dict)


class TrainingStateWriter(Protocol):
    """`reshard`: writes this framework's resumable training state (model, optimizer, schedulers, counters,
    RNG where it carries) for a world size, streamed from a checkpoint's raw bytes, in the shape the
    framework's own load code takes (DESIGN §4 `reshard`).

    Attributes:
        target: the name `reshard --to` takes for this writer (`deepspeed-universal`, `dcp`, `verl`); when
            `--to` is left out, the writer of the source's own framework is used.
    """

    target: str

    def refusal(self, source: Checkpoint, world_size: int | None) -> str | None:
        """Why this writer cannot write `source` for `world_size` (a layout it does not read, a torn source
        naming the missing file, a tensor the target sharding cannot cut), or None when it can. Called before
        anything is written; reads metadata only."""
        ...

    def write(self, request: ReshardRequest, advance: Callable[[int], None]) -> WrittenState:
        """Writes the state into `request.staging`, one parameter at a time, calling `advance(n)` after each
        `n` bytes written. Raises `CkptctlError` on a source it finds torn while reading."""
        ...


@dataclass(frozen=True, slots=True)
class StateTensor(SizedTensor):
    """One full tensor of a training state, read when asked (`ParamState`).

    Attributes:
        dtype: torch-style dtype name of what `read` returns.
        shape: its full (unsharded) shape.
        read: returns the full tensor (a CPU torch tensor), assembled from the checkpoint's bytes.
        raw: where its row-major bytes are, found when asked (`torch_save_writer.RawTensor`: byte ranges of the
            checkpoint's files, or bytes), for a writer that copies them without importing torch; None, or a
            call that returns None: the tensor must be read (its chunks are not stored raw and in order).
    """

    dtype: str
    shape: tuple[int, ...]
    read: Callable[[], Any] = field(repr=False, compare=False)
    raw: Callable[[], RawTensor | None] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class ParamState:
    """A framework's resumable training state, as a writer of another framework's state reads it
    (`TrainingStateSource`), no tensor read until asked.

    Attributes:
        model: the model's state dict in its order (parameters and persistent buffers), named as the model's
            own `state_dict()` names them (the framework's namespace and wrappers removed); a parameter is
            the full-precision master where the framework keeps one, else the model weight.
        optimizer: parameter name -> that parameter's optimizer state as torch's optimizer holds it
            (`exp_avg`, `exp_avg_sq`, `step` for Adam/AdamW): a tensor, or a plain number.
        param_groups: the optimizer's parameter groups in order: their hyperparameters as saved, `params` the
            names of their parameters (as `get_optimizer_state_dict` gives them).
        not_carried: what of the source this state leaves out (RNG, data-loader position, scheduler), and why.
        tied: (name, parameter) for each tensor of `model` that is another of its parameters, as the source
            knows it (tied weights: `lm_head.weight` is `model.embed_tokens.weight`; the optimizer holds the
            parameter once, under the name `named_parameters()` gives it). Empty where the source records none.
    """

    model: tuple[tuple[str, StateTensor], ...]
    optimizer: Mapping[str, Mapping[str, StateTensor | int | float]]
    param_groups: tuple[Mapping[str, Any], ...]
    not_carried: tuple[NotCarried, ...] = ()
    tied: tuple[tuple[str, str], ...] = ()


class TrainingStateSource(Protocol):
    """A framework's training state, parameter by parameter, for a writer of another framework's state
    (`reshard --to dcp`, `reshard --to deepspeed-universal`)."""

    def __call__(self, checkpoint: Checkpoint) -> ParamState:
        """The state of `checkpoint` (a checkpoint of this framework's layout). Reads metadata only.

        Raises:
            CkptctlError: the checkpoint holds no state this source can name parameter by parameter (with why:
                an optimizer keyed by index that no record maps to names), or it is torn (naming the file).
        """
        ...
