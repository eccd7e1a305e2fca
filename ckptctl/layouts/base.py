"""The Layout protocol: what every on-disk layout module implements (DESIGN §1–2).

A layout recognises its folders from a directory listing (cheap, no file reads beyond tiny markers),
opens one into a `Checkpoint` (headers and metadata only), and checks its completeness rules. The
shared contract test in `tests/layouts/test_contract.py` runs against every registered layout.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, Problem, TensorEntry
from ckptctl.errors import CkptctlError
from ckptctl.formats.dcp_metadata import METADATA_NAME, RANK_METADATA
from ckptctl.formats.torch_zip import TorchArchive
from ckptctl.io import DirEntry
from ckptctl.layouts.naming import NameStripper, format_namespace_stripper
from ckptctl.layouts.parts.dcp_folder_metadata import dcp_item_archives
from ckptctl.layouts.resume import ResumeProfile, generic_profile


class Layout:
    """One on-disk checkpoint layout: everything ckptctl knows about the checkpoints one framework writes.

    A framework package (`ckptctl/frameworks/<name>/`) subclasses this and registers it in
    `ckptctl.layouts._REGISTRY`. The four methods without a default are the reader; every other hook has a
    default that suits a layout without that feature, so a new framework overrides only what it has.
    Commands (`ckptctl.ops`) ask these hooks and never name a framework.
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

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """Structural problems: missing or short files, metadata that does not parse or cover its data."""
        raise NotImplementedError

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

    # ---------------------------------------------------------------------------------------- resume

    def resume_profile(self) -> ResumeProfile:
        """How the framework that wrote this layout's checkpoints resumes from them (`resume-plan`): its
        setting, world-size rules, what it restores and its traps. The default is a generic plan."""
        return generic_profile(self.name)

    # ---------------------------------------------------------------------------------------- convert

    def master_weights(self, checkpoint: Checkpoint, *, required: bool, notes: list[str]) -> MasterWeights | None:
        """The full-precision copy of the model a checkpoint keeps apart from its model weights (the fp32
        master weights of mixed-precision training), which `convert` writes by default.

        Args:
            checkpoint: a checkpoint this layout opened.
            required: the user asked for these weights; a reason why this checkpoint has none is an error.
            notes: where to append why there is no such copy, when a person would expect one.

        Returns:
            The copy, or None when the checkpoint keeps none.

        Raises:
            CkptctlError: `required`, and the checkpoint lacks the copy its framework usually keeps.
        """
        return None

    def hf_model(self, checkpoint: Checkpoint, config: Mapping[str, Any] | None) -> HfModel | None:
        """The model's tensors as Hugging Face transformers names and shapes them, for a layout whose framework
        stores them otherwise (Megatron's fused QKV and gate/up projections, its stacked layers and its own
        names): what `convert --to hf` writes, and what `diff` compares with a checkpoint of another layout.

        The entries are made from the tensor index without reading tensor data: each one's chunks point at the
        stored bytes of the part of a stored tensor it is (RAW chunks into the framework's files).

        Args:
            checkpoint: a checkpoint this layout opened.
            config: the transformers `config.json` the user gave (`--config`), for what the checkpoint does not
                record itself (the model's shape).

        Returns:
            The tensors (and the config the checkpoint's own records describe), or None when the stored names
            and shapes are the model's own (the default).

        Raises:
            CkptctlError: the model cannot be mapped (an architecture without a mapping, an unknown shape).
        """
        return None

    def config_folders(self, checkpoint: Checkpoint) -> Sequence[str]:
        """Folders that may hold the model's `config.json` (and tokenizer) for this checkpoint, best first,
        when `convert` is given no `--config`/`--tokenizer`.

        The default looks in the checkpoint's folder and its parent. A framework that writes its Hugging
        Face export somewhere else (an `_hf` folder beside the tag, a Saver folder beside the recovery
        dump, a `huggingface/` subfolder) overrides it to name that place: the nearest export of the same
        step first, then the latest one.
        """
        return (checkpoint.ref.url, io.parent_of(checkpoint.ref.url))

    def model_config(self, checkpoint: Checkpoint) -> Mapping[str, Any] | None:
        """The model's `config.json` as the checkpoint itself records it (a transformers config among a
        Lightning module's hyperparameters), which `convert` writes when it finds no config.json and is given
        no `--config`; None (the default) when it records none."""
        return None

    def model_spec(self, config: Mapping[str, Any], notes: list[str]) -> ModelSpec | None:
        """The tensors of the model a config of this framework describes (a parsed `config.json`), as the
        framework's own code builds it, without memory; `convert` checks its output against it.

        Args:
            config: the config the output carries.
            notes: where to append why there is no spec, when a person would expect one.

        Returns:
            The spec, or None when this framework cannot tell (the default).

        Raises:
            ModelMismatch: the framework refuses to build a model from `config`.
        """
        return None

    def adapter(self, checkpoint: Checkpoint) -> Adapter | None:
        """The adapter this checkpoint holds instead of a model (a PEFT LoRA folder), which `convert` merges
        into a base model (`--merge-adapter BASE`); None (the default) for a checkpoint that holds a model.

        Args:
            checkpoint: a checkpoint this layout opened.
        """
        return None

    def model_logits(self, folder: str, config: Mapping[str, Any], tensors: Mapping[str, Any] | None) -> Any:
        """Logits (a float torch tensor) of the model in `folder` on fixed token ids, loaded by the framework's
        own loader; given `tensors` (name -> torch tensor), of the architecture `config` describes holding
        them instead. `convert --check-logits` compares the two.

        Raises:
            ModelMismatch: the loader reports tensors missing, left over or of another shape.
            CkptctlError: this framework cannot run its models (the default).
        """
        raise CkptctlError(f"{self.name} models cannot be run to compare their logits")

    # ---------------------------------------------------------------------------------- tensor names

    def hf_name_map(
        self,
        tensors: Mapping[str, tuple[int, ...]],
        config: Mapping[str, Any] | None,
        requested: str | None,
        notes: list[str],
    ) -> NameMap | None:
        """How the model's tensors, as this framework names and lays them out, become those of the Hugging
        Face model (`convert --to hf`): a framework whose models are its own code (torchtitan's `layers.0.
        attention.wq.weight`) maps them to transformers' names, and reorders rows where the two compute
        alike from rows in another order (the q/k rows of rotary embeddings).

        Args:
            tensors: the model's tensor names (the namespace of the save removed, as `namespace_stripper`
                does) -> their shapes.
            config: the parsed `config.json` the output gets, or None.
            requested: the map asked for by name (`--mapping`); None picks one from `config` and `names`,
                `"none"` keeps the names.
            notes: where to append what the user should know about the map used.

        Returns:
            The map, or None to keep the names (the default: a framework whose names are transformers').

        Raises:
            CkptctlError: `requested` names no map of this framework, or the map needs what `config` lacks.
        """
        if requested not in (None, NO_NAME_MAP):
            raise CkptctlError(
                f"{self.name} checkpoints have no tensor name map {requested!r}",
                f"their tensors keep their names: drop --mapping (or pass --mapping {NO_NAME_MAP})",
            )
        return None

    def namespace_stripper(self, entries: Sequence[TensorEntry]) -> NameStripper:
        """How to remove the namespace this layout's saves put in front of the model's own tensor names,
        for the tensors of one component (`convert` and `diff` use the model's names).

        The default applies the rule of the storage format the tensors lie in (`FORMAT_NAME_RULES`: the
        key a DCP state dict was saved under, the prefixes of the wrappers a DeepSpeed module was trained
        in), and keeps other names as stored (an HF folder's names are the model's own). A layout whose
        saves add a namespace of their own overrides it.
        """
        return format_namespace_stripper(entries)


