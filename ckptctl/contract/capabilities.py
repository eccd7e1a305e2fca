"""What a framework plugin provides besides its reader (DESIGN §1): small capability objects.

A framework package's reader is its `Layout` subclass (detect, open, index, verify, markers, pointers,
protections, resume profile). Anything else it can do is a capability, provided only where the framework
has it and declared in its registry entry (`ckptctl.layouts.Plugin`) as a dotted name that is imported on
first use, as Pillow registers an image plugin's opener and saver apart and fsspec names its
implementations. `ops/` asks `capability(layout, SLOT)` and never names a framework:

- `CONVERT_SOURCE` (`ConvertSource`): the model `convert` (and `diff`) read from a framework's checkpoints
  beyond their tensor index: master weights, name maps, the model spec, config;
- `SLIMMER` (`Slimmer`): what of its checkpoints `slim` drops (training-only state) and writes instead;
- `TRAINING_STATE_WRITER`, `POINTER_WRITER`: the slots `reshard` and `repair` fill;
- `TRAINING_STATE_SOURCE` (`TrainingStateSource`): a framework's training state parameter by parameter, which a
  writer of another framework's state reads (`reshard --to dcp` of a native or DeepSpeed state): plugins never
  import each other, so the writer asks `capability(source.layout, TRAINING_STATE_SOURCE)`.

A capability is typed by its slot: `capability(layout, CONVERT_SOURCE)` is a `ConvertSource` or None.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, Problem, SizedTensor, TensorEntry
from ckptctl.contract import slots
from ckptctl.contract.naming import NameStripper
from ckptctl.contract.slots import Slot
from ckptctl.errors import CkptctlError

if TYPE_CHECKING:
    from ckptctl.formats.manifest import FileRecord
    from ckptctl.formats.torch_save_writer import RawTensor

__all__ = [
    "CONVERT_SOURCE",
    "NO_NAME_MAP",
    "POINTER_WRITER",
    "SLIMMER",
    "TRAINING_STATE_SOURCE",
    "TRAINING_STATE_WRITER",
    "Adapter",
    "ConvertSource",
    "DerivedTensor",
    "HeadTask",
    "HfModel",
    "MasterWeights",
    "MasterWeightsReader",
    "ModelSpec",
    "ModelTensors",
    "NameMap",
    "NativeModel",
    "NotCarried",
    "ParamState",
    "Pointer",
    "PointerWriter",
    "ReshardRequest",
    "SlimRecipe",
    "SlimRewrite",
    "Slimmer",
    "Slot",
    "StateTensor",
    "TrainingStateSource",
    "TrainingStateWriter",
    "WrittenState",
    "default_config_folders",
]


class HeadTask(Enum):
    """The transformers model a value head converts to, by the suffix of its class name (`ConvertSource.value_head_task`;
    `families.value_head` finds the head)."""

    TOKEN = "ForTokenClassification"
    """One value per token (a critic): `AutoModelForTokenClassification`."""
    SEQUENCE = "ForSequenceClassification"
    """One value per sequence, at its last token (a reward model): `AutoModelForSequenceClassification`."""


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


@dataclass(frozen=True, slots=True)
class Pointer:
    """A file the framework's loader reads to choose what it resumes from, and what it must hold for the
    loader to resume from one checkpoint (`PointerWriter.pointers`).

    Attributes:
        path: the pointer file (DeepSpeed's `latest`, Megatron's and verl's tracker).
        content: its whole content, as the framework itself writes it (`global_step2`, `2`); for a link, its
            target, as the framework makes it (a name in the same folder).
        link: the pointer is a symbolic link the framework itself makes (Lightning's `last.ckpt` with
            `save_last="link"`), rewritten as a link; a file where a link is expected is refused.
    """

    path: str
    content: str
    link: bool = False


class PointerWriter(Protocol):
    """`repair`: the smallest change this framework's own loader honours that makes it resume from a given
    checkpoint of its run (DESIGN §4 `repair`): the pointers it reads rewritten, or, where it picks by name
    (the highest `checkpoint-N`), the newer entries it would pick out of its way. `ops.repair` plans, checks
    and applies the change (atomic pointer writes, quarantine inside the run); the writer only says what.
    """

    def roles(self, checkpoint: str) -> tuple[str, ...]:
        """Every checkpoint a resume from the checkpoint folder `checkpoint` loads, itself first: the other roles
        the framework saves at the same step (OpenRLHF's critic tag beside the actor's). A resume lands on a
        step only when every one of them verifies."""
        ...

    def pointers(self, checkpoint: str) -> tuple[Pointer, ...]:
        """The pointers to write, and what each must hold, for the loader to resume from `checkpoint` (every
        role's); () for a framework that keeps none."""
        ...

    def picked_over(self, checkpoint: str) -> tuple[str, ...]:
        """Entries (folders or files) that the loader, picking by name, would take instead of `checkpoint`:
        `repair` moves them into quarantine; () for a framework that follows its pointers."""
        ...

    def refusal(self, checkpoint: str) -> str | None:
        """Why no change of this framework's files makes its loader resume from `checkpoint`, with what to do
        instead (AReaL's `recover_info/` describing a dump that is gone; a copied `last.ckpt`); None when the
        writer's change does."""
        ...


@dataclass(frozen=True, slots=True)
class SlimRewrite:
    """A file the slim version of a checkpoint gets anew (a manifest without the dropped entries, the model
    that lived in the dropped files written as a model file).

    Attributes:
        path: where, relative to the checkpoint folder (`/` separated); it may replace a file of the same name.
        write: `write(local_path)` writes it there (the folder exists; `slim` fsyncs it afterwards).
    """

    path: str
    write: Callable[[str], None] = field(repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class SlimRecipe:
    """What a `Slimmer` drops from one checkpoint and what it writes instead; every other file is kept as is
    (hard-linked into the slim version).

    Attributes:
        drop: files dropped, relative to the checkpoint folder (`/` separated).
        dropped: what they held, for people and the JSON report (`optimizer`, `scheduler`, `rng`).
        rewrites: files written anew.
        shed_bytes: how much smaller the rewritten files are than the files of the same names they replace
            (a DCP data file keeping only its model items), for the plan's bytes freed.
    """

    drop: tuple[str, ...]
    dropped: tuple[str, ...]
    rewrites: tuple[SlimRewrite, ...] = ()
    shed_bytes: int = 0


@runtime_checkable
class Slimmer(Protocol):
    """`slim`: what of this framework's checkpoints is training-only state (optimizer moments and partitions,
    schedulers, RNG: what only a resume needs), keeping the model where the framework keeps it so that
    `convert` of the slim checkpoint writes what it wrote before (DESIGN §4 `slim`). `ops.slim` builds the
    slim version beside the checkpoint and swaps it in; the slimmer only decides and writes new files."""

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        """Why this checkpoint cannot be slimmed safely (a part the slimmer does not know how to cut, a model
        that lives in the training state and cannot be written apart yet), or None when it can. Reads
        metadata only."""
        ...

    def recipe(self, checkpoint: Checkpoint) -> SlimRecipe:
        """What to drop and write. Reads metadata only; the rewrites read tensor data when they run."""
        ...

    def expected(self, problem: Problem) -> bool:
        """Whether a problem this framework's reader reports about a slim checkpoint is what the drop explains,
        beyond problems naming a dropped file (those `verify` leaves out anyway): a rank file it expects
        under a name other than the one dropped."""
        ...


class OneLookSlimmer:
    """A `Slimmer` whose refusal and recipe come from one look at the checkpoint: `decide` gives the recipe or
    why there is none. Subclasses override `decide`, and `expected` where their reader reports what the drop
    explains."""

    def decide(self, checkpoint: Checkpoint) -> SlimRecipe | str:
        """The recipe for this checkpoint, or why it cannot be slimmed safely (reads metadata only)."""
        raise NotImplementedError

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        found = self.decide(checkpoint)
        return found if isinstance(found, str) else None

    def recipe(self, checkpoint: Checkpoint) -> SlimRecipe:
        found = self.decide(checkpoint)
        if isinstance(found, str):
            raise CkptctlError(f"{checkpoint.url} cannot be slimmed: {found}")
        return found

    def expected(self, problem: Problem) -> bool:
        return False


class MasterWeightsReader(Protocol):
    """`ConvertSource.master_weights`."""

    def __call__(self, checkpoint: Checkpoint, *, required: bool, notes: list[str]) -> MasterWeights | None:
        """The full-precision copy of the model a checkpoint keeps apart from its model weights (the fp32
        master weights of mixed-precision training), which `convert` writes by default.

        Args:
            checkpoint: a checkpoint of this framework's layout.
            required: the user asked for these weights; a reason why this checkpoint has none is an error.
            notes: where to append why there is no such copy, when a person would expect one.

        Returns:
            The copy, or None when the checkpoint keeps none.

        Raises:
            CkptctlError: `required`, and the checkpoint lacks the copy its framework usually keeps.
        """
        ...


@dataclass(frozen=True, slots=True)
class ConvertSource:
    """What `convert` reads from a framework's checkpoints beyond their tensor index, and `diff` when it
    compares the models of two layouts.

    A framework sets the fields it has; each one left None is what suits a framework without that feature,
    which `ckptctl.ops.convert_source` applies (names kept as the storage format has them, no master
    weights, a model rather than an adapter, the config beside the checkpoint, models that cannot be run).

    Attributes:
        namespace_stripper: `(entries) -> strip`: how to remove the namespace this framework's saves put in
            front of the model's own tensor names, for the tensors of one component. Without it, the rule of
            the storage format the tensors lie in applies (`layouts.format_rules.format_namespace_stripper`: the key
            a DCP state dict was saved under, a DeepSpeed module's wrappers) and other names are kept.
        hf_name_map: `(tensors, config, requested, notes) -> NameMap | None`: how the model's tensors, as this
            framework names and lays them out (`tensors`: names, namespace removed, -> shapes), become those
            of the Hugging Face model (`convert --to hf`): torchtitan's `layers.0.attention.wq.weight` to
            transformers' names, rows reordered where the two compute alike from rows in another order (the
            q/k rows of rotary embeddings). `config`: the parsed `config.json` the output gets, or None;
            `requested`: the map asked for by name (`--mapping`), None to pick one, `NO_NAME_MAP` to keep the
            names; `notes`: where to append what the user should know about the map used. None keeps the
            names. Raises `CkptctlError` when `requested` names no map, or the map needs what `config` lacks.
            Without it, names are kept and `--mapping` takes only `NO_NAME_MAP`.
        hf_model: `(checkpoint, config) -> HfModel`: the model's tensors as transformers names and shapes
            them, for a framework that stores them otherwise (Megatron's fused QKV and gate/up projections,
            its stacked layers and its own names): what `convert --to hf` writes, and what `diff` compares
            with a checkpoint of another layout. Made from the tensor index without reading tensor data: each
            entry's chunks point at the stored bytes of the part of a stored tensor it is. `config`: the
            `config.json` the user gave (`--config`), for what the checkpoint does not record. Raises
            `CkptctlError` when the model cannot be mapped (an architecture without a mapping, an unknown
            shape). Without it, the stored names and shapes are the model's own.
        native_model: `(checkpoint) -> NativeModel`: the model's tensors under the names and shapes the
            framework's own load hands to the model (its `state_dict()`), for a framework whose checkpoint
            stores them otherwise (Megatron's layers stacked on a leading axis, under the keys its layer spec
            maps the model's names to): what `convert --to hf --mapping none` writes, and what `diff` compares
            when the other side names the model so. Made from the tensor index without reading tensor data.
            Raises `CkptctlError` when the stored bytes cannot be cut so. Without it, the stored names and
            shapes are the model's own.
        master_weights: the full-precision copy of the model the checkpoint keeps apart from its model
            weights (`MasterWeightsReader`). Without it, checkpoints keep none.
        adapter: `(checkpoint) -> Adapter | None`: the adapter a checkpoint holds instead of a model (a PEFT
            LoRA folder), which `convert` merges into a base model (`--merge-adapter BASE`); None for a
            checkpoint that holds a model. Without it, every checkpoint holds a model.
        config_folders: `(checkpoint) -> folders`: folders that may hold the model's `config.json` (and
            tokenizer) for a checkpoint, best first, when `convert` is given no `--config`/`--tokenizer`: a
            framework that writes its Hugging Face export somewhere else (an `_hf` folder beside the tag, a
            Saver folder beside the recovery dump, a `huggingface/` subfolder) names that place, the nearest
            export of the same step first. Without it, `default_config_folders`.
        model_config: `(checkpoint) -> config | None`: the model's `config.json` as the checkpoint itself
            records it (a transformers config among a Lightning module's hyperparameters), which `convert`
            writes when it finds no config.json and is given no `--config`. Without it, checkpoints record none.
        model_spec: `(config, notes) -> ModelSpec | None`: the tensors of the model a config of this framework
            describes (a parsed `config.json`), as the framework's own code builds it, without memory;
            `convert` checks its output against it. None (appending why to `notes` when a person would expect
            one) when it cannot tell; raises `ModelMismatch` when the framework refuses to build a model from
            `config`. Without it, this framework cannot tell.
        model_logits: `(folder, config, tensors) -> logits`: logits (a float torch tensor) of the model in
            `folder` on fixed token ids, loaded by the framework's own loader; given `tensors` (name -> torch
            tensor), of the architecture `config` describes holding them instead (`convert --check-logits`
            compares the two). Raises `ModelMismatch` when the loader reports tensors missing, left over or of
            another shape. Without it, this framework's models cannot be run.
        value_head_task: `(checkpoint) -> HeadTask | None`: what the framework's own code builds from a model
            whose value head (`families.value_head`: a critic's, a reward model's) sits beside a config that
            names the base causal LM (as AReaL and verl save their critics): the transformers model `convert
            --to hf` writes it as. Without it, the config must name the task (or the head's bias tells it).
    """

    namespace_stripper: Callable[[Sequence[TensorEntry]], NameStripper] | None = None
    hf_name_map: (
        Callable[[Mapping[str, tuple[int, ...]], Mapping[str, Any] | None, str | None, list[str]], NameMap | None]
        | None
    ) = None
    hf_model: Callable[[Checkpoint, Mapping[str, Any] | None], HfModel] | None = None
    native_model: Callable[[Checkpoint], NativeModel] | None = None
    master_weights: MasterWeightsReader | None = None
    adapter: Callable[[Checkpoint], Adapter | None] | None = None
    config_folders: Callable[[Checkpoint], Sequence[str]] | None = None
    model_config: Callable[[Checkpoint], Mapping[str, Any] | None] | None = None
    model_spec: Callable[[Mapping[str, Any], list[str]], ModelSpec | None] | None = None
    model_logits: Callable[[str, Mapping[str, Any], Mapping[str, Any] | None], Any] | None = None
    value_head_task: Callable[[Checkpoint], HeadTask | None] | None = None


#: The capabilities a plugin may provide, by slot: `contract.slots`' objects, typed here by what fills them.
CONVERT_SOURCE: Slot[ConvertSource] = slots.CONVERT_SOURCE
TRAINING_STATE_WRITER: Slot[TrainingStateWriter] = slots.TRAINING_STATE_WRITER
TRAINING_STATE_SOURCE: Slot[TrainingStateSource] = slots.TRAINING_STATE_SOURCE
POINTER_WRITER: Slot[PointerWriter] = slots.POINTER_WRITER
SLIMMER: Slot[Slimmer] = slots.SLIMMER


def default_config_folders(checkpoint: Checkpoint) -> tuple[str, ...]:
    """Where `convert` looks for a checkpoint's model config (and tokenizer) when its framework names no
    place of its own: the checkpoint's folder, then its parent. A framework's `config_folders` that adds
    places to these ends with them."""
    return (checkpoint.ref.url, io.parent_of(checkpoint.ref.url))


#: `--mapping` value that keeps the names as the framework stores them.
NO_NAME_MAP = "none"


@dataclass(frozen=True, slots=True)
class NameMap:
    """A framework's model tensors as a Hugging Face model names and lays them out (`ConvertSource.hf_name_map`).

    Attributes:
        mapping: the map's name (`llama3`), as `--mapping` takes it.
        names: stored name (namespace removed) -> the transformers name; names not in it are kept as they are
            (the model check then names any the architecture does not have).
        rows: transformers name -> the stored rows (first dimension) in the order the output holds them: a
            row permutation, for tensors the two models compute alike from rows in another order.
    """

    mapping: str
    names: Mapping[str, str]
    rows: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HfModel:
    """A checkpoint's model under Hugging Face transformers names (`ConvertSource.hf_model`); no tensor data is read.

    Attributes:
        entries: in the model's state-dict order, named as transformers names them.
        config: the transformers `config.json` the checkpoint's own records describe (None: they describe none;
            `convert` then copies one as for any layout).
        notes: what the user should know about the mapping.
    """

    entries: tuple[TensorEntry, ...]
    config: Mapping[str, Any] | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NativeModel:
    """A checkpoint's model under the names and shapes its framework's own load gives the model
    (`ConvertSource.native_model`); no tensor data is read.

    Attributes:
        entries: in the model's state-dict order, each one's chunks pointing at the stored bytes it is.
        notes: what the user should know about the names (where they rest on a guess).
    """

    entries: tuple[TensorEntry, ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class MasterWeights:
    """The full-precision weights of a checkpoint (`ConvertSource.master_weights`), as index entries named as the
    model's state dict names them; no tensor data is read.

    Attributes:
        entries: in the model's state-dict order.
        upcast: names of entries to write as float32 whatever their stored dtype (what the framework's
            own tool does with them).
        notes: where the entries depart from the framework's own tool's output, for the user.
    """

    entries: tuple[TensorEntry, ...]
    upcast: frozenset[str]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The tensors of a model architecture (`ConvertSource.model_spec`), read off the framework's own code.

    Attributes:
        architecture: the class that was built (`LlamaForCausalLM`).
        saved: name -> shape of what the framework's own save writes (tied copies left out).
        state: name -> shape of the model's state dict (tied copies in; persistent buffers only), what
            `dcp.load({"model": model.state_dict()})` fills.
        tied: each tied copy -> the tensor it is (`lm_head.weight` -> `model.embed_tokens.weight`).
        ignored_leftovers: patterns (regular expressions) of names the loader ignores when present.
        ignored_missing: patterns of names the loader accepts missing.
    """

    architecture: str
    saved: Mapping[str, tuple[int, ...]]
    state: Mapping[str, tuple[int, ...]]
    tied: Mapping[str, str]
    ignored_leftovers: tuple[str, ...] = ()
    ignored_missing: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DerivedTensor:
    """An output tensor that no file holds as is, computed when it is written (a LoRA merge: W + s·B@A).

    `convert` plans, checks and writes it like a stored tensor; its bytes come from `compute()` instead of
    a byte copy.

    Attributes:
        name: its name in the output.
        dtype: torch-style dtype name of what `compute` returns.
        shape: the shape of what `compute` returns.
        compute: reads the stored tensors it derives from and returns the result (a torch tensor).
        compute_bytes: the same result as its raw bytes (row-major, little-endian), where it can be computed
            without torch: a writer of raw bytes (`--to hf`) then never imports torch (about a second and
            200 MiB of resident memory).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    compute: Callable[[], Any] = field(repr=False, compare=False)
    compute_bytes: Callable[[], memoryview] | None = field(default=None, repr=False, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


#: A model as `convert` writes it: each output name -> the stored tensor it is, or the tensor computed for it.
ModelTensors = Mapping[str, "TensorEntry | DerivedTensor"]


@dataclass(frozen=True, slots=True)
class Adapter:
    """An adapter a checkpoint holds in place of a model (`ConvertSource.adapter`).

    Attributes:
        kind: what it is, for people (`LoRA`).
        base_hint: the base model the adapter itself names (PEFT's `base_model_name_or_path`), or None.
        merge: `merge(base_url, base, notes)`: the model `base` (the base model's tensors by the model's
            names, in order, their chunks relative to `base_url`) with the adapter merged in, by name and in
            base order: the base entries it leaves alone kept as they are, the others derived. It appends
            to `notes` what a person should know, and raises `CkptctlError` when the adapter cannot be
            merged (a kind it does not handle) or does not fit the base.
    """

    kind: str
    base_hint: str | None
    merge: Callable[[str, Mapping[str, TensorEntry], list[str]], ModelTensors] = field(repr=False)
