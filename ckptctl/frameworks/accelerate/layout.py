"""accelerate checkpoints: the folder `Accelerator.save_state()` writes (accelerate 1.15, `accelerator.py`
`save_state`, `checkpointing.py` `save_accelerator_state`).

```
PROJECT_DIR/checkpoints/checkpoint_{N}/     with ProjectConfiguration(automatic_checkpoint_naming=True):
                                            N counts save_state calls (the save iteration), not training steps
or any folder passed to save_state(DIR)     (accelerate's examples use `step_{N}` and `epoch_{E}`)
    model.safetensors | pytorch_model.bin   each prepared model (model_{i}.safetensors, ...), plain DDP/single
    pytorch_model/ + latest                 DeepSpeed plugin: a DeepSpeed tag per model (pytorch_model_{i}/)
    pytorch_model_fsdp_{i}/, optimizer_{i}/ FSDP plugin, SHARDED_STATE_DICT: torch DCP folders
      (pytorch_model_fsdp[_{i}].bin: FULL_STATE_DICT; *_rank{R}.bin: LOCAL_STATE_DICT or use_dcp=False)
    optimizer.bin, scheduler.bin            torch.save of each state_dict (optimizer_{i}.bin, ...)
    sampler.bin | dl_state_dict.bin         the seedable sampler / a stateful data loader's state, when saved
    scaler.pt                               the GradScaler (fp16)
    random_states_{process}.pkl             torch.save of python, numpy and torch RNG states and
                                            `accelerator.step`, one per process, written after all the above
    custom_checkpoint_{i}.pkl               objects registered with register_for_checkpointing
```

Every `.bin`/`.pkl`/`.pt` is a torch.save zip, read with `formats.torch_pickle` (its `data.pkl` through the
allowlisting unpickler, never `pickle.load`); the DeepSpeed tag and the DCP folders are read with their
own frameworks' readers, as members of this checkpoint (the run walker does not list them apart).

`random_states_{i}.pkl` is written by every process after the model, optimizer, scheduler and sampler
files: a folder without `random_states_0.pkl` did not finish its save (in progress while its files are
fresh, broken once older: `families.in_progress`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache, partial
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import (
    Checkpoint,
    CheckpointRef,
    CheckpointState,
    Component,
    Problem,
    ProblemKind,
    TensorEntry,
)
from ckptctl.contract.base import (
    LISTED_ABSENT,
    Layout,
    Protections,
    absent_numbers,
    default_torch_archives,
    every_child_folder,
    folder_size,
    list_files,
    newest_mtime,
    step_from_name,
    timestamp,
)
from ckptctl.contract.load_set import LoadMember
from ckptctl.errors import CkptctlError
from ckptctl.families.hf_folder import safetensors_index, verify_model_files
from ckptctl.families.in_progress import missing_marker
from ckptctl.families.torch_file import pickle_entries, torch_file_problems
from ckptctl.families.zero_tag.tag import DeepSpeedTag, read_tag
from ckptctl.families.zero_tag.tensor_index import tag_index
from ckptctl.families.zero_tag.verify import verify_tag
from ckptctl.formats.torch_pickle import open_torch_pickle
from ckptctl.formats.torch_zip import TorchArchive
from ckptctl.frameworks.accelerate.files import (
    AUTO_FOLDER,
    AUTO_PARENT,
    FSDP_RANK_FILE,
    RNG_FILE,
    numbered,
    per_process_files,
    rng_ranks,
)
from ckptctl.frameworks.accelerate.load_set import expected_files, save_state_members, torn_note
from ckptctl.io import DirEntry

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = ["AccelerateLayout", "SaveStateParts", "auto_checkpoint_match"]

#: The folder names accelerate's own examples pass to save_state (`step_{N}`, `epoch_{E}`).
_EPOCH_FOLDER = re.compile(r"^epoch_(\d+)$")
_MODEL_SAFE = numbered("model", ".safetensors")
_MODEL_BIN = numbered("pytorch_model", ".bin")
_OPTIMIZER = numbered("optimizer", ".bin")
_SCHEDULER = numbered("scheduler", ".bin")
_SAMPLER = re.compile(r"^(?:sampler|dl_state_dict)(?:_(\d+))?\.bin$")
_SCALER = "scaler.pt"
_CUSTOM = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
_DS_TAG = re.compile(r"^pytorch_model(?:_(\d+))?$")
_FSDP_MODEL_DIR = re.compile(r"^pytorch_model_fsdp_(\d+)$")
_FSDP_OPTIM_DIR = re.compile(r"^optimizer_(\d+)$")
_FSDP_FULL = numbered("pytorch_model_fsdp", ".bin")
#: RNG keys every random_states file holds (`save_accelerator_state`); device generators are added per device.
_RNG_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")


def _index(match: re.Match[str]) -> int:
    return int(match.group(1) or 0)


@dataclass(frozen=True, slots=True)
class SaveStateParts:
    """What a save_state folder holds, from its listing (no file is read)."""

    files: frozenset[str]
    rng: tuple[int, ...]
    models: dict[int, str]
    optimizers: dict[int, str]
    ds_tags: dict[int, str]
    dcp_models: dict[int, str]
    dcp_optimizers: dict[int, str]
    #: Per-process FSDP files (`*_rank{R}.bin`): torch.save of DTensor shards, not read (see `verify`).
    fsdp_files: tuple[str, ...]

    @classmethod
    def of(cls, entries: Sequence[DirEntry]) -> SaveStateParts:
        files = frozenset(e.name for e in entries if not e.is_dir)
        dirs = [e.name for e in entries if e.is_dir]
        models: dict[int, str] = {}
        for name in sorted(files):
            if (m := _MODEL_SAFE.match(name)) or (m := _MODEL_BIN.match(name)) or (m := _FSDP_FULL.match(name)):
                models.setdefault(_index(m), name)  # safetensors first: what load_state reads first
        return cls(
            files=files,
            rng=tuple(rng_ranks(list(files))),
            models=models,
            optimizers={_index(m): n for n in files if (m := _OPTIMIZER.match(n))},
            ds_tags={_index(m): d for d in dirs if (m := _DS_TAG.match(d))},
            dcp_models={_index(m): d for d in dirs if (m := _FSDP_MODEL_DIR.match(d))},
            dcp_optimizers={_index(m): d for d in dirs if (m := _FSDP_OPTIM_DIR.match(d))},
            fsdp_files=tuple(per_process_files(files)),
        )

    @property
    def plugin(self) -> str:
        """Which accelerate plugin wrote the model: `deepspeed`, `fsdp`, or `none` (plain DDP or one process)."""
        if self.ds_tags:
            return "deepspeed"
        if self.dcp_models or self.dcp_optimizers or self.fsdp_files or any(_FSDP_FULL.match(n) for n in self.files):
            return "fsdp"
        return "none"

    def holds_state(self) -> bool:
        """Whether anything save_state writes is here."""
        return bool(self.models or self.ds_tags or self.dcp_optimizers or self.own_files())

    def own_files(self) -> bool:
        """Whether files that only save_state names so are here: a model file alone may be any HF export, a
        DeepSpeed tag any DeepSpeed save, an `optimizer_0/` DCP folder any DCP save."""
        return bool(
            self.rng
            or self.optimizers
            or self.dcp_models
            or self.fsdp_files
            or any(_SCHEDULER.match(n) or _SAMPLER.match(n) for n in self.files)
        )

    @property
    def has_model(self) -> bool:
        """Whether a model is saved here, in any of the ways save_state writes one."""
        return bool(
            self.models or self.ds_tags or self.dcp_models or any(_fsdp_kind(n) == "model" for n in self.fsdp_files)
        )

    @property
    def has_optimizer(self) -> bool:
        """Whether an optimizer is saved here outside a DeepSpeed tag."""
        return bool(
            self.optimizers or self.dcp_optimizers or any(_fsdp_kind(n) == "optimizer" for n in self.fsdp_files)
        )

    def pickles(self) -> list[str]:
        """Every torch.save file at the top (the model's `.bin` too), in a stable order."""
        return sorted(
            n for n in self.files if (n.endswith((".bin", ".pkl")) or n == _SCALER) and n not in self.fsdp_files
        )


def _fsdp_kind(name: str) -> str:
    """`model` or `optimizer`: what one of the per-process FSDP files holds."""
    m = FSDP_RANK_FILE.match(name)
    return "optimizer" if m is not None and m.group("kind") == "optimizer" else "model"


def auto_checkpoint_match(url: str) -> re.Match[str] | None:
    """The `checkpoint_{N}` match when the folder is one of automatic checkpoint naming's."""
    m = AUTO_FOLDER.match(io.name_of(url))
    return m if m is not None and io.name_of(io.parent_of(url)) == AUTO_PARENT else None


class AccelerateLayout(Layout):
    """A folder written by `Accelerator.save_state()` (plain, DeepSpeed or FSDP plugin)."""

    name = "accelerate"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A folder holding `random_states_{i}.pkl` (what every save_state writes, last), or what save_state
        writes before it (an unfinished save): files only accelerate names so (`optimizer.bin`, `scheduler.bin`,
        `pytorch_model_fsdp_0/`), or anything of it in an automatic `checkpoints/checkpoint_N`."""
        parts = SaveStateParts.of(entries)
        auto = auto_checkpoint_match(url)
        if not (parts.own_files() or (auto and parts.holds_state())):
            return None
        name = io.name_of(url)
        step = int(auto.group(1)) if auto else step_from_name(name)
        epoch = float(m.group(1)) if (m := _EPOCH_FOLDER.match(name)) else None
        marker = (
            next((e for e in entries if e.name == f"random_states_{parts.rng[0]}.pkl"), None) if parts.rng else None
        )
        note = ""
        if marker is not None:
            state = CheckpointState.COMPLETE
            created = timestamp(marker.mtime)
            if auto:
                note = "step = N of checkpoint_N: it counts saves, not training steps"
            if torn := torn_note(url, parts.files):
                state, note = CheckpointState.BROKEN, torn
        else:
            newest = newest_mtime(entries)
            created = timestamp(newest)
            state, note = missing_marker(
                newest, "random_states_0.pkl", "save_state writes it last, so the save was interrupted"
            )
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=step,
            epoch=epoch,
            created=created,
            state=state,
            size_bytes=folder_size(url, entries),
            note=note,
        )

    def members(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """Every child folder: save_state writes the folder as a whole (its DeepSpeed tag, its DCP folders),
        and `total_limit`'s rotation deletes it as a whole."""
        return every_child_folder(entries)

    def open(self, url: str) -> Checkpoint:
        """The listing, the rank-0 RNG file and, under DeepSpeed, the tag's rank-0 files; the tensor index
        reads safetensors headers, `data.pkl` of the `.bin` files, the tag's files and DCP metadata."""
        entries = io.list_dir(url)
        ref = self.identified(url, entries, "an accelerate save_state folder (no random_states_N.pkl)")
        parts = SaveStateParts.of(entries)
        files = list_files(url)
        auto = auto_checkpoint_match(url)
        metadata: dict[str, Any] = {
            "format": "accelerate",
            "plugin": parts.plugin,
            "naming": "automatic (checkpoint_N: N counts saves, not training steps)" if auto else "user-named folder",
        }
        progress: dict[str, Any] = {}
        if auto:
            progress["save_iteration"] = int(auto.group(1))
        components = _components(parts)
        if parts.rng:
            rng = _read_rng(url, f"random_states_{parts.rng[0]}.pkl", files)
            if isinstance(rng, dict):
                step = rng.get("step")
                if type(step) is int:
                    # accelerate's own counter of micro-batches (under `accumulate`), restored by load_state.
                    progress["accelerator_step"] = step
                metadata["rng_states"] = ", ".join(sorted(str(k) for k in rng if k != "step"))
        world_size = (max(parts.rng) + 1) if parts.rng else None
        tag = None
        if 0 in parts.ds_tags:
            try:
                tag = read_tag(io.join(url, parts.ds_tags[0]))
            except CkptctlError as exc:
                metadata["deepspeed_error"] = exc.message
            else:
                components |= tag.components() - {Component.TRAINER_STATE, Component.EXTRA}
                metadata["deepspeed"] = tag.summary()
                progress.update(tag.metadata()["progress"])
                world_size = world_size or tag.world_size
                if ref.step is None and tag.global_steps is not None:
                    ref = replace(ref, step=tag.global_steps)
        models = len(set(parts.models) | set(parts.ds_tags) | set(parts.dcp_models))
        if models > 1:
            metadata["models"] = f"{models} (the first is the model; the others' tensors are listed as extra)"
        if parts.fsdp_files:
            metadata["note"] = _RANK_FILES_NOTE
        metadata["progress"] = progress

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            return _tensor_index(url, parts, files, tag)

        return Checkpoint(
            ref=ref,
            components=frozenset(components),
            world_size=world_size,
            metadata=metadata,
            tensor_index=tensor_index,
            files=files,
            progress=progress,
        )

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """RNG files for processes 0..n-1, each holding the RNG states; every torch.save file parses with
        the allowlist and holds its storages; the model files pass the HF rules; the DeepSpeed tag and its
        `latest`, and the DCP folders, pass their frameworks' rules."""
        url = checkpoint.url
        files = checkpoint.files
        parts = SaveStateParts.of(io.list_dir(url))
        problems: list[Problem] = []
        if not parts.rng:
            problems.append(
                Problem(
                    ProblemKind.MISSING_FILE,
                    "random_states_0.pkl",
                    "random_states_0.pkl is missing: save_state writes the RNG states after the model, optimizer "
                    "and scheduler, so the save did not finish",
                )
            )
        else:
            listed, absent = absent_numbers(parts.rng, max(parts.rng) + 1)
            problems += [
                Problem(ProblemKind.MISSING_FILE, f"random_states_{i}.pkl", f"random_states_{i}.pkl is missing")
                for i in listed
            ]
            if absent > len(listed):
                problems.append(
                    Problem(
                        ProblemKind.MISSING_FILE, "", f"{absent - len(listed)} more random_states_N.pkl are missing"
                    )
                )
        model_files = {"model.safetensors", "pytorch_model.bin"}
        if not parts.has_model and not model_files & expected_files(url, parts.files).keys():
            # (Where the run's other saves name the lost model file, the load set says so, with that evidence.)
            problems.append(
                # Named as load_accelerator_state reads it first (then pytorch_model.bin, which its
                # FileNotFoundError names): the file a torn save lost.
                Problem(
                    ProblemKind.MISSING_FILE,
                    "model.safetensors",
                    "no model weights: model.safetensors is missing (nor pytorch_model.bin, a DeepSpeed tag or an "
                    "FSDP folder): accelerate load_accelerator_state raises without them",
                )
            )
        problems += _rank_file_problems(parts)
        safetensors = {n: files[n] for n in parts.files if n.endswith(".safetensors")}
        if safetensors:
            problems += verify_model_files(url, safetensors)
        for name in parts.pickles():
            problems += _pickle_problems(url, name, files[name])
        for index, tag in sorted(parts.ds_tags.items()):
            # Every model's save_checkpoint rewrites `latest` with its own tag: the last model's stays.
            problems += verify_tag(io.join(url, tag), f"{tag}/", latest=index == max(parts.ds_tags))
        from ckptctl.families.dcp_folder import verify_dcp

        for folder in sorted({*parts.dcp_models.values(), *parts.dcp_optimizers.values()}):
            problems += verify_dcp(io.join(url, folder), f"{folder}/")
        return problems

    def load_set(self, checkpoint: Checkpoint) -> Sequence[LoadMember]:
        """The numbered files `load_state` reads (`frameworks.accelerate.load_set`): those here, those a gap in
        their numbering or the run's other saves say are missing."""
        return save_state_members(checkpoint.url, checkpoint.files)

    def torch_archives(self, checkpoint: Checkpoint) -> Sequence[TorchArchive]:
        """The default's, and the `.pkl` files accelerate writes with torch.save too (`random_states_{i}.pkl`,
        `custom_checkpoint_{i}.pkl`: accelerate/checkpointing.py, save_accelerator_state and
        save_custom_state)."""
        pickles = (TorchArchive(rel) for rel in sorted(checkpoint.files) if "/" not in rel and rel.endswith(".pkl"))
        return (*default_torch_archives(checkpoint), *pickles)

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """The `random_states_{i}.pkl` files, which save_state writes after the model, optimizer, scheduler
        and sampler files (without rank 0's the folder reads unfinished)."""
        ranks = rng_ranks([name for name in files if "/" not in name])
        return tuple(f"random_states_{i}.pkl" for i in ranks)

    def protections(self, series: Sequence[CheckpointRef]) -> Protections:
        """In an automatic-naming `checkpoints/` folder: the highest `checkpoint_N`, which
        `accelerator.load_state()` without a path loads (it and `total_limit`'s rotation go by the number
        alone); and the newest save when the numbering restarted below older saves (a resume that did not
        set `project_configuration.iteration`, accelerate#3306), which that rotation would delete first."""
        auto = [
            (int(m.group(1)), ref)
            for ref in series
            if ref.layout == self.name and (m := auto_checkpoint_match(ref.url)) is not None
        ]
        complete = [(n, ref) for n, ref in auto if ref.state is CheckpointState.COMPLETE]
        if not complete:
            return Protections()
        reasons: dict[str, tuple[str, ...]] = {}
        highest_n, highest = max(complete, key=lambda item: item[0])
        if highest_n == max(n for n, _ in auto):
            reasons[highest.url] = ("accelerator.load_state() without a path loads the highest checkpoint_N",)
        dated = [(n, ref) for n, ref in complete if ref.created is not None]
        notes: tuple[str, ...] = ()
        if dated:
            newest_n, newest = max(dated, key=lambda item: item[1].created or 0)
            if newest_n < highest_n:
                reasons[newest.url] = (
                    *reasons.get(newest.url, ()),
                    f"the newest save, numbered below checkpoint_{highest_n}: the numbering restarted",
                )
                notes = (
                    f"{io.parent_of(newest.url)}: checkpoint_{newest_n} was saved after checkpoint_{highest_n}: the "
                    "save numbering restarted (a resume without setting accelerator.project_configuration.iteration, "
                    "accelerate#3306); load_state() without a path loads the highest number, and total_limit's "
                    "rotation deletes the lowest numbers first",
                )
        return Protections(reasons=reasons, notes=notes)

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.accelerate.resume`."""
        from ckptctl.frameworks.accelerate.resume import PROFILE

        return PROFILE


def _components(parts: SaveStateParts) -> set[Component]:
    found: set[Component] = set()
    if parts.has_model:
        found.add(Component.MODEL)
    if parts.has_optimizer:
        found.add(Component.OPTIMIZER)
    if any(_SCHEDULER.match(n) for n in parts.files):
        found.add(Component.SCHEDULER)
    if any(_SAMPLER.match(n) for n in parts.files):
        found.add(Component.DATALOADER)
    if parts.rng:
        found.add(Component.RNG)
    if _SCALER in parts.files or any(_CUSTOM.match(n) for n in parts.files):
        found.add(Component.EXTRA)
    return found


_RANK_FILES_NOTE = (
    "the per-process FSDP files (*_rank{R}.bin: use_dcp=False or LOCAL_STATE_DICT) pickle DTensor shards, which "
    "ckptctl does not read: one per process is checked, not their content, and their tensors are not listed"
)


def _rank_file_problems(parts: SaveStateParts) -> list[Problem]:
    """Each per-process FSDP file (`{prefix}_rank{R}.bin`) for every process that saved RNG states: every
    process writes its own, and load_state needs each process's."""
    ranks: dict[str, set[int]] = {}
    for name in parts.fsdp_files:
        m = FSDP_RANK_FILE.match(name)
        if m is not None:
            ranks.setdefault(name[: m.start("rank") - len("_rank")], set()).add(int(m.group("rank")))
    expected = set(parts.rng)
    problems = []
    for prefix, have in sorted(ranks.items()):
        problems += [
            Problem(ProblemKind.MISSING_FILE, f"{prefix}_rank{r}.bin", f"{prefix}_rank{r}.bin is missing (process {r})")
            for r in sorted(expected - have)[:LISTED_ABSENT]
        ]
    return problems


def _read_rng(url: str, name: str, files: Mapping[str, int]) -> Any:
    """What a random_states file holds (its `data.pkl` only), or None when it is unreadable."""
    try:
        return open_torch_pickle(io.join(url, name), files.get(name)).root
    except CkptctlError:
        return None


def _pickle_problems(url: str, name: str, size: int) -> list[Problem]:
    """A torch.save file that does not parse with the allowlist or lacks a storage; a random_states file
    without the RNG states load_state restores."""
    opened, problems = torch_file_problems(name, partial(open_torch_pickle, io.join(url, name), size))
    if opened is None:
        return problems
    if RNG_FILE.match(name):
        root = opened.root
        lacking = [k for k in _RNG_KEYS if not isinstance(root, dict) or k not in root]
        if lacking:
            problems.append(
                Problem(
                    ProblemKind.BAD_METADATA,
                    name,
                    f"{name} lacks {', '.join(lacking)}: load_state would skip every RNG state of this process",
                )
            )
    return problems


def _tensor_index(
    url: str, parts: SaveStateParts, files: Mapping[str, int], tag: DeepSpeedTag | None
) -> tuple[TensorEntry, ...]:
    entries: list[TensorEntry] = []
    for index, name in sorted(parts.models.items()):
        component, prefix = (Component.MODEL, "") if index == 0 else (Component.EXTRA, f"model_{index}.")
        if name.endswith(".safetensors"):
            found = safetensors_index(url, [name], files)
            entries += [replace(e, name=prefix + e.name, component=component) for e in found]
        else:
            entries += pickle_entries(open_torch_pickle(io.join(url, name), files[name]), prefix, component)
    for index, name in sorted(parts.optimizers.items()):
        prefix = "optimizer." if index == 0 else f"optimizer_{index}."
        entries += pickle_entries(open_torch_pickle(io.join(url, name), files[name]), prefix, Component.OPTIMIZER)
    if tag is not None:
        folder = parts.ds_tags[0]
        inner = tag_index(tag, f"{folder}/")
        entries += [e for e in inner if not (parts.models and e.component is Component.MODEL)]
    if parts.dcp_models or parts.dcp_optimizers:
        from ckptctl.families.dcp_folder import dcp_tensor_index, one_component

        # The first model's folder only: every model's DCP keys start `model.`, so the others' tensors would
        # read as duplicates of its own (they are verified, not indexed).
        if 0 in parts.dcp_models and not parts.models:
            folder = parts.dcp_models[0]
            entries += dcp_tensor_index(io.join(url, folder), one_component(Component.MODEL), f"{folder}/")
        for _, folder in sorted(parts.dcp_optimizers.items()):
            entries += dcp_tensor_index(io.join(url, folder), one_component(Component.OPTIMIZER), f"{folder}/")
    return tuple(entries)
