"""What the Trainer's resume (`trainer.train(resume_from_checkpoint=...)`) reads of a `checkpoint-N`: its load set
(`contract.load_set`), decided from the checkpoint's own facts.

Read from transformers 5.24 (`trainer.py`): `Trainer._save_checkpoint` writes the model (`save_model`, whose
`_save` writes `training_args.bin` too), then, unless `save_only_model`, the optimizer and scheduler
(`_save_optimizer_and_scheduler`), the scaler (`_save_scaler`) and the RNG state (`_save_rng_state`), and
`trainer_state.json` last. What its resume does without each:

- `trainer_state.json`: `Trainer.train` reads it with `TrainerState.load_from_json`, which fails.
- `optimizer.pt` and `scheduler.pt`: `Trainer._load_optimizer_and_scheduler` loads both only when both are there,
  and neither otherwise, without a word: the run goes on with a fresh optimizer and a restarted schedule. Under
  DeepSpeed the optimizer is the tag's (`deepspeed_load_checkpoint`), and `scheduler.pt` is only written and
  read (`torch.load`, which fails without it) for a scheduler DeepSpeed does not own.
- `scaler.pt`: `Trainer._load_scaler` loads it when it is there: without it the fp16 loss scale restarts, silently.
- `rng_state.pth` / `rng_state_{process}.pth`: `Trainer._load_rng_state` logs that it found none and goes on
  (a warning).
- the model: `Trainer._load_from_checkpoint` raises "Can't find a valid checkpoint" without weights; a PEFT model's
  adapter is read by `PeftModel.load_adapter` (its `adapter_config.json` and weights); `config.json`, when there,
  is parsed (`PreTrainedConfig.from_json_file`). Under DeepSpeed, `deepspeed_load_checkpoint` has the engine
  read `latest` and the tag it names, and raises when that finds nothing.
- `training_args.bin`: the resume does not read it (the run's arguments are the caller's), so it goes on without
  it: a warning. But `_save` writes it with every checkpoint before `trainer_state.json`: a checkpoint without it
  lost a file, and whether it saved its optimizer (`save_only_model`) cannot be read from it.

Whether the save wrote the training state at all is the checkpoint's own fact: any of its state files, else
`training_args.bin`'s `save_only_model`, else (with `training_args.bin` gone too) the sibling checkpoints of
the same `output_dir`, said so in the message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Component
from ckptctl.contract.base import absent_numbers
from ckptctl.contract.load_set import LoadMember, MemberKind, Need
from ckptctl.families.lora.adapter import ADAPTER_WEIGHTS
from ckptctl.families.lora.settings import ADAPTER_CONFIG
from ckptctl.frameworks.hf_trainer.files import CHECKPOINT_DIR, RNG_FILE, TRAINER_STATE_NAME
from ckptctl.io import DirEntry
from ckptctl.layouts import peek, peek_dir

__all__ = ["TRAINING_ARGS", "TrainerFacts", "trainer_members"]

TRAINING_ARGS = "training_args.bin"
#: What `_save_checkpoint` writes only when not `save_only_model` (besides the DeepSpeed tag and FSDP folders).
_STATE_FILES = frozenset({"optimizer.pt", "scheduler.pt", "scaler.pt"})
_LOAD_OPTIMIZER = "transformers Trainer._load_optimizer_and_scheduler"


@dataclass(frozen=True, slots=True)
class TrainerFacts:
    """What a `checkpoint-N` holds, as far as its load set depends on it.

    Attributes:
        names: its top-level files.
        ds_tag: its DeepSpeed tag folder, if any.
        fsdp_optimizer: whether it holds an FSDP `optimizer_N/` folder.
        fsdp_model: whether it holds an FSDP `pytorch_model_fsdp_N/` folder.
        state_saved: why the save wrote the training state (the optimizer, scheduler, RNG), or "" when nothing
            says it did (`save_only_model`, or no evidence left).
        args: training_args.bin's fields (None when missing or unreadable).
        ds_scheduler: under DeepSpeed, whether the tag holds the LR scheduler (None: not read).
        ds_world: under DeepSpeed, its ranks (None: not read).
    """

    names: frozenset[str]
    ds_tag: str | None
    fsdp_optimizer: bool
    fsdp_model: bool
    state_saved: str
    args: Mapping[str, Any] | None
    ds_scheduler: bool | None = None
    ds_world: int | None = None


def state_evidence(
    url: str,
    names: frozenset[str],
    ds_tag: str | None,
    dcp_folders: Mapping[str, Component],
    args: Callable[[], Mapping[str, Any] | None],
) -> tuple[str, Mapping[str, Any] | None]:
    """Why the Trainer saved its training state into the checkpoint at `url` ("" when nothing says so), and
    training_args.bin's fields when they had to be read (`args` is asked only when the listing cannot tell)."""
    held = sorted(names & _STATE_FILES) + sorted(n for n in names if RNG_FILE.match(n))
    if ds_tag is not None:
        held.append(f"{ds_tag}/")
    held += sorted(f"{d}/" for d, c in dcp_folders.items() if c is Component.OPTIMIZER)
    if held:
        return f"it holds {', '.join(held)}", None
    fields = args()
    if fields is not None:
        said = fields.get("save_only_model")
        return ("training_args.bin says save_only_model=False" if said is False else ""), fields
    sibling = peek(io.parent_of(url), _sibling_with_state)
    if sibling and sibling != io.name_of(url):
        return f"{sibling} of the same output_dir holds it, and training_args.bin, which would say, is missing", None
    return "", None


