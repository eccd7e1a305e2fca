"""`reshard --to dcp`: any training state whose framework names it parameter by parameter
(`TRAINING_STATE_SOURCE`) written as a DCP folder in the shape `get_state_dict` gives for a model and a torch
optimizer, saved by `dcp.save` (`TrainingStateWriter`): keys `model.<name>`, `optim.state.<name>.exp_avg` ...,
`optim.param_groups.<i>.<setting>` (and `.params`, the group's parameter names). A trainer on any number of
ranks resumes with `dcp.load({"model": msd, "optim": osd})` + `set_state_dict`, which reshards as it loads.

The global plan and `.metadata` are made by torch's own `DefaultSavePlanner` from stand-ins of the tensors'
shapes (so the keys and their nested paths are exactly torch's); the data files are written by torch's
`FileSystemWriter`, a bounded group of parameters a file (a parameter, its moments and step together), each
tensor read from the source when its write item comes up and let go once written, so memory holds one tensor
(and what reading it takes), not a file's group nor the state. `.metadata` is written last: it completes the folder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import (
    TRAINING_STATE_SOURCE,
    ParamState,
    ReshardRequest,
    StateTensor,
    WrittenState,
)
from ckptctl.errors import CkptctlError
from ckptctl.formats.dcp_writer import data_file_writer
from ckptctl.layouts import capability

__all__ = ["WRITER", "DcpStateWriter"]

#: The tensor bytes one data file holds at most, unless one parameter's row alone is larger.
FILE_BYTES = 64 << 20
_MODEL, _OPTIM = "model", "optim"
_RESUME_HINT = (
    'msd, osd = get_state_dict(model, optimizer); state = {"model": msd, "optim": osd}; '
    'dcp.load(state, checkpoint_id=DST); set_state_dict(model, optimizer, model_state_dict=state["model"], '
    'optim_state_dict=state["optim"])'
)


class DcpStateWriter:
    target = "dcp"

    def refusal(self, source: Checkpoint, world_size: int | None) -> str | None:
        try:
            _state_of(source)
        except CkptctlError as exc:
            return exc.message
        return None

    def write(self, request: ReshardRequest, advance: Callable[[int], None]) -> WrittenState:
        import torch
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.planner import SavePlan

        state = _state_of(request.source)
        tensors = dict(_stand_in_rows(state))
        planner = DefaultSavePlanner()
        planner.set_up_planner(_nested(state, {key: _meta(t, torch) for key, (t, _) in tensors.items()}), None, True)
        plans, metadata = planner.create_global_plan([planner.create_local_plan()])
        items = {item.index.fqn: item for item in planner.finish_plan(plans[0]).items}
        flat_of = {path: key for key, path in planner.mappings.items()}
        groups = _file_groups(state, flat_of)
        # Non-tensor items (settings, parameter names, plain step counters) go in the first file.
        loose = [key for key in items if key not in {k for group in groups for k in group}]
        names: list[str] = []
        records: list[Any] = []
        written = 0
        for k, group in enumerate(groups or [[]]):
            keys = group + loose if k == 0 else group
            name = f"__0_{k}.distcp"
            values: dict[str, Any] = {}
            for key in keys:
                path = planner.mappings[key]
                values[key] = tensors[path][0] if path in tensors else _plain(state, path)
            file_planner = _reading_planner()
            file_planner.set_up_planner(values, None, True)
            records.append(
                data_file_writer(request.staging, name)
                .write_data(SavePlan([items[k] for k in keys]), file_planner)
                .value()
            )
            group_bytes = sum(tensors[planner.mappings[key]][0].nbytes for key in group)
            names.append(name)
            written += group_bytes
            advance(group_bytes)
        data_file_writer(request.staging, "").finish(metadata, records)
        return WrittenState(
            tensors=len(tensors),
            bytes=written,
            files=(*names, ".metadata"),
            world_size=None,
            not_carried=state.not_carried,
            resume_hint=_RESUME_HINT,
        )


def _reading_planner() -> Any:
    """torch's planner of one data file, given the file's values with each tensor as its `StateTensor`: the
    tensor is read when its write item comes up, so that (with `data_file_writer`, which lets each go once
    written) memory holds one tensor of the state, not a file's group of rows."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.utils import find_state_dict_object

    class ReadingPlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            value = self.state_dict[index.fqn]
            if isinstance(value, StateTensor):
                return find_state_dict_object({index.fqn: value.read()}, index)
            return super().lookup_object(index)

    return ReadingPlanner(flatten_state_dict=False)


def _state_of(source: Checkpoint) -> ParamState:
    read = capability(source.layout, TRAINING_STATE_SOURCE)
    if read is None:
        raise CkptctlError(
            f"ckptctl cannot read the training state of {source.layout} checkpoints parameter by parameter yet"
        )
    return read(source)


def _stand_in_rows(state: ParamState) -> list[tuple[tuple[Any, ...], tuple[StateTensor, str]]]:
    """Every tensor of the output by its nested path, with the parameter whose row it belongs to."""
    rows: list[tuple[tuple[Any, ...], tuple[StateTensor, str]]] = []
    for name, tensor in state.model:
        rows.append(((_MODEL, name), (tensor, name)))
        for key, value in state.optimizer.get(name, {}).items():
            if isinstance(value, StateTensor):
                rows.append(((_OPTIM, "state", name, key), (value, name)))
    return rows


def _meta(tensor: StateTensor, torch: Any) -> Any:
    return torch.empty(tensor.shape, dtype=getattr(torch, tensor.dtype), device="meta")


def _nested(state: ParamState, tensors: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    """The state dict `dcp.save({"model": msd, "optim": osd})` is given, tensors replaced by `tensors`."""
    model = {name: tensors[(_MODEL, name)] for name, _ in state.model}
    optim_state = {
        name: {key: tensors.get((_OPTIM, "state", name, key), value) for key, value in per_param.items()}
        for name, per_param in state.optimizer.items()
    }
    groups = [{**group, "params": list(group["params"])} for group in state.param_groups]
    return {_MODEL: model, _OPTIM: {"state": optim_state, "param_groups": groups}}


def _file_groups(state: ParamState, flat_of: dict[tuple[Any, ...], str]) -> list[list[str]]:
    """The flat keys of each data file: whole parameter rows, up to `FILE_BYTES` a file."""
    groups: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, tensor in state.model:
        row = [flat_of[(_MODEL, name)]]
        row_bytes = tensor.nbytes
        for key, value in state.optimizer.get(name, {}).items():
            if isinstance(value, StateTensor):
                row.append(flat_of[(_OPTIM, "state", name, key)])
                row_bytes += value.nbytes
        if current and size + row_bytes > FILE_BYTES:
            groups.append(current)
            current, size = [], 0
        current.extend(row)
        size += row_bytes
    if current:
        groups.append(current)
    return groups


def _plain(state: ParamState, path: tuple[Any, ...]) -> Any:
    """A non-tensor value by its nested path: a group's setting or parameter names, a plain step counter."""
    if path[1] == "param_groups":
        value = state.param_groups[path[2]][path[3]]
        return list(value) if path[3] == "params" else value
    return state.optimizer[path[2]][path[3]]


WRITER = DcpStateWriter()
