"""`reshard --to deepspeed-universal` from a training state named parameter by parameter (`TRAINING_STATE_SOURCE`:
a DCP folder saved as `get_state_dict` gives it, e.g. an FSDP2 run's `dcp.save({"model": msd, "optim": osd})`,
ckptctl's own multi-rank checkpoints, a verl role): the universal checkpoint DeepSpeed's ZeRO-1/2 engine loads
with `"checkpoint": {"load_universal": true}` on any number of data-parallel ranks, so that an FSDP2 run
continues under DeepSpeed.

What DeepSpeed 0.19.8 reads on that load, and so what is written (nothing more, except where said):

- `DST/latest_universal` names the tag (`engine.load_checkpoint`: it raises without it). The tag is
  `global_step<N>`, N the optimizer's step.
- `DST/<tag>/mp_rank_00_model_states.pt` (`_get_all_ckpt_names` globs `mp_rank_*_model_states.pt`;
  `_load_checkpoint` reads it): `dp_world_size`, `mp_world_size` (which `SDLoaderBase.check_ckpt_list` checks
  against the number of such files), `global_steps`, `skipped_steps` (required),
  `lr_scheduler` (read when the engine has a scheduler: None, as DeepSpeed itself saves it without one).
  `module` is not read under `load_universal` (the weights come from `zero/`), so none is written;
  `global_samples` is left out and DeepSpeed counts it as `global_steps * train_batch_size`. `param_shapes`
  (the parameters per group, as DeepSpeed saves them) and `ds_version` are written for ckptctl's own
  `verify`/`inspect` of the output; DeepSpeed does not read them there.
- `DST/<tag>/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt`, each `{"cat_dim": 0, "param": full tensor}`, and
  `step.pt`, the parameter's Adam step as a 0-dim tensor (`load_hp_checkpoint_state`: every `*.pt` of the
  folder; `step` becomes the group's step, the others the flat partitions' states), the layout
  `ds_to_universal.py` writes for ZeRO-1/2.
- `DST/<tag>/zero/optimizer_state.pt` (`load_hp_checkpoint_state_from_checkpoint_dir`): `ds_version`
  (asserted by `_load_global_state`) and `param_groups`, whose every setting but `params` overwrites the
  engine's optimizer group of the same index; `params` holds the group's parameter names, which DeepSpeed
  skips. No `loss_scaler` or `clip_grad`: the engine keeps its own configuration's.

Target: ZeRO stages 1 and 2 (proved on 1 and 2 gloo ranks: tests/ops/test_reshard_dcp_to_universal.py). Not
ZeRO-3: its universal load (`stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`) sets every group's
settings to group 0's, and gives every sub-group of every group the one step tensor of
`optimizer_state_dict.state[0]`, which torch's Adam then advances in place once per sub-group, so a state with
decay and no-decay groups cannot be carried to it exactly. It reads files this output leaves out
(`zero_pp_rank_0_mp_rank_00_model_states.pt`, `optimizer_state.pt`'s `optimizer_state_dict`): a ZeRO-3 engine
fails to load it rather than load it wrongly.

`--world-size`: the output loads on any number of data-parallel ranks; it is the same for any value.

Refused, with why, before anything is written: optimizers whose per-parameter state is not Adam's (`exp_avg`,
`exp_avg_sq`, `step`: AMSGrad's `max_exp_avg_sq`, SGD's momentum, ...) or groups without Adam's `betas`;
parameters that are not float32 (DeepSpeed's masters are); a group whose parameters have different steps
(DeepSpeed keeps one per group); a parameter without optimizer state, in two groups, or whose name cannot
name a folder.

Not carried (`not_carried`): what the source lists, the LR scheduler, RNG, the data-loader position, and the
model's tensors no optimizer group holds (buffers, frozen parameters): DeepSpeed's universal load restores
the optimized parameters only. A tensor the source says is an optimized parameter (`ParamState.tied`: an HF
Trainer's `lm_head.weight` with tied embeddings) is carried as that parameter, which a DeepSpeed model that ties
them as the source did holds once (proved: tests/ops/test_reshard_trainer.py); the resume hint says so.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import (
    TRAINING_STATE_SOURCE,
    NotCarried,
    ParamState,
    ReshardRequest,
    StateTensor,
    WrittenState,
)
from ckptctl.errors import CkptctlError
from ckptctl.families.zero_tag.names import UNIVERSAL_LATEST_NAME, UNIVERSAL_STATES_DIR
from ckptctl.formats.torch_save_writer import save_torch
from ckptctl.layouts import capability

__all__ = ["RESUME_HINT", "check", "reads", "write"]

RESUME_HINT = (
    'ZeRO stage 1 or 2 with "checkpoint": {"load_universal": true} in the DeepSpeed config and a torch Adam/AdamW '
    "built with the source's parameter groups in the same order (their names are in zero/optimizer_state.pt), "
    "then engine.load_checkpoint(DST, load_lr_scheduler_states=False)"
)
#: The DeepSpeed whose universal load reads this output (written as `ds_version`, which it asserts).
DS_VERSION = "0.19.8"
#: Adam's per-parameter state, as torch's Adam and AdamW keep it, and what DeepSpeed's universal load carries.
ADAM_STATE = frozenset({"exp_avg", "exp_avg_sq", "step"})
_MOMENTS = ("exp_avg", "exp_avg_sq")
_MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIMIZER_STATE = f"{UNIVERSAL_STATES_DIR}/optimizer_state.pt"


@dataclass(frozen=True, slots=True)
class _Param:
    name: str
    master: StateTensor
    moments: tuple[tuple[str, StateTensor], ...]
    step: StateTensor | int | float


@dataclass(frozen=True, slots=True)
class _Plan:
    state: ParamState
    params: tuple[_Param, ...]
    groups: tuple[tuple[str, ...], ...]
    step: int
    #: model tensors no optimizer group holds (buffers, frozen parameters)
    outside: tuple[str, ...]
    #: (name, parameter) for each model tensor that is an optimized parameter (tied weights): carried as it
    tied: tuple[tuple[str, str], ...]


def reads(source: Checkpoint) -> bool:
    """Whether `source`'s framework names its training state parameter by parameter (`TRAINING_STATE_SOURCE`)."""
    return capability(source.layout, TRAINING_STATE_SOURCE) is not None


