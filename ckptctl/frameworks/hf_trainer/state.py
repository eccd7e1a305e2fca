"""The training state of a Hugging Face Trainer `checkpoint-N` (model.safetensors or its shards + optimizer.pt),
parameter by parameter (`TrainingStateSource`): what `reshard --to dcp` reads.

The Trainer saves `optimizer.state_dict()` (torch's own, keyed by parameter index) of the optimizer
`Trainer.create_optimizer` builds in two groups (transformers 5.24 trainer.py, `optimizer_grouped_parameters`):
first the trainable parameters `get_decay_parameter_names(model)` names (weight decay `args.weight_decay`), then the
other trainable ones (no decay), each in `named_parameters()` order. Which group a parameter is in depends on module
types (`nn.LayerNorm`) as well as names, so ckptctl does not guess it: transformers' own code says. The class
config.json names is built from that config on the meta device (no weights; nothing of the checkpoint runs: only
classes transformers itself ships are built, and a config with `auto_map`, code shipped with the model, is refused),
transformers' `Trainer.get_decay_parameter_names` splits its parameters, and the saved groups must number exactly
those, in order, with the settings the Trainer gives them and every state tensor of its parameter's shape
(`families.param_state.grouped_state`). Without transformers importable it is refused.

optimizer.pt is read with ckptctl's safe unpickler (its `data.pkl`; tensors through the checkpoint's index).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, Component, TensorEntry
from ckptctl.contract.capabilities import NotCarried, ParamState, StateTensor
from ckptctl.errors import CkptctlError
from ckptctl.families.hf_model_class import build_on_meta, excess_layers, has_transformers_5, model_class
from ckptctl.families.param_state import grouped_state, indexed_optimizer, stored_tensor
from ckptctl.formats.documents import read_json
from ckptctl.formats.safe_pickle import FrameworkObject
from ckptctl.formats.torch_pickle import open_torch_pickle
from ckptctl.formats.torch_pickle_classes import TensorRef
from ckptctl.frameworks.hf_trainer.files import RNG_FILE, TRAINER_STATE_NAME
from ckptctl.frameworks.hf_trainer.layout import TrainerParts, training_args_fields

__all__ = ["SOURCE"]

_OPTIMIZER = "optimizer.pt"
_CONFIG = "config.json"
_ARGS = "training_args.bin"
#: The `optim` settings of TrainingArguments that make `create_optimizer` build torch's own AdamW.
_TORCH_ADAMW = frozenset({"adamw_torch", "adamw_torch_fused"})
_BUILT = "the Trainer's create_optimizer (get_decay_parameter_names: decay, then no decay)"
_HINT = (
    "the Trainer's groups are proved for the optimizer its create_optimizer builds, over a model of the class "
    "config.json names with every parameter trainable; reshard a state saved with get_optimizer_state_dict instead"
)


def SOURCE(checkpoint: Checkpoint) -> ParamState:
    url = checkpoint.url
    files = checkpoint.files
    parts = TrainerParts.of(url, io.list_dir(url))
    _refuse_other_saves(url, parts, files)
    args = training_args_fields(url, files[_ARGS]) if _ARGS in files else None
    if args is None:
        raise CkptctlError(
            f"{io.join(url, _ARGS)} is missing or unreadable: the optimizer's settings cannot be checked"
        )
    optim = _plain(args.get("optim"))
    if optim not in _TORCH_ADAMW:
        raise CkptctlError(
            f"{url}: the Trainer used optim={optim!r}; only torch's AdamW ({', '.join(sorted(_TORCH_ADAMW))}) is "
            "read, whose state an FSDP2 trainer's AdamW loads"
        )
    config_url = io.join(url, _CONFIG)
    if _CONFIG not in files:
        raise CkptctlError(f"{config_url} is missing: the model whose parameters the optimizer numbers is unknown")
    index = checkpoint.tensor_index()
    saved_tensors = sum(entry.component is Component.MODEL for entry in index)
    shapes, members, tied = _trainer_groups(read_json(config_url), config_url, saved_tensors)
    model = _model_rows(url, index, shapes, tied)
    optimizer_url = io.join(url, _OPTIMIZER)
    entries = {entry.name: entry for entry in index if entry.component is Component.OPTIMIZER}
    root = open_torch_pickle(optimizer_url, files[_OPTIMIZER]).root
    state, groups = indexed_optimizer(
        root, optimizer_url, lambda name: stored_tensor(url, _entry(entries, name, optimizer_url)), (TensorRef,)
    )
    _check_group_settings(groups, args, optimizer_url)
    optimizer, param_groups = grouped_state(members, dict(model), state, groups, optimizer_url, _BUILT, _HINT)
    return ParamState(tuple(model), optimizer, param_groups, _not_carried(checkpoint, args), tuple(tied.items()))


def _refuse_other_saves(url: str, parts: TrainerParts, files: Mapping[str, int]) -> None:
    """Refuse the checkpoints whose optimizer state is not a plain optimizer.pt of the whole model."""
    if parts.adapter_weights is not None:
        raise CkptctlError(
            f"{url}: the Trainer trained a PEFT model: the checkpoint holds the adapter and its optimizer state, "
            "not a model's"
        )
    if parts.ds_tag is not None:
        raise CkptctlError(f"{url}: the optimizer state is DeepSpeed's ({parts.ds_tag}/), not an optimizer.pt")
    if parts.dcp_folders:
        folders = ", ".join(f"{name}/" for name in sorted(parts.dcp_folders))
        raise CkptctlError(
            f"{url}: FSDP saved the state as DCP folders ({folders}), not as an optimizer.pt",
            "reshard those folders as DCP checkpoints",
        )
    if _OPTIMIZER not in files:
        raise CkptctlError(f"{url}: no {_OPTIMIZER} (saved with save_only_model?): there is no optimizer state")


def _trainer_groups(
    config: Any, config_url: str, saved_tensors: int
) -> tuple[dict[str, tuple[int, ...]], tuple[list[str], list[str]], dict[str, str]]:
    """What transformers' own code makes of the model config.json describes: the shape of every tensor of its state
    dict (in order), the names `create_optimizer` puts in its decay and no-decay groups (in order), and each tied
    copy's name -> the parameter it is (named_parameters gives one name per parameter).

    Raises:
        CkptctlError: transformers is not importable, the config names code shipped with the model, a class
            transformers does not ship or more layers than the checkpoint's tensors make up, or transformers cannot
            build the model from it.
    """
    if not isinstance(config, dict):
        raise CkptctlError(f"{config_url}: not a JSON object")
    if "auto_map" in config:
        raise CkptctlError(
            f"{config_url}: the model's code ships with the checkpoint (auto_map); ckptctl never runs it, so "
            "the Trainer's parameter groups cannot be proved"
        )
    if not has_transformers_5():
        raise CkptctlError(
            f"{config_url}: which parameters the Trainer put in which optimizer group is proved with transformers' "
            "own code (5 or later), which is not importable here: install transformers"
        )
    notes: list[str] = []
    found = model_class(config, notes)
    if found is None:
        why = notes[0].partition(":")[0]  # the note's first half: no architecture named, or no such class
        raise CkptctlError(f"{config_url}: {why}, so the Trainer's parameter groups cannot be proved")
    architecture, cls = found
    excess = excess_layers(config, saved_tensors)
    if excess is not None:
        raise CkptctlError(f"{config_url}: {excess}, more than the {saved_tensors} saved tensors make up")
    from transformers import Trainer

    try:
        model = build_on_meta(cls, config)
        # Bound to a bare Trainer: the method reads the model only (no arguments, no accelerator to set up).
        decay = set(Trainer.__new__(Trainer).get_decay_parameter_names(model))
    except Exception as exc:  # transformers' own errors, whatever they are: the proof cannot be made
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        raise CkptctlError(
            f"{config_url}: transformers cannot build {architecture} from it on the meta device "
            f"({type(exc).__name__}: {first_line})"
        ) from exc
    parameters = list(model.named_parameters())
    members = (
        [name for name, p in parameters if name in decay and p.requires_grad],
        [name for name, p in parameters if name not in decay and p.requires_grad],
    )
    first_name = {id(p): name for name, p in parameters}
    state_dict = model.state_dict(keep_vars=True)
    shapes = {name: tuple(tensor.shape) for name, tensor in state_dict.items()}
    tied = {
        name: first_name[id(tensor)]
        for name, tensor in state_dict.items()
        if id(tensor) in first_name and first_name[id(tensor)] != name
    }
    return shapes, members, tied


def _model_rows(
    url: str, index: Sequence[TensorEntry], shapes: Mapping[str, tuple[int, ...]], tied: Mapping[str, str]
) -> list[tuple[str, StateTensor]]:
    """The model's state dict in its order, each tensor read from the saved weights; a tied copy, which
    save_pretrained leaves out, is its parameter's tensor."""
    saved = {entry.name: entry for entry in index if entry.component is Component.MODEL}
    if not saved:
        raise CkptctlError(f"{url}: no safetensors model weights (a checkpoint saved with save_safetensors=False?)")
    unknown = sorted(set(saved) - set(shapes))
    if unknown:
        raise CkptctlError(
            f"{url}: the saved weights hold {unknown[0]}, which the model transformers builds from config.json "
            f"lacks ({len(unknown)} such); its weights are not named as the model's",
            _HINT,
        )
    rows: list[tuple[str, StateTensor]] = []
    for name, shape in shapes.items():
        entry = saved.get(name) or saved.get(tied.get(name, ""))
        if entry is None:
            raise CkptctlError(f"{url}: the saved weights lack {name}, which the model's state dict holds")
        if entry.shape != shape:
            raise CkptctlError(
                f"{url}: {entry.name} is saved with shape {list(entry.shape)}, and the model built from config.json "
                f"has {list(shape)}"
            )
        rows.append((name, stored_tensor(url, entry)))
    return rows