def _sibling_with_state(url: str, entries: Sequence[DirEntry]) -> str:
    """The highest `checkpoint-N` of the output_dir `url` whose listing holds the Trainer's training state ("")."""
    numbered = sorted(
        ((int(m.group(1)), e.name) for e in entries if e.is_dir and (m := CHECKPOINT_DIR.match(e.name))), reverse=True
    )
    for _, name in numbered:
        listing = peek_dir(io.join(url, name)) or []
        files = {e.name for e in listing if not e.is_dir}
        if files & _STATE_FILES or any(RNG_FILE.match(n) for n in files):
            return name
    return ""


def trainer_members(facts: TrainerFacts) -> list[LoadMember]:
    """The files the Trainer's resume reads of a checkpoint with these facts (see the module docstring)."""
    names = facts.names
    members = [
        LoadMember(
            TRAINER_STATE_NAME,
            MemberKind.JSON,
            "the trainer state (step, epoch, callbacks)",
            "transformers Trainer.train (TrainerState.load_from_json)",
        ),
        LoadMember(
            TRAINING_ARGS,
            MemberKind.TORCH_SAVE,
            "the training arguments",
            "transformers Trainer._save",
            Need.WARNS,
            missing="the Trainer writes it with every checkpoint before trainer_state.json (Trainer._save), so this "
            "folder lost a file; the resume does not read it, but whether the save kept its optimizer "
            "(save_only_model) can no longer be read from it",
        ),
    ]
    if ADAPTER_CONFIG in names or any(w in names for w in ADAPTER_WEIGHTS):
        weights = next((w for w in ADAPTER_WEIGHTS if w in names), ADAPTER_WEIGHTS[0])
        read_by = "transformers Trainer._load_from_checkpoint (PeftModel.load_adapter)"
        members += [
            LoadMember(ADAPTER_CONFIG, MemberKind.JSON, "the PEFT adapter's config", read_by),
            LoadMember(weights, _kind(weights), "the PEFT adapter's weights", read_by),
        ]
    if "config.json" in names and facts.ds_tag is None:
        members.append(
            LoadMember(
                "config.json",
                MemberKind.JSON,
                "the model config",
                "transformers Trainer._load_from_checkpoint (PreTrainedConfig.from_json_file)",
            )
        )
    if facts.ds_tag is not None or (facts.args or {}).get("deepspeed"):
        members.append(
            LoadMember(
                "latest",
                MemberKind.FILE,
                "DeepSpeed's `latest` (the tag to load)",
                "transformers deepspeed_load_checkpoint (DeepSpeedEngine.load_checkpoint)",
            )
        )
    if not facts.state_saved:
        return members
    deepspeed = facts.ds_tag is not None
    if not deepspeed and not facts.fsdp_optimizer:
        members.append(
            LoadMember(
                "optimizer.pt",
                MemberKind.TORCH_SAVE,
                "the optimizer state",
                _LOAD_OPTIMIZER,
                missing=f"{_LOAD_OPTIMIZER} then loads neither optimizer nor scheduler and resumes with a fresh "
                f"optimizer, without a word (the save wrote its training state: {facts.state_saved})",
            )
        )
    if not deepspeed or facts.ds_scheduler is False:
        members.append(
            LoadMember(
                "scheduler.pt",
                MemberKind.TORCH_SAVE,
                "the LR scheduler state",
                _LOAD_OPTIMIZER,
                missing=(
                    f"{_LOAD_OPTIMIZER} then loads neither optimizer nor scheduler: the run resumes with a fresh "
                    f"optimizer and a restarted schedule, without a word (the save wrote its training state: "
                    f"{facts.state_saved})"
                    if not deepspeed
                    else f"{_LOAD_OPTIMIZER} torch.loads it for a scheduler DeepSpeed does not own, and fails"
                ),
            )
        )
    if not deepspeed and (facts.args or {}).get("fp16") is True:
        members.append(
            LoadMember(
                "scaler.pt",
                MemberKind.TORCH_SAVE,
                "the fp16 gradient scaler state",
                "transformers Trainer._load_scaler",
                missing="transformers Trainer._load_scaler loads it only when present: the loss scale restarts, "
                "without a word (training_args say fp16=True)",
            )
        )
    members += _rng_members(names, facts.ds_world)
    return members