def check(source: Checkpoint) -> None:
    """Refuse what cannot be written as a universal checkpoint. Reads metadata, and each parameter's step (one
    number each: DeepSpeed keeps one per group).

    Raises:
        CkptctlError: why.
    """
    _plan(source)


def write(request: ReshardRequest, advance: Callable[[int], None]) -> WrittenState:
    """The universal checkpoint of `request.source` in `request.staging` (see the module), one parameter at a time."""
    plan = _plan(request.source)
    tag = f"global_step{plan.step}"
    root = os.path.join(request.staging, tag)
    os.makedirs(os.path.join(root, UNIVERSAL_STATES_DIR))
    files: list[str] = []
    written = 0

    def one(param: _Param) -> tuple[list[str], int]:
        return _write_param(param, root, tag)

    with ThreadPoolExecutor(max(1, request.workers)) as pool:
        for names, nbytes in pool.map(one, plan.params):
            files += names
            written += nbytes
            advance(nbytes)
    save_torch(_optimizer_state(plan), os.path.join(root, _OPTIMIZER_STATE))
    files.append(f"{tag}/{_OPTIMIZER_STATE}")
    save_torch(_model_states(plan, request.source), os.path.join(root, _MODEL_STATES))
    files.append(f"{tag}/{_MODEL_STATES}")
    with open(os.path.join(request.staging, UNIVERSAL_LATEST_NAME), "w") as f:
        f.write(tag)  # as ds_to_universal writes it: the folder's name, no newline
    files.append(UNIVERSAL_LATEST_NAME)
    return WrittenState(
        tensors=sum(1 + len(p.moments) for p in plan.params),
        bytes=written,
        files=tuple(files),
        world_size=request.world_size,
        not_carried=_not_carried(plan),
        resume_hint=_resume_hint(plan),
    )