def _check_group_settings(groups: Sequence[Mapping[str, Any]], args: Mapping[str, Any], where: str) -> None:
    """The weight decay `create_optimizer` gives each group: `args.weight_decay`, then 0."""
    if len(groups) != 2:
        return  # grouped_state refuses it, saying why
    wanted = (_plain(args.get("weight_decay")), 0.0)
    saved = tuple(group.get("weight_decay") for group in groups)
    if saved != wanted:
        raise CkptctlError(
            f"{where}: the groups' weight decay is {list(saved)}, and {_BUILT} gives {list(wanted)} "
            "(training_args.bin): the optimizer is not the one it builds",
            _HINT,
        )


def _entry(entries: Mapping[str, TensorEntry], name: str, where: str) -> TensorEntry:
    entry = entries.get(name)
    if entry is None:
        raise CkptctlError(f"{where}: {name} is not in the checkpoint's tensor index")
    return entry


def _plain(value: Any) -> Any:
    """A TrainingArguments field as a plain value (its enums are read as stand-ins holding their value)."""
    return value.value if isinstance(value, FrameworkObject) else value


def _not_carried(checkpoint: Checkpoint, args: Mapping[str, Any]) -> tuple[NotCarried, ...]:
    files = checkpoint.files
    step = checkpoint.ref.step
    accumulation = _plain(args.get("gradient_accumulation_steps"))
    out = []
    if "scheduler.pt" in files:
        out.append(
            NotCarried(
                "scheduler.pt",
                "the LR scheduler's state is no part of the model and optimizer state: build the Trainer's schedule "
                "before loading (it gives each group the initial_lr a dcp.load fills) and load scheduler.pt into it "
                f"after (it has stepped {step} times); the groups hold the next step's learning rate",
            )
        )
    if "scaler.pt" in files:
        out.append(NotCarried("scaler.pt", "the AMP gradient scaler's state: load it into the resuming run's scaler"))
    rng = sorted(name for name in files if RNG_FILE.match(name))
    if rng:
        out.append(
            NotCarried(
                ", ".join(rng),
                "the Python, NumPy and torch RNG states of the Trainer's processes: the resuming run seeds its own",
            )
        )
    if TRAINER_STATE_NAME in files:
        out.append(
            NotCarried(
                TRAINER_STATE_NAME,
                f"global_step {step}, epoch, log history and callbacks' state: resume the loop at step {step}",
            )
        )
    out += [
        NotCarried(
            "data loader position",
            "the Trainer records none: its resume skips the batches of the first "
            f"{step} optimizer steps ({accumulation} per step) in its seeded sampler; start the data there",
        ),
        NotCarried(
            "gradient accumulation",
            "nothing was in progress (the Trainer saves right after an optimizer step): accumulate "
            f"gradient_accumulation_steps={accumulation} micro-batches a step, as the source did",
        ),
        NotCarried(
            _ARGS, "the Trainer's settings (schedule, batch size, max_grad_norm): the resuming run sets its own"
        ),
        NotCarried(_CONFIG, "the model's config (and tokenizer files): copy them beside the output"),
    ]
    return tuple(out)
