"""Hugging Face Trainer checkpoints: `OUTPUT_DIR/checkpoint-{global_step}/` (LAYOUTS.md, HF Trainer).

```
checkpoint-N/
    model weights and config as an HF model folder (read with `families.hf_folder`)
    optimizer.pt, scheduler.pt, scaler.pt (AMP), rng_state.pth | rng_state_{process}.pth, training_args.bin
    trainer_state.json             written LAST: the completion marker (global_step, epoch, best_metric, ...)
    [DeepSpeed: latest, global_stepN/ (read with `families.zero_tag`)]
    [FSDP sharded: pytorch_model_fsdp_0/, optimizer_0/ (torch DCP folders, read with `families.dcp_folder`)]
    [a PEFT model: adapter_model.safetensors + adapter_config.json instead of the model (read with
     `families.lora.adapter`)]
```

A Trainer training a PEFT model saves the adapter alone (transformers 5.24 `Trainer._save`: a `PeftModel`
is saved with its own `save_pretrained`); the checkpoint's model is then that adapter (`ConvertSource.adapter`),
which `convert` merges into the base model the adapter names or `--merge-adapter BASE`.

The `.pt`/`.pth`/`.bin` files are torch.save pickles; they are read with `formats.torch_pickle` (their
`data.pkl` and zip directory only, through the allowlisting unpickler), so neither transformers nor torch
is needed and a hostile pickle is refused before anything runs.

A folder without `trainer_state.json` is a save that has not finished: in progress while its files are
fresh, broken once they are older (`families.in_progress`; transformers' resume picks the highest
`checkpoint-N` without looking, transformers#35782, and fails on such a folder).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
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
    Layout,
    Protections,
    every_child_folder,
    folder_size,
    list_files,
    newest_mtime,
    step_from_name,
    timestamp,
)
from ckptctl.contract.load_set import LoadMember
from ckptctl.errors import CkptctlError
from ckptctl.families.hf_folder import (
    has_weights,
    model_components,
    model_markers,
    model_metadata,
    safetensors_index,
    verify_model_files,
    weight_files,
)
from ckptctl.families.in_progress import missing_marker
from ckptctl.families.lora.adapter import ADAPTER_WEIGHTS, adapter_metadata, adapter_problems
from ckptctl.families.lora.settings import ADAPTER_CONFIG
from ckptctl.families.torch_file import pickle_entries
from ckptctl.families.zero_tag.names import LATEST_NAME, missing_note, read_latest, tag_files
from ckptctl.families.zero_tag.tag import DeepSpeedTag, missing_rank_files, read_tag
from ckptctl.families.zero_tag.tensor_index import tag_index
from ckptctl.families.zero_tag.verify import verify_tag
from ckptctl.formats.documents import as_real, as_whole, read_json
from ckptctl.formats.safe_pickle import FrameworkObject, StandIn, state_fields
from ckptctl.formats.torch_pickle import open_torch_pickle, storage_problems
from ckptctl.frameworks.hf_trainer.files import CHECKPOINT_DIR, RNG_FILE, TRAINER_STATE_NAME
from ckptctl.frameworks.hf_trainer.load_set import (
    TRAINING_ARGS,
    TrainerFacts,
    state_evidence,
    torn_note,
    trainer_members,
)
from ckptctl.io import DirEntry
from ckptctl.layouts import peek, peek_dir

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = ["HfTrainerLayout", "TrainerParts", "model_tensors", "training_args_fields"]

_PICKLE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "training_args.bin")
_TRAINER_FILES = frozenset({TRAINER_STATE_NAME, *_PICKLE_FILES})
_STATE_FILES = frozenset({"optimizer.pt", "scheduler.pt", "scaler.pt"})
#: trainer_state.json is written with sorted keys and indent=2, so `epoch` and `global_step` come before
#: the (possibly huge) `log_history`: `identify` reads only this much of it.
_STATE_HEAD = 4096
_HEAD_FIELD = re.compile(rb'^  "(epoch|global_step)": ([0-9.eE+-]+|null),?$', re.MULTILINE)
_FSDP_MODEL = re.compile(r"^pytorch_model_fsdp_\d+$")
_FSDP_OPTIMIZER = re.compile(r"^optimizer_\d+$")
#: TrainingArguments fields worth showing in `inspect`.
_ARGS_SUMMARY = (
    "learning_rate",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_train_epochs",
    "max_steps",
    "lr_scheduler_type",
    "optim",
    "seed",
    "bf16",
    "fp16",
    "save_steps",
    "save_total_limit",
)
_STATE_SUMMARY = (
    "max_steps",
    "num_train_epochs",
    "train_batch_size",
    "best_metric",
    "best_model_checkpoint",
    "best_global_step",
)


def _rng_ranks(names: Sequence[str]) -> list[int]:
    return sorted(int(m.group(1) or 0) for n in names if (m := RNG_FILE.match(n)))


@dataclass(frozen=True, slots=True)
class TrainerParts:
    """What a checkpoint folder holds, from its listing."""

    names: set[str]
    ds_tag: str | None
    dcp_folders: dict[str, Component]

    @classmethod
    def of(cls, url: str, entries: Sequence[DirEntry]) -> TrainerParts:
        names = {e.name for e in entries if not e.is_dir}
        dirs = [e.name for e in entries if e.is_dir]
        tag = read_latest(url, entries) if LATEST_NAME in names else None
        if tag not in dirs:
            candidates = [d for d in dirs if step_from_name(d) is not None and d.startswith("global_step")]
            tag = candidates[0] if len(candidates) == 1 else None
        dcp = {}
        for d in dirs:
            if _FSDP_MODEL.match(d):
                dcp[d] = Component.MODEL
            elif _FSDP_OPTIMIZER.match(d):
                dcp[d] = Component.OPTIMIZER
        return cls(names, tag, dcp)

    @property
    def adapter_weights(self) -> str | None:
        """The PEFT adapter's weights file when the checkpoint's model is an adapter."""
        return next((name for name in ADAPTER_WEIGHTS if name in self.names), None)

    def is_trainer_checkpoint(self) -> bool:
        return bool(
            self.names & _TRAINER_FILES or _rng_ranks(list(self.names)) or self.ds_tag is not None or self.dcp_folders
        )

    def holds_training_state(self) -> bool:
        """Whether files only `Trainer._save_checkpoint`'s training state names so are here."""
        return bool(self.names & _STATE_FILES or _rng_ranks(list(self.names)))