def _plan(source: Checkpoint) -> _Plan:
    """The state to write, from metadata only.

    Raises:
        CkptctlError: the source cannot be carried exactly (the module's refusals).
    """
    read = capability(source.layout, TRAINING_STATE_SOURCE)
    if read is None:
        raise CkptctlError(
            f"ckptctl cannot read the training state of {source.layout} checkpoints parameter by parameter yet"
        )
    state = read(source)
    where = source.url
    model = dict(state.model)
    seen: dict[str, int] = {}
    params: list[_Param] = []
    groups: list[tuple[str, ...]] = []
    steps: list[int] = []
    for g, group in enumerate(state.param_groups):
        if "betas" not in group or "eps" not in group:
            raise CkptctlError(
                f"{where}: parameter group {g} has no betas/eps: not an Adam-family optimizer (DeepSpeed's universal "
                "load carries Adam's exp_avg, exp_avg_sq and step only)"
            )
        names = tuple(str(name) for name in group["params"])
        group_steps: dict[float, str] = {}
        for name in names:
            if name in seen:
                raise CkptctlError(f"{where}: parameter {name!r} is in groups {seen[name]} and {g}")
            seen[name] = g
            param = _param(where, name, model.get(name), state.optimizer.get(name, {}))
            group_steps.setdefault(_step_value(where, name, param.step), name)
            params.append(param)
        if len(group_steps) > 1:
            (a, first), (b, second) = list(group_steps.items())[:2]
            raise CkptctlError(
                f"{where}: parameter group {g} holds parameters at different steps ({first!r} at {a:g}, {second!r} "
                f"at {b:g}); DeepSpeed keeps one step per group"
            )
        steps += [int(s) for s in group_steps]
        groups.append(names)
    if not params:
        raise CkptctlError(f"{where}: the optimizer holds no parameters")
    tied = tuple((name, parameter) for name, parameter in state.tied if parameter in seen and name not in seen)
    copies = {name for name, _ in tied}
    outside = tuple(name for name, _ in state.model if name not in seen and name not in copies)
    return _Plan(state, tuple(params), tuple(groups), max(steps), outside, tied)


def _param(where: str, name: str, master: StateTensor | None, held: Mapping[str, StateTensor | int | float]) -> _Param:
    if master is None:
        raise CkptctlError(f"{where}: the optimizer names {name!r}, which the model lacks")
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise CkptctlError(f"{where}: parameter name {name!r} cannot name a folder")
    if master.dtype != "float32":
        raise CkptctlError(
            f"{where}: parameter {name!r} is {master.dtype}; DeepSpeed keeps float32 masters, which this state "
            "does not hold"
        )
    if not held:
        raise CkptctlError(f"{where}: the optimizer holds no state of {name!r} (it has not stepped it)")
    if set(held) != ADAM_STATE:
        raise CkptctlError(
            f"{where}: the optimizer state of {name!r} holds {', '.join(sorted(held))}: not Adam's "
            f"({', '.join(sorted(ADAM_STATE))}), the only state DeepSpeed's universal load carries"
        )
    moments = []
    for key in _MOMENTS:
        value = held[key]
        if not isinstance(value, StateTensor) or value.shape != master.shape or value.dtype != "float32":
            raise CkptctlError(f"{where}: {key} of {name!r} is not a float32 tensor of the parameter's shape")
        moments.append((key, value))
    return _Param(name, master, tuple(moments), held["step"])


def _step_value(where: str, name: str, step: StateTensor | int | float) -> float:
    """A step as a number (a tensor step is read: one element)."""
    if isinstance(step, StateTensor):
        if step.shape != ():
            raise CkptctlError(f"{where}: the step of {name!r} is a tensor of shape {step.shape}, not a number")
        value = float(step.read())
    else:
        value = float(step)
    if not value.is_integer() or value < 0:
        raise CkptctlError(f"{where}: the step of {name!r} is {value}, not a count of steps")
    return value


