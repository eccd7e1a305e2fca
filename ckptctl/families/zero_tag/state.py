"""The training state of a DeepSpeed ZeRO 1-3 tag, parameter by parameter (`TrainingStateSource`): what
`reshard --to dcp` reads from a tag folder, a save folder holding `latest`, and the frameworks that hold a tag
(OpenRLHF, open-instruct), each of which declares it as its `STATE`.

What DeepSpeed 0.19 saves, and what is read from it:

- The model: the fp32 masters of the trainable parameters, unflattened from the partitions one tensor at a
  time, as `zero_to_fp32` rebuilds them (`master_weights.assemble_master_weights`: frozen parameters and
  buffers from the model states, in the module's state-dict order, stored dtypes kept).
- The optimizer: the ZeRO optimizer wraps a torch optimizer whose parameters are flat partitions, one per
  group under ZeRO 1-2 and one per sub-group under ZeRO-3 (`sub_group_size`). Its saved `param_groups` number
  those flat tensors (`params`), and the model states' `param_shapes` list, per flat tensor in the same order,
  the names of the parameters laid out in it: so each name's group is proved, never guessed. Its `state` holds,
  per flat tensor, Adam's `exp_avg` and `exp_avg_sq` (laid out as the fp32 partitions: unflattened per
  parameter by `tensor_index`) and one `step`, which every parameter of that flat tensor gets, as torch's
  Adam and AdamW keep it per parameter (a 0-dim float32 tensor; DeepSpeed's own Adams keep a plain count,
  which is given as torch's `__setstate__` converts it).

Refused, with why: no ZeRO tag, a torn tag (naming the missing file), ZeRO-0 (no partitions), model
parallelism, an optimizer with state other than Adam's (naming it), one without state (saved before its first
step), and `param_groups` that do not number exactly the flat tensors `param_shapes` describes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, TensorEntry
from ckptctl.contract.capabilities import NotCarried, ParamState, StateTensor
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.families.param_state import stored_tensor
from ckptctl.families.zero_tag.kept_masters import KEPT_MASTERS
from ckptctl.families.zero_tag.master_weights import assemble_master_weights, tag_prefix
from ckptctl.families.zero_tag.names import is_rank_file, tag_files
from ckptctl.families.zero_tag.tag import (
    DeepSpeedTag,
    base_state,
    missing_rank_files,
    optimizer_state_dict,
    read_tag,
)
from ckptctl.families.zero_tag.tensor_index import param_groups, tag_index
from ckptctl.formats.safe_pickle import StandIn, state_fields
from ckptctl.formats.torch_pickle_classes import TensorRef

__all__ = ["ADAM_STATE", "partitioned_tag", "zero_tag_state"]

#: What torch's Adam and AdamW keep per parameter, in their order.
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
_MOMENTS = ADAM_STATE[1:]


def partitioned_tag(source: Checkpoint) -> tuple[DeepSpeedTag, str]:
    """The ZeRO 1-3 tag a checkpoint holds and where it lies relative to the checkpoint (`""`: it is the tag;
    else `name/`), from metadata only.

    Raises:
        CkptctlError: no ZeRO tag, no optimizer partitions (ZeRO-0), several model-parallel ranks.
        CorruptCheckpoint: the tag is torn (naming the missing files).
    """
    prefix = tag_prefix(source)
    if prefix is None:
        raise CkptctlError(f"{source.url} holds no DeepSpeed ZeRO tag folder (model and optim states)")
    url = io.join(source.url, prefix.rstrip("/")) if prefix else source.url
    files = tag_files(io.list_dir(url))
    if files is None:
        raise CkptctlError(f"{url} holds no DeepSpeed model or optim states")
    missing = missing_rank_files(url, files)
    if missing:
        raise CorruptCheckpoint(f"{url} is torn: {', '.join(missing)} missing", "reshard a complete tag")
    tag = read_tag(url, files)
    if not tag.files.optim or tag.optim_kind is None:
        raise CkptctlError(
            f"{url} holds no ZeRO optimizer partitions (ZeRO stage {tag.zero_stage}): DeepSpeed loads it at any "
            "world size as it is"
        )
    if tag.mp_world_size > 1:
        raise CkptctlError(
            f"{url} holds {tag.mp_world_size} model-parallel ranks; merging tensor-parallel slices needs the "
            "model's universal_checkpoint_info patterns",
            "use DeepSpeed's ds_to_universal.py",
        )
    return tag, prefix


def zero_tag_state(checkpoint: Checkpoint) -> ParamState:
    """The state of the ZeRO 1-3 tag `checkpoint` holds, named as its module's `state_dict()` names it (the
    module docstring). Reads metadata only.

    Raises:
        CkptctlError, CorruptCheckpoint: what the module docstring lists as refused, with why.
    """
    tag, prefix = partitioned_tag(checkpoint)
    optim_file = tag.files.optim[(0, 0)]
    where = io.join(tag.url, optim_file)
    osd = optimizer_state_dict(tag.open_file(optim_file))
    base = base_state(osd)
    saved_groups = base.get("param_groups")
    if not isinstance(saved_groups, list) or not all(isinstance(g, dict) for g in saved_groups):
        raise CkptctlError(
            f"{where}: the wrapped optimizer's state holds no param_groups (an older DeepSpeed's ZeRO 1-2 save), "
            "so its settings cannot be given per group"
        )
    flat_groups = param_groups(tag.states.get("param_shapes"))
    owner = _flat_owners(saved_groups, len(flat_groups), where)
    flat_state = _flat_state(base.get("state"), len(flat_groups), where)
    index = tag_index(tag, prefix)
    by_name = {entry.name: entry for entry in index}
    masters = assemble_master_weights(tag, index, zero3=tag.optim_kind == "zero3", path_prefix=prefix)
    model = tuple((entry.name, stored_tensor(checkpoint.url, entry)) for entry in masters.entries)
    optimizer: dict[str, dict[str, StateTensor | int | float]] = {}
    names: list[list[str]] = [[] for _ in saved_groups]
    for k, shapes in enumerate(flat_groups):
        step = _step(checkpoint.url, by_name, flat_state[k], k, where)
        for name in shapes:
            per_param: dict[str, StateTensor | int | float] = {"step": step}
            for moment in _MOMENTS:
                entry = by_name.get(f"optimizer.state.{name}.{moment}")
                if entry is None or (not entry.chunks and entry.numel):
                    raise CorruptCheckpoint(
                        f"{tag.url}: the optimizer partitions hold no {moment} of {name} laid out as its fp32 master"
                    )
                per_param[moment] = stored_tensor(checkpoint.url, entry)
            optimizer[name] = per_param
            names[owner[k]].append(name)
    groups = tuple(
        {**{k: v for k, v in group.items() if k != "params"}, "params": names[g]}
        for g, group in enumerate(saved_groups)
    )
    return ParamState(model, optimizer, groups, _not_carried(tag, osd))


def _flat_owners(saved_groups: list[dict[str, Any]], flat_count: int, where: str) -> list[int]:
    """The group of each flat tensor, as the saved `param_groups` number them: each of the `flat_count` flat
    tensors `param_shapes` describes in exactly one group."""
    owner: dict[int, int] = {}
    for g, group in enumerate(saved_groups):
        params = group.get("params")
        if not isinstance(params, list) or not all(type(p) is int for p in params):
            raise CkptctlError(f"{where}: parameter group {g} numbers its flat tensors by no indices")
        for p in params:
            if p in owner:
                raise CorruptCheckpoint(f"{where}: flat tensor {p} is in parameter groups {owner[p]} and {g}")
            owner[p] = g
    if sorted(owner) != list(range(flat_count)):
        raise CorruptCheckpoint(
            f"{where}: the parameter groups number flat tensors {sorted(owner)}, and the model states' param_shapes "
            f"describe {flat_count}: which parameters each group holds cannot be proved"
        )
    return [owner[k] for k in range(flat_count)]


def _flat_state(state: Any, flat_count: int, where: str) -> list[Mapping[str, Any]]:
    """Each flat tensor's optimizer state, checked to be Adam's."""
    state = state if isinstance(state, dict) else {}
    found: list[Mapping[str, Any]] = []
    for k in range(flat_count):
        per_flat = state.get(k)
        if not isinstance(per_flat, dict) or not per_flat:
            raise CkptctlError(
                f"{where}: the optimizer holds no state for flat tensor {k} (saved before its first step?), so "
                "there are no moments to carry",
                "reshard a save taken after a training step",
            )
        other = [str(key) for key in per_flat if key not in ADAM_STATE]
        if other:
            raise CkptctlError(
                f"{where}: the optimizer keeps {', '.join(other)} per parameter, which torch's Adam/AdamW does not "
                f"({', '.join(ADAM_STATE)}): only Adam-like optimizers are written as a torch AdamW state"
            )
        absent = [key for key in ADAM_STATE if key not in per_flat]
        if absent:
            raise CkptctlError(f"{where}: the optimizer's state holds no {', '.join(absent)}: not Adam's")
        found.append(per_flat)
    return found


def _step(
    checkpoint_url: str, by_name: Mapping[str, TensorEntry], per_flat: Mapping[str, Any], k: int, where: str
) -> StateTensor:
    """The step a flat tensor's parameters get, as torch's Adam keeps it: a 0-dim tensor (torch's own, read
    from the file), or a plain count (DeepSpeed's Adams) as a float32 0-dim tensor, as Adam's `__setstate__`
    converts one."""
    value = per_flat["step"]
    if type(value) is TensorRef and not value.shape:
        entry = by_name.get(f"optimizer.state.group{k}.step")
        if entry is None:
            raise CorruptCheckpoint(f"{where}: the step of flat tensor {k} is not stored")
        return stored_tensor(checkpoint_url, entry)
    if type(value) in (int, float):
        count = float(value)

        def read() -> Any:
            import torch

            return torch.tensor(count, dtype=torch.float32)

        return StateTensor("float32", (), read)
    what = f"a tensor of shape {list(value.shape)}" if type(value) is TensorRef else f"a {type(value).__name__}"
    raise CkptctlError(f"{where}: the step of flat tensor {k} is {what}, not a count")


def _not_carried(tag: DeepSpeedTag, osd: Mapping[str, Any]) -> tuple[NotCarried, ...]:
    """What a tag holds beside the model and optimizer, which a `get_state_dict` state does not."""
    states = tag.states
    found = []
    scheduler = states.get("lr_scheduler")
    if scheduler is not None:
        epoch = scheduler.get("last_epoch") if isinstance(scheduler, dict) else None
        at = f" (last_epoch {epoch})" if type(epoch) is int else ""
        found.append(
            NotCarried(
                "lr_scheduler",
                f"DeepSpeed's LR scheduler state{at}, the lr_scheduler entry of {tag.files.rank0_model()}: the "
                "output's param groups carry the lr it had set; build the same scheduler before dcp.load and load "
                "that state dict into it (or step it to global_steps)",
            )
        )
    counters = [f"{key} {states[key]}" for key in ("global_steps", "global_samples", "skipped_steps") if key in states]
    if counters:
        found.append(
            NotCarried(
                "global_steps/global_samples",
                f"the engine's counters ({', '.join(counters)}) are no part of get_state_dict's state: resume the "
                "training loop at them",
            )
        )
    client = sorted(str(key) for key in tag.client_state())
    if client:
        shown = ", ".join(client[:6]) + (", ..." if len(client) > 6 else "")
        found.append(
            NotCarried(
                "client_state",
                f"what the training script passed to save_checkpoint(client_state=...) ({shown}): read it from the "
                "source's model states",
            )
        )
    found.append(NotCarried("rng", "DeepSpeed's engine saves no RNG state: seed the resumed run"))
    scaler = osd.get("loss_scaler")
    if scaler is not None:
        fields = state_fields(scaler, "loss_scaler") if isinstance(scaler, StandIn) else {}
        scale = fields.get("cur_scale")
        kind = "dynamic" if fields.get("dynamic") or osd.get("dynamic_loss_scale") is True else "static"
        found.append(
            NotCarried(
                "loss_scaler",
                f"DeepSpeed's {kind} loss scale{f' ({scale})' if scale is not None else ''}: an fp32/bf16 FSDP2 "
                "trainer needs none; an fp16 one starts its own GradScaler (at this scale)",
            )
        )
    sampler = states.get("data_sampler")
    found.append(
        NotCarried(
            "data loader position",
            "DeepSpeed's data_sampler state, in the model states: restore the loader from it"
            if sampler is not None
            else "the tag records no data sampler (DeepSpeed saves one only for its own loader): the position is "
            "the training code's, counted from global_samples",
        )
    )
    found.extend(
        NotCarried(name, "saved in the tag folder beside DeepSpeed's rank files: load it from the source")
        for name in sorted(tag.files.sizes)
        if not is_rank_file(name) and name != KEPT_MASTERS
    )
    return tuple(found)