def _rng_members(names: frozenset[str], ds_world: int | None) -> list[LoadMember]:
    """`rng_state.pth` for one process, `rng_state_{i}.pth` for each of several (`Trainer._save_rng_state`); how many
    processes there were: the files' own numbers, else the DeepSpeed tag's ranks, else one."""
    ranks = sorted(int(m.group(1)) for n in names if (m := RNG_FILE.match(n)) and m.group(1) is not None)
    world = max(ranks) + 1 if ranks else (ds_world or 1)
    if "rng_state.pth" in names and not ranks:
        world = 1
    if world == 1:
        paths = ["rng_state.pth"]
    else:
        listed, _ = absent_numbers(ranks, world)
        paths = [f"rng_state_{i}.pth" for i in sorted({*ranks, *listed})]
    return [
        LoadMember(
            path,
            MemberKind.TORCH_SAVE,
            "the RNG state",
            "transformers Trainer._load_rng_state (it logs that it found none and goes on: reproducibility is lost)",
            Need.WARNS,
        )
        for path in paths
    ]


def torn_note(facts: TrainerFacts) -> str:
    """Why a checkpoint with these facts is torn, from its top-level listing alone ("" when nothing is missing
    there): the files its load set requires at the top that it lacks."""
    missing = [
        m.path
        for m in trainer_members(facts)
        if m.need is Need.REQUIRED and "/" not in m.path and m.path not in facts.names and m.path != TRAINER_STATE_NAME
    ]
    if not missing:
        return ""
    state = [path for path in missing if path in _STATE_FILES]
    why = f" (the save wrote its training state: {facts.state_saved})" if state else ""
    return f"torn: {', '.join(missing)} missing{why}"


def _kind(name: str) -> MemberKind:
    return MemberKind.SAFETENSORS if name.endswith(".safetensors") else MemberKind.TORCH_SAVE