def _write_param(param: _Param, root: str, tag: str) -> tuple[list[str], int]:
    import torch

    folder = os.path.join(root, UNIVERSAL_STATES_DIR, param.name)
    os.makedirs(folder)
    names: list[str] = []
    nbytes = 0
    for key, tensor in (("fp32", param.master), *param.moments):
        value = _own(tensor.read())
        save_torch({"cat_dim": 0, "param": value}, os.path.join(folder, f"{key}.pt"))
        names.append(f"{tag}/{UNIVERSAL_STATES_DIR}/{param.name}/{key}.pt")
        nbytes += value.nbytes
        del value
    step = param.step
    # torch's Adam keeps its step as a float32 0-dim tensor and advances it in place: a plain number would not count.
    value = _own(step.read()) if isinstance(step, StateTensor) else torch.tensor(float(step), dtype=torch.float32)
    save_torch(value, os.path.join(folder, "step.pt"))
    names.append(f"{tag}/{UNIVERSAL_STATES_DIR}/{param.name}/step.pt")
    return names, nbytes


def _own(tensor: Any) -> Any:
    """`tensor` with a storage of its own size: torch.save writes a view's whole storage."""
    tensor = tensor.contiguous()
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


def _resume_hint(plan: _Plan) -> str:
    if not plan.tied:
        return RESUME_HINT
    ties = ", ".join(f"{name} is {parameter}" for name, parameter in plan.tied)
    first = plan.tied[0][0]
    # Observed with DeepSpeed 0.19.8: an untied model's load raises FileNotFoundError on the missing folder.
    return (
        f"{RESUME_HINT}. Tied weights ({ties}): carried as the parameter (zero/<parameter>/), so the model must tie "
        f"them as the source did (one parameter for both); a model that does not finds no zero/{first}/ and its "
        "load fails"
    )


def _optimizer_state(plan: _Plan) -> dict[str, Any]:
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": list(names)}
        for group, names in zip(plan.state.param_groups, plan.groups, strict=True)
    ]
    return {"param_groups": groups, "ds_version": DS_VERSION}


def _model_states(plan: _Plan, source: Checkpoint) -> dict[str, Any]:
    import torch

    masters = {p.name: p.master for p in plan.params}
    return {
        "dp_world_size": source.world_size or 1,
        "mp_world_size": 1,
        "global_steps": plan.step,
        "skipped_steps": 0,
        "lr_scheduler": None,
        "param_shapes": [{name: torch.Size(masters[name].shape) for name in names} for names in plan.groups],
        "ds_version": DS_VERSION,
    }


def _not_carried(plan: _Plan) -> tuple[NotCarried, ...]:
    found = list(plan.state.not_carried)
    listed = {n.what for n in found}
    found.append(
        NotCarried(
            "lr_scheduler",
            "the model states hold none (lr_scheduler None): each group's current lr is carried in its settings; "
            "an engine given an LR scheduler loads with load_lr_scheduler_states=False and sets it to the step",
        )
    )
    if "rng" not in listed:
        found.append(NotCarried("rng", "DeepSpeed's engine restores no RNG state: seed the resumed run"))
    position = (
        f"global_steps is {plan.step} (the optimizer's step) and DeepSpeed counts global_samples as "
        "global_steps x train_batch_size"
    )
    if "data loader position" in listed:  # the source's own reason says where its data stood: one entry, both
        found = [NotCarried(n.what, f"{n.why}; {position}") if n.what == "data loader position" else n for n in found]
    else:
        found.append(
            NotCarried(
                "data loader position", f"no data sampler is recorded: {position}; the training code resumes its loader"
            )
        )
    if plan.outside:
        names = ", ".join(plan.outside[:6]) + (", ..." if len(plan.outside) > 6 else "")
        found.append(
            NotCarried(
                f"buffers and frozen parameters ({names})",
                "DeepSpeed's universal load restores the optimized parameters only (from zero/<param>/fp32.pt): "
                "the model keeps these as it builds them",
            )
        )
    return tuple(found)