def _missing_tag_files(url: str, ds_tag: str | None) -> list[str]:
    """The rank files the DeepSpeed tag inside a checkpoint lacks (none without one): the Trainer's resume
    loads it whole, so a tag without them is no complete checkpoint, whatever trainer_state.json says."""
    if ds_tag is None:
        return []
    files = tag_files(peek_dir(io.join(url, ds_tag)) or [])
    return [] if files is None else missing_rank_files(io.join(url, ds_tag), files)


class HfTrainerLayout(Layout):
    """A `checkpoint-N` folder of the Hugging Face Trainer (with or without DeepSpeed/FSDP inside)."""

    name = "hf_trainer"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A ref for a `checkpoint-N` folder holding Trainer files, or holding only what a save writes first (the
        model) beside sibling Trainer checkpoints; or a folder of another name holding trainer_state.json and the
        training state (a renamed copy). Reads at most the head of trainer_state.json (for step and epoch), and
        training_args.bin's pickle only when no state file says whether the save wrote the training state.

        A checkpoint missing a file its load set requires (`load_set.trainer_members`) is broken, naming it:
        detection keys on what survives a partial write (the name, trainer_state.json, any Trainer-only file),
        so a torn Trainer checkpoint of a PEFT model is never a whole PEFT adapter."""
        m = CHECKPOINT_DIR.match(io.name_of(url))
        parts = TrainerParts.of(url, entries)
        if m is None:
            if not (TRAINER_STATE_NAME in parts.names and parts.holds_training_state()):
                return None
        elif not parts.is_trainer_checkpoint():
            # Only what a save writes first (the model) beside the run's Trainer checkpoints: a torn one of theirs. An
            # empty checkpoint-N tells nothing yet (not even when it was made).
            in_run: bool | None = peek(io.parent_of(url), _trainer_run) if parts.names else False
            if not in_run:
                return None
        step: int | None = int(m.group(1)) if m is not None else None
        epoch = None
        marker = next((e for e in entries if e.name == TRAINER_STATE_NAME and not e.is_dir), None)
        note = ""
        if marker is not None:
            state = CheckpointState.COMPLETE
            head = _read_head(io.join(url, TRAINER_STATE_NAME))
            head_step = as_whole(head.get("global_step"))
            step = step if head_step is None else head_step
            epoch = as_real(head.get("epoch"))
            created = timestamp(marker.mtime)
            if missing := _missing_tag_files(url, parts.ds_tag):
                state, note = CheckpointState.BROKEN, f"{parts.ds_tag}/: {missing_note(missing)}"
            elif torn := torn_note(_facts(url, parts, entries)):
                state, note = CheckpointState.BROKEN, torn
        else:
            newest = newest_mtime(entries)
            created = timestamp(newest)
            state, note = missing_marker(
                newest, TRAINER_STATE_NAME, "the save was interrupted (a resume that picks this folder fails)"
            )
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=step if isinstance(step, int) else None,
            epoch=epoch,
            created=created,
            state=state,
            size_bytes=folder_size(url, entries),
            note=note,
        )

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """The Trainer keeps no pointer (it resumes from the highest `checkpoint-N`)."""
        return None

    def members(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """Every child folder: the Trainer writes `checkpoint-N/` as a whole (its DeepSpeed `global_stepN/`,
        FSDP's `pytorch_model_fsdp_0/` and `optimizer_0/`, TRL's `merged/`) and its rotation deletes it
        as a whole."""
        return every_child_folder(entries)

    def open(self, url: str) -> Checkpoint:
        """Read trainer_state.json, training_args.bin's `data.pkl` and the DeepSpeed rank-0 files if any;
        the tensor index reads safetensors headers and optimizer.pt's `data.pkl`."""
        entries = io.list_dir(url)
        ref = self.identified(url, entries, "a Hugging Face Trainer checkpoint (checkpoint-N with Trainer files)")
        parts = TrainerParts.of(url, entries)
        files = list_files(url)
        top = parts.names
        weights = weight_files(url, top) if has_weights(top) else []
        metadata: dict[str, Any] = {"format": "hf_trainer"}
        components = set(model_components(top))
        trainer_state = _read_trainer_state(url) if TRAINER_STATE_NAME in top else None
        metrics: dict[str, Any] = {}
        if isinstance(trainer_state, dict):
            components.add(Component.TRAINER_STATE)
            metadata["trainer_state"] = _state_summary(trainer_state)
            metrics = _step_metrics(trainer_state)
            step, epoch = as_whole(trainer_state.get("global_step")), as_real(trainer_state.get("epoch"))
            ref = replace(ref, step=ref.step if step is None else step, epoch=ref.epoch if epoch is None else epoch)
        elif TRAINER_STATE_NAME in top:
            metadata["error"] = f"{TRAINER_STATE_NAME} does not parse"
        if weights:
            metadata.update(model_metadata(url, top, weights))
        if "optimizer.pt" in top:
            components.add(Component.OPTIMIZER)
        if "scheduler.pt" in top:
            components.add(Component.SCHEDULER)
        rng = _rng_ranks(list(top))
        if rng:
            components.add(Component.RNG)
        if "scaler.pt" in top or "training_args.bin" in top:
            components.add(Component.EXTRA)
        if "training_args.bin" in top:
            metadata["training_args"] = _args_summary(url, files["training_args.bin"])
        world_size = (max(rng) + 1) if rng else None
        tag = None
        if parts.ds_tag is not None:
            try:
                tag = read_tag(io.join(url, parts.ds_tag))
            except CkptctlError as exc:
                metadata["deepspeed_error"] = exc.message
            else:
                components |= tag.components() - {Component.TRAINER_STATE, Component.EXTRA}
                metadata["deepspeed"] = tag.summary()
                world_size = world_size or tag.world_size
        components |= set(parts.dcp_folders.values())

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            return _tensor_index(url, weights, files, tag, parts)

        if parts.adapter_weights is not None:
            metadata["model"] = "a PEFT adapter (the Trainer trained a PEFT model): convert merges it into its base"
            metadata.update(adapter_metadata(url, ADAPTER_CONFIG in top, partial(model_tensors, tensor_index)))
        return Checkpoint(
            ref=ref,
            components=frozenset(components),
            world_size=world_size,
            metadata=metadata,
            tensor_index=tensor_index,
            files=files,
            metrics=metrics,
        )

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """trainer_state.json parses; the model files pass the HF rules; every pickle parses safely and
        holds its storages; rng files cover ranks 0..n-1; DeepSpeed and DCP folders inside pass their rules."""
        url = checkpoint.url
        files = checkpoint.files
        parts = TrainerParts.of(url, io.list_dir(url))
        problems: list[Problem] = []
        if TRAINER_STATE_NAME not in files:
            problems.append(
                Problem(
                    ProblemKind.MISSING_FILE,
                    TRAINER_STATE_NAME,
                    f"{TRAINER_STATE_NAME} is missing: the Trainer writes it last, so the save did not finish",
                )
            )
        else:
            try:
                state = read_json(io.join(url, TRAINER_STATE_NAME))
                why = (
                    ""
                    if isinstance(state, dict) and as_whole(state.get("global_step")) is not None
                    else "no global_step"
                )
            except CkptctlError as exc:
                why = exc.message
            if why:
                problems.append(
                    Problem(
                        ProblemKind.BAD_METADATA, TRAINER_STATE_NAME, f"{TRAINER_STATE_NAME} does not parse ({why})"
                    )
                )
        if has_weights(parts.names):
            problems += verify_model_files(url, {n: s for n, s in files.items() if "/" not in n})
            if parts.adapter_weights is not None and not any(p.severity == "error" for p in problems):
                problems += adapter_problems(
                    url, ADAPTER_CONFIG in files, model_tensors(checkpoint.tensor_index), parts.adapter_weights
                )
        elif parts.ds_tag is None and Component.MODEL not in parts.dcp_folders.values():
            # Named as the Trainer names them by default (`Trainer._save`: `save_pretrained` with safetensors),
            # so that a script matching on the path finds the file a resume cannot do without.
            weights = "adapter_model.safetensors" if ADAPTER_CONFIG in parts.names else "model.safetensors"
            problems.append(
                Problem(
                    ProblemKind.MISSING_FILE,
                    weights,
                    f"no model weights ({weights} is missing; no DeepSpeed or FSDP save either): "
                    "Trainer._load_from_checkpoint raises without them",
                )
            )
        for name in sorted(n for n in parts.names if n in _PICKLE_FILES or RNG_FILE.match(n)):
            problems += _pickle_problems(url, name, files[name])
        if parts.ds_tag is not None:
            problems += verify_tag(io.join(url, parts.ds_tag), f"{parts.ds_tag}/", latest=True)
        from ckptctl.families.dcp_folder import verify_dcp

        for folder in sorted(parts.dcp_folders):
            problems += verify_dcp(io.join(url, folder), f"{folder}/")
        return problems

    def load_set(self, checkpoint: Checkpoint) -> Sequence[LoadMember]:
        """What the Trainer's resume reads of it (`frameworks.hf_trainer.load_set`), from its facts: whether its
        save wrote the training state, training_args (fp16, DeepSpeed), the DeepSpeed tag's scheduler and ranks."""
        url = checkpoint.url
        entries = io.list_dir(url)
        parts = TrainerParts.of(url, entries)
        facts = _facts(url, parts, entries)
        if parts.ds_tag is not None:
            try:
                tag = read_tag(io.join(url, parts.ds_tag))
            except CkptctlError:
                pass  # verify_tag reports why
            else:
                facts = replace(
                    facts,
                    ds_scheduler=tag.states.get("lr_scheduler") is not None,
                    ds_world=tag.world_size,
                )
        if facts.args is None and TRAINING_ARGS in checkpoint.files:
            facts = replace(facts, args=training_args_fields(url, checkpoint.files[TRAINING_ARGS]))
        return trainer_members(facts)

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """The model folder's markers (an adapter's config, which PEFT writes after its weights), then
        trainer_state.json, which the Trainer writes last."""
        top = {name: size for name, size in files.items() if "/" not in name}
        found = model_markers(top)
        if ADAPTER_CONFIG in top and any(name in top for name in ADAPTER_WEIGHTS):
            found = (*found, ADAPTER_CONFIG)
        return (*found, TRAINER_STATE_NAME) if TRAINER_STATE_NAME in top else found

    def protections(self, series: Sequence[CheckpointRef]) -> Protections:
        """The `best_model_checkpoint` that the newest complete checkpoint's trainer_state.json names
        (`load_best_model_at_end` loads it, and the Trainer's own rotation never deletes it)."""
        complete = [ref for ref in series if ref.state is CheckpointState.COMPLETE and ref.step is not None]
        if not complete:
            return Protections()
        newest = max(complete, key=lambda ref: ref.step or 0)
        if not io.exists(io.join(newest.url, TRAINER_STATE_NAME)):
            return Protections()
        state = _read_trainer_state(newest.url)
        best = state.get("best_model_checkpoint") if isinstance(state, dict) else None
        if not isinstance(best, str) or not best:
            return Protections()
        name = os.path.basename(os.path.normpath(best))
        named = [ref.url for ref in series if io.name_of(ref.url) == name]
        if not named:
            return Protections(
                notes=(f"the Trainer's best_model_checkpoint {name!r} is not in {io.parent_of(newest.url)}",)
            )
        return Protections(reasons=dict.fromkeys(named, ("the Trainer's best_model_checkpoint",)))

    def metric_history(self, checkpoint: Checkpoint) -> tuple[Mapping[str, object], ...]:
        """trainer_state.json's `log_history`: every `logging_steps` entry (loss, grad_norm, learning_rate, eval
        metrics) up to this checkpoint, as `Trainer._save_checkpoint` writes it (`TrainerState.save_to_json`)."""
        state = _read_trainer_state(checkpoint.url) if TRAINER_STATE_NAME in checkpoint.files else None
        history = state.get("log_history") if isinstance(state, dict) else None
        if not isinstance(history, list):
            return ()
        return tuple(h for h in history if isinstance(h, dict) and isinstance(h.get("step"), int))

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.hf_trainer.resume`."""
        from ckptctl.frameworks.hf_trainer.resume import PROFILE

        return PROFILE


def _facts(url: str, parts: TrainerParts, entries: Sequence[DirEntry]) -> TrainerFacts:
    """The facts of a checkpoint's load set its listing gives (training_args.bin read only when needed)."""
    sizes = {e.name: e.size for e in entries if not e.is_dir}

    def args() -> Mapping[str, Any] | None:
        return training_args_fields(url, sizes[TRAINING_ARGS]) if TRAINING_ARGS in sizes else None

    names = frozenset(parts.names)
    why, fields = state_evidence(url, names, parts.ds_tag, parts.dcp_folders, args)
    return TrainerFacts(
        names=names,
        ds_tag=parts.ds_tag,
        fsdp_optimizer=Component.OPTIMIZER in parts.dcp_folders.values(),
        fsdp_model=Component.MODEL in parts.dcp_folders.values(),
        state_saved=why,
        args=fields,
    )


def _trainer_run(url: str, entries: Sequence[DirEntry]) -> bool:
    """Whether the folder `url` is a Trainer output_dir: one of its `checkpoint-N` holds trainer_state.json. Its
    other `checkpoint-N` folders are then the Trainer's too, whatever a torn save left in them."""
    for entry in entries:
        if entry.is_dir and CHECKPOINT_DIR.match(entry.name):
            listing = peek_dir(io.join(url, entry.name)) or []
            if any(e.name == TRAINER_STATE_NAME and not e.is_dir for e in listing):
                return True
    return False


def _step_metrics(state: Mapping[str, Any]) -> dict[str, Any]:
    """The log_history entries of the checkpoint's own step (the Trainer evaluates right before saving)."""
    history = state.get("log_history")
    if not isinstance(history, list):
        return {}
    step = state.get("global_step")
    metrics: dict[str, Any] = {}
    for entry in history:
        if isinstance(entry, dict) and entry.get("step") == step:
            metrics.update(entry)
    return metrics


def _read_head(url: str) -> dict[str, float | int | None]:
    try:
        head = io.read_bytes(url, 0, _STATE_HEAD)
    except CkptctlError:
        return {}
    found: dict[str, float | int | None] = {}
    for key, value in _HEAD_FIELD.findall(head):
        try:
            number = json.loads(value)
        except ValueError:
            continue
        if isinstance(number, int | float) or number is None:
            found.setdefault(key.decode(), number)
    if not isinstance(found.get("global_step"), int):
        found.pop("global_step", None)
    return found


def _read_trainer_state(url: str) -> Any:
    try:
        return read_json(io.join(url, TRAINER_STATE_NAME))
    except CkptctlError:
        return None


def _state_summary(state: Mapping[str, Any]) -> dict[str, Any]:
    summary = {k: state[k] for k in _STATE_SUMMARY if k in state and state[k] is not None}
    history = state.get("log_history")
    if isinstance(history, list):
        last_train = next((h for h in reversed(history) if isinstance(h, dict) and "loss" in h), None)
        if last_train is not None:
            summary.update({k: last_train[k] for k in ("loss", "learning_rate", "grad_norm") if k in last_train})
    callbacks = state.get("stateful_callbacks")
    if isinstance(callbacks, dict) and callbacks:
        summary["stateful_callbacks"] = ", ".join(sorted(map(str, callbacks)))
    return summary


def _args_summary(url: str, size: int) -> dict[str, Any] | str:
    """The TrainingArguments fields worth showing, from training_args.bin (its `data.pkl` only)."""
    fields = training_args_fields(url, size)
    if fields is None:
        return "unreadable (verify says why)"
    summary = {}
    for key in _ARGS_SUMMARY:
        value = fields.get(key)
        if isinstance(value, FrameworkObject):
            value = value.value
        if type(value) in (int, float, str, bool):
            summary[key] = value
    if fields.get("deepspeed"):
        summary["deepspeed"] = True
    return summary


def training_args_fields(url: str, size: int) -> dict[str, Any] | None:
    """The fields of training_args.bin, or None when it is unreadable."""
    try:
        args = open_torch_pickle(io.join(url, "training_args.bin"), size).root
        return state_fields(args, "training_args.bin") if isinstance(args, StandIn) else None
    except CkptctlError:
        return None


def _pickle_problems(url: str, name: str, size: int) -> list[Problem]:
    try:
        opened = open_torch_pickle(io.join(url, name), size)
    except CkptctlError as exc:
        return [Problem.from_error(exc, name)]
    return [Problem(ProblemKind.TRUNCATED, name, message) for message in storage_problems(opened)]


def _tensor_index(
    url: str,
    weights: Sequence[str],
    files: Mapping[str, int],
    tag: DeepSpeedTag | None,
    parts: TrainerParts,
) -> tuple[TensorEntry, ...]:
    entries = list(safetensors_index(url, weights, files)) if weights else []
    if "optimizer.pt" in files:
        entries += pickle_entries(
            open_torch_pickle(io.join(url, "optimizer.pt"), files["optimizer.pt"]), "optimizer.", Component.OPTIMIZER
        )
    if tag is not None and parts.ds_tag is not None:
        inner = tag_index(tag, f"{parts.ds_tag}/")
        entries += [e for e in inner if not (weights and e.component is Component.MODEL)]
    if parts.dcp_folders:
        from ckptctl.families.dcp_folder import dcp_tensor_index, one_component

        for folder, component in sorted(parts.dcp_folders.items()):
            if weights and component is Component.MODEL:
                continue
            entries += dcp_tensor_index(io.join(url, folder), one_component(component), f"{folder}/")
    return tuple(entries)


def model_tensors(index: Callable[[], Sequence[TensorEntry]]) -> list[TensorEntry]:
    """The model's tensors of a checkpoint's index (an adapter's, beside the optimizer's)."""
    return [entry for entry in index() if entry.component is Component.MODEL]