#: Suffixes of the files torch.save writes as frameworks name them.
TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def default_torch_archives(checkpoint: Checkpoint) -> tuple[TorchArchive, ...]:
    """`Layout.torch_archives`' default: torch.save files by name, and the items of DCP folders (a
    `.metadata`, or the per-rank `__{rank}.metadata` of a save without collectives).

    A DCP folder whose metadata does not parse contributes nothing (structural verify reports why).
    """
    archives: list[TorchArchive] = []
    folders = set()
    for rel in checkpoint.files:
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


#: `--mapping` value that keeps the names as the framework stores them.
NO_NAME_MAP = "none"


@dataclass(frozen=True, slots=True)
class NameMap:
    """A framework's model tensors as a Hugging Face model names and lays them out (`Layout.hf_name_map`).

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
    """A checkpoint's model under Hugging Face transformers names (`Layout.hf_model`); no tensor data is read.

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
class MasterWeights:
    """The full-precision weights of a checkpoint (`Layout.master_weights`), as index entries named as the
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
    """The tensors of a model architecture (`Layout.model_spec`), read off the framework's own code.

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
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    compute: Callable[[], Any] = field(repr=False, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


#: A model as `convert` writes it: each output name -> the stored tensor it is, or the tensor computed for it.
ModelTensors = Mapping[str, "TensorEntry | DerivedTensor"]


@dataclass(frozen=True, slots=True)
class Adapter:
    """An adapter a checkpoint holds in place of a model (`Layout.adapter`).

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


_STEP_PATTERNS = (
    re.compile(r"^(?:step|global_step|globalstep|checkpoint|ckpt|iter|iteration|steps?)[-_]?(\d+)$", re.IGNORECASE),
    re.compile(r"^(\d+)$"),
)


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


def step_from_name(name: str) -> int | None:
    """The step a folder name encodes (`step-100`, `step_100`, `global_step100`, `checkpoint-100`, `100`)."""
    for pattern in _STEP_PATTERNS:
        m = pattern.match(name)
        if m:
            return int(m.group(1))
    return None


def timestamp(mtime: float | None) -> datetime | None:
    """A UTC datetime from a POSIX mtime (None or 0 means unknown)."""
    return datetime.fromtimestamp(mtime, tz=UTC) if mtime else None


def folder_size(url: str, entries: Sequence[DirEntry] | None = None) -> int:
    """Total size of the files below a folder (recursive).

    `entries`, the folder's listing when the caller has it, saves a request when it holds no folder.
    """
    if io.is_local(url):
        total = 0
        for root, _dirs, files in os.walk(io.local_path(url)):
            for f in files:
                try:
                    total += os.stat(os.path.join(root, f)).st_size
                except FileNotFoundError:
                    continue
        return total
    if entries is not None and not any(e.is_dir for e in entries):
        return sum(e.size for e in entries)
    return sum(e.size for e in io.list_tree(url).values())


def newest_mtime(entries: Sequence[DirEntry]) -> float | None:
    """The newest modification time of the files in a listing (None for an empty listing)."""
    times = [e.mtime for e in entries if not e.is_dir and e.mtime]
    return max(times) if times else None


def list_files(url: str) -> dict[str, int]:
    """Every file below a folder: relative path (with `/`) -> size in bytes (one listing on object stores)."""
    if io.is_local(url):
        files: dict[str, int] = {}
        base = io.local_path(url)
        for root, _dirs, names in os.walk(base):
            for n in names:
                full = os.path.join(root, n)
                try:
                    files[os.path.relpath(full, base).replace(os.sep, "/")] = os.stat(full).st_size
                except FileNotFoundError:
                    continue
        return files
    return {rel: entry.size for rel, entry in sorted(io.list_tree(url).items())}
