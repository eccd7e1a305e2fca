"""A run-level state file beside model folders: what makes the newest of them resumable (the generic reader).

Some fine-tuning libraries save the model of each epoch as a plain model folder and the rest of the training
state once, beside them: torchtune writes `epoch_N/` HF model folders and `recipe_state.pt` (optimizer state,
`epochs_run`, `seed`, `total_epochs`, `max_steps_per_epoch`) next to them; scripts built on transformers keep a
`trainer_state.json` (`global_step`, `epoch`) beside their exports. Such a file belongs to no one folder: the
run walker attaches it to the newest model folder beside it (`CheckpointRef.run_state`), and `resume-plan`
opens the two together (`with_run_state`): the model from the folder, everything else from the state file.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Component, Problem, Role
from ckptctl.contract.resume import ResumeProfile, generic_profile
from ckptctl.errors import CkptctlError
from ckptctl.formats.documents import as_real, as_whole, read_json
from ckptctl.io import DirEntry

__all__ = [
    "RUN_STATE_NAMES",
    "attach_run_state",
    "run_state_files",
    "run_state_problems",
    "run_state_profile",
    "with_run_state",
]

#: Names of run-level state files: torchtune's `recipe_state.pt` (and `recipe_state_{epoch}.pt` of older
#: releases), transformers-style `trainer_state.json`, and the `training_state.pt` some loops write beside
#: their exports.
RUN_STATE_NAMES = re.compile(r"^(?:recipe_state.*\.pt|trainer_state\.json|train(?:ing)?_state.*\.pt)$")


def run_state_files(entries: Sequence[DirEntry]) -> list[str]:
    """The names of the run-level state files of a folder that holds child folders (sorted); none without."""
    if not any(e.is_dir for e in entries):
        return []
    return sorted(e.name for e in entries if not e.is_dir and RUN_STATE_NAMES.match(e.name))


def attach_run_state(
    url: str, names: Sequence[str], children: Sequence[CheckpointRef], model_only: Callable[[CheckpointRef], bool]
) -> list[CheckpointRef] | None:
    """`children` (the checkpoints found below the folder `url`) with the run state file `names[0]` attached to
    the newest complete model folder (`model_only`: a layout that holds model weights only) directly inside
    `url` (by step, then epoch, then time); None when there is none (the caller lists the file as unknown then).
    A folder of training checkpoints (an HF Trainer `output_dir` with its `trainer_state.json`) is left as it is:
    its checkpoints resume by their own rules."""
    direct = [ref for ref in children if io.parent_of(ref.url) == url and ref.state is CheckpointState.COMPLETE]
    if not direct or not all(model_only(ref) for ref in direct):
        return None
    if not names or not direct:
        return None
    newest = max(direct, key=_position)
    state = io.join(url, names[0])
    return [replace(ref, run_state=state) if ref is newest else ref for ref in children]


def _position(ref: CheckpointRef) -> tuple[int, float, float]:
    created = ref.created.timestamp() if ref.created else 0.0
    return (ref.step if ref.step is not None else -1, ref.epoch if ref.epoch is not None else -1.0, created)


def run_state_profile(profile: ResumeProfile, ref: CheckpointRef) -> ResumeProfile:
    """How a model folder resumes with the run state beside it: restored from both (no framework rules known)."""
    framework = f"{profile.framework} + {io.name_of(ref.run_state)}"
    return replace(generic_profile(framework), world_size=profile.world_size)


def with_run_state(checkpoint: Checkpoint) -> Checkpoint:
    """`checkpoint` (a model folder) with what its run state file holds: components, counters (step and epoch
    where the folder's name gives none), and the training role.

    Raises:
        CkptctlError: the state file cannot be read (a refused pickle, a damaged file).
    """
    url = checkpoint.ref.run_state
    if url.endswith(".json"):
        components, counters = _json_state(url)
    else:
        components, counters = _torch_state(url)
    from ckptctl.contract.training_state import TrainingState

    facts = TrainingState(counters=counters)
    ref = replace(
        checkpoint.ref,
        step=checkpoint.ref.step if checkpoint.ref.step is not None else facts.step,
        epoch=checkpoint.ref.epoch if checkpoint.ref.epoch is not None else facts.epoch,
    )
    metadata = {**checkpoint.metadata, "run state": io.name_of(url)}
    metadata.update({f"counter {key}": value for key, value in counters.items()})
    return replace(
        checkpoint,
        ref=ref,
        components=checkpoint.components | components,
        metadata=metadata,
        progress={**checkpoint.progress, **counters},
        role=Role.TRAINING,
    )


def run_state_problems(url: str) -> list[Problem]:
    """What is wrong with a run state file, each problem naming it: a torch.save file verified whole (its pickle
    through the allowlist, every storage inside the file), a JSON file parsed."""
    name = io.name_of(url)
    try:
        if url.endswith(".json"):
            read_json(url)
            return []
        from ckptctl.layouts.single_file import TorchFile

        layout = TorchFile()
        found = layout.verify(layout.open(url))
    except CkptctlError as exc:
        found = [Problem.from_error(exc, "")]
    return [replace(p, path=name, message=f"{name}: {p.message}") for p in found]


def _torch_state(url: str) -> tuple[frozenset[Component], dict[str, int | float]]:
    from ckptctl.layouts.single_file import TorchFile

    opened = TorchFile().open(url)
    return opened.components - {Component.EXTRA}, {k: v for k, v in opened.progress.items() if type(v) in (int, float)}


def _json_state(url: str) -> tuple[frozenset[Component], dict[str, int | float]]:
    doc: Any = read_json(url)
    counters: dict[str, int | float] = {}
    if isinstance(doc, dict):
        for key in ("global_step", "step", "epoch", "epochs_run"):
            value = as_whole(doc.get(key)) if key != "epoch" else as_real(doc.get(key))
            if value is not None:
                counters[key] = value
    return (frozenset({Component.TRAINER_STATE}) if counters else frozenset()), counters
