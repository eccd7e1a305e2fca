"""The capability `convert` (and `diff`) read from a framework's checkpoints beyond their tensor index
(`ConvertSource`): master weights, name maps, the model spec, config, an adapter, a value head; and what its
fields return. The defaults for a framework without one live with the commands (`ops.convert_source`);
`contract.capabilities` types its slot."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, TensorEntry
from ckptctl.contract.naming import NameStripper


class HeadTask(Enum):
    """The transformers model a value head converts to, by the suffix of its class name (`ConvertSource.value_head_task`;
    `families.value_head` finds the head)."""

    TOKEN = "ForTokenClassification"
    """One value per token (a critic): `AutoModelForTokenClassification`."""
    SEQUENCE = "ForSequenceClassification"
    """One value per sequence, at its last token (a reward model): `AutoModelForSequenceClassification`."""


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
