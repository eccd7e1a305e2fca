"""A training state saved as one dict, told by its top-level keys (DESIGN §1, the generic reader).

Frameworks ckptctl was never taught save their whole state as one `torch.save` of a dict: LitGPT's
`{"model", "optimizer", "iter_num", "step_count"}`, torchtune's recipe state `{"optimizer", "epochs_run",
"seed", ...}`, nanoGPT's `{"model", "optimizer", "iter_num", "config"}`, Composer's `{"state": {"model",
"optimizers", "schedulers", "timestamp", "rng"}}`, and plain loops' `{"model_state_dict", "optimizer_state_dict",
"epoch"}`. The keys below say what each entry is; the counters among them are what a resume continues from.
A dict under a single wrapper key (Composer's `state`) is looked into.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptctl.checkpoint import Component
from ckptctl.formats.framework_classes import FrameworkClasses
from ckptctl.formats.safe_pickle import StandIn

__all__ = [
    "COUNTER_KEYS",
    "LONG_TAIL_LIBRARIES",
    "MODEL_WRAPPER_PREFIXES",
    "TOP_LEVEL_KEYS",
    "TrainingState",
    "model_name",
    "read_training_state",
]

#: The ML libraries whose objects training states of the long tail pickle (configs, enums, time counters): a
#: class of theirs that no allowlist holds is an unsupported class (read as an opaque value by the generic
#: reader), never the sign of a forged file. The framework packages name their own libraries.
LONG_TAIL_LIBRARIES = FrameworkClasses(
    packages=frozenset(
        {"omegaconf", "hydra", "torchtune", "composer", "litgpt", "lit_gpt", "lightning_fabric", "pytorch_lightning"}
        | {"lightning", "peft", "trl", "transformers", "accelerate", "deepspeed", "megatron", "verl", "torchtitan"}
        | {"safetensors", "tokenizers", "datasets", "timm", "torchvision", "torchmetrics", "apex", "fairscale"}
        | {"colossalai", "streaming", "nemo", "areal", "openrlhf", "open_instruct", "roll", "sentencepiece"}
        | {"bytecheckpoint", "wandb", "tensorboard", "scipy", "sklearn", "pandas", "bitsandbytes", "torchao"}
    )
)

#: Top-level keys and the component each holds (one dict per key; `*_state_dict` spellings of plain loops).
TOP_LEVEL_KEYS: Mapping[str, Component] = {
    **dict.fromkeys(("model", "state_dict", "module", "model_state_dict", "model_state"), Component.MODEL),
    **dict.fromkeys(
        ("optimizer", "optim", "optimizers", "optimizer_state_dict", "optimizer_state"), Component.OPTIMIZER
    ),
    **dict.fromkeys(("scheduler", "lr_scheduler", "schedulers", "scheduler_state_dict"), Component.SCHEDULER),
    **dict.fromkeys(("rng", "rng_state", "rng_states", "rng_state_dict"), Component.RNG),
    **dict.fromkeys(("dataloader", "sampler", "data_loader", "train_dataloader"), Component.DATALOADER),
    **dict.fromkeys(("config", "model_config", "args", "hyper_parameters", "hparams"), Component.CONFIG),
}

#: Counters a resume continues from (LitGPT `iter_num`/`step_count`, torchtune `epochs_run`/`steps_run`,
#: Composer `timestamp`, plain loops' `step`/`epoch`): each, or a dict of them (Composer's `timestamp`),
#: makes the state's trainer state.
COUNTER_KEYS = (
    "step",
    "global_step",
    "iter_num",
    "iteration",
    "step_count",
    "steps_run",
    "total_steps",
    "epoch",
    "epochs_run",
    "total_epochs",
    "timestamp",
    "consumed_samples",
    "samples_seen",
)
#: Counters that are the global step, and the epoch, best first.
_STEP_KEYS = ("global_step", "step", "iter_num", "iteration", "steps_run", "step_count")
_EPOCH_KEYS = ("epoch", "epochs_run")
#: Prefixes training wrappers put before a model's own names: DDP/DeepSpeed `module.`, torch.compile's
#: `_orig_mod.`, FSDP1's `_fsdp_wrapped_module.`.
MODEL_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")
#: Single wrapper keys around the whole state (Composer).
_WRAPPERS = ("state",)


@dataclass(frozen=True, slots=True)
class TrainingState:
    """What the top-level keys of a saved dict say.

    Attributes:
        prefix: the wrapper key the state sits under (`state.` for Composer), or "".
        components: each recognised top-level key -> its component.
        counters: the scalar counters it holds, by key (`timestamp.batch` for a dict of them).
    """

    prefix: str = ""
    components: Mapping[str, Component] = field(default_factory=dict)
    counters: Mapping[str, int | float] = field(default_factory=dict)

    @property
    def recognised(self) -> bool:
        return bool(self.components) or bool(self.counters)

    @property
    def step(self) -> int | None:
        return _first_int(self.counters, _STEP_KEYS + tuple(f"timestamp.{k}" for k in ("batch", "step")))

    @property
    def epoch(self) -> float | None:
        found = _first_int(self.counters, (*_EPOCH_KEYS, "timestamp.epoch"))
        return None if found is None else float(found)

    def component_of(self, name: str) -> Component:
        """The component of a tensor by its dotted path (`model.0.weight`, `optimizer.state.0.exp_avg`)."""
        head = name.removeprefix(self.prefix).partition(".")[0]
        return self.components.get(head, Component.EXTRA)


def read_training_state(root: Any) -> TrainingState:
    """The training state a saved object is, by its top-level keys (empty for anything else)."""
    prefix = ""
    outer: dict[Any, Any] = {}
    if isinstance(root, dict) and len(root) <= 4:
        inner = next((root[k] for k in _WRAPPERS if isinstance(root.get(k), dict)), None)
        if inner is not None and any(k in TOP_LEVEL_KEYS for k in inner):
            # Composer: `{"state": {...}, "rng": [...]}`: the wrapper's keys, and the others beside it.
            prefix, outer, root = "state.", {k: v for k, v in root.items() if k not in _WRAPPERS}, inner
    if not isinstance(root, dict):
        return TrainingState()
    components = {key: TOP_LEVEL_KEYS[key] for key in root if type(key) is str and key in TOP_LEVEL_KEYS}
    components |= {key: TOP_LEVEL_KEYS[key] for key in outer if type(key) is str and key in TOP_LEVEL_KEYS}
    counters: dict[str, int | float] = {}
    for key in COUNTER_KEYS:
        value = _scalar(root.get(key))
        if value is not None:
            counters[key] = value
        elif isinstance(root.get(key), (dict, StandIn)):  # Composer's Timestamp: epoch, batch, sample, token
            fields = root[key] if isinstance(root[key], dict) else getattr(root[key], "state", None)
            if isinstance(fields, dict):
                for name, inner_value in list(fields.items())[:16]:
                    number = _scalar(inner_value)
                    if type(name) is str and number is not None:
                        counters[f"{key}.{name.lstrip('_')}"] = number
    if counters:
        components.setdefault("(counters)", Component.TRAINER_STATE)
    return TrainingState(prefix, components, counters)


def model_name(name: str, state: TrainingState) -> str:
    """A model tensor's own name: its top-level key and the wrappers' prefixes removed (`model.module.0.weight`
    -> `0.weight`)."""
    stripped = name.removeprefix(state.prefix).partition(".")[2] or name
    changed = True
    while changed:
        changed = False
        for prefix in MODEL_WRAPPER_PREFIXES:
            if stripped.startswith(prefix) and len(stripped) > len(prefix):
                stripped, changed = stripped[len(prefix) :], True
    return stripped


def _scalar(value: Any) -> int | float | None:
    if type(value) is int or type(value) is float:
        return value
    item = getattr(value, "value", None)  # a numpy scalar's stand-in
    return item if type(item) in (int, float) else None


def _first_int(counters: Mapping[str, int | float], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = counters.get(key)
        if value is not None and float(value).is_integer() and 0 <= value < 1 << 62:
            return int(value)
    return None
