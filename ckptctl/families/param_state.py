"""What the training-state sources of frameworks share (`TrainingStateSource`): a stored tensor read when asked
(`stored_tensor`), and a torch optimizer's own `state_dict()` (state keyed by the index of each parameter, in the order the optimizer
was given them), named by the model's parameters where that order is provably the model's: shared by the
training-state sources of frameworks that save it so (verl, ...).

torch numbers the parameters of `optimizer.state_dict()` 0, 1, ... across its groups in order. A framework that
builds its optimizer from `model.parameters()` in one group numbers them in `named_parameters()` order, which is
the model's state-dict order less its buffers and tied copies. The mapping is taken only when it is proved by
what the checkpoint holds: one group numbering exactly as many parameters as the model's state dict holds tensors
(so there is no buffer or tied copy to skip), and each parameter's state tensors of that parameter's shape.
A framework that builds several groups (the HF Trainer's decay / no-decay) names each group's parameters from its
own code (`grouped_state`); the saved groups must then number exactly those, in order. Anything else is refused
with why, never guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckptctl.checkpoint import TensorEntry
from ckptctl.contract.capabilities import StateTensor
from ckptctl.errors import CkptctlError
from ckptctl.formats.chunks import read_tensor

__all__ = ["grouped_state", "indexed_optimizer", "name_indexed_state", "stored_tensor"]


def stored_tensor(checkpoint_url: str, entry: TensorEntry) -> StateTensor:
    """The full tensor of an index entry of the checkpoint at `checkpoint_url`, read (from its chunks) when asked."""

    def read() -> Any:
        return read_tensor(checkpoint_url, entry)

    return StateTensor(entry.dtype, entry.shape, read)


def indexed_optimizer(
    root: Any, where: str, tensor: Callable[[str], StateTensor], tensor_types: tuple[type, ...]
) -> tuple[dict[int, dict[str, StateTensor | int | float]], list[dict[str, Any]]]:
    """The state and groups of a torch optimizer's own `state_dict()` as a safe unpickler read it (`root`).

    Args:
        root: the unpickled `{"state": {index: {key: value}}, "param_groups": [...]}`.
        where: the file, for messages.
        tensor: the stored tensor named `optimizer.state.<index>.<key>` (as the checkpoint's tensor index names it).
        tensor_types: the references the unpickler gives for tensors.

    Raises:
        CkptctlError: `root` is not such a state dict, or holds a value that is neither a tensor nor a number.
    """
    if (
        not isinstance(root, dict)
        or not isinstance(root.get("state"), dict)
        or not isinstance(root.get("param_groups"), list)
    ):
        raise CkptctlError(f"{where}: not a torch optimizer's state_dict ({{state, param_groups}})")
    state: dict[int, dict[str, StateTensor | int | float]] = {}
    for number, per_param in root["state"].items():
        if type(number) is not int or not isinstance(per_param, dict):
            raise CkptctlError(f"{where}: optimizer state keyed by {number!r}, not by parameter index")
        values: dict[str, StateTensor | int | float] = {}
        for key, value in per_param.items():
            name = f"optimizer.state.{number}.{key}"
            if isinstance(value, tensor_types):
                values[str(key)] = tensor(name)
            elif type(value) in (int, float):
                values[str(key)] = value
            else:
                raise CkptctlError(
                    f"{where}: optimizer state {name} is a {type(value).__name__}, not a tensor or a number"
                )
        state[number] = values
    return state, [group for group in root["param_groups"] if isinstance(group, dict)]


def name_indexed_state(
    model: Sequence[tuple[str, StateTensor]],
    state: Mapping[int, Mapping[str, StateTensor | int | float]],
    groups: Sequence[Mapping[str, Any]],
    where: str,
    built: str,
) -> tuple[dict[str, dict[str, StateTensor | int | float]], tuple[dict[str, Any], ...]]:
    """The optimizer state and groups keyed by parameter name, of an optimizer built from the model's parameters
    in one group.

    Args:
        model: the model's state dict, in order.
        state: parameter index -> its state.
        groups: the saved `param_groups` (`params`: indices).
        where: the file, for messages.
        built: how the framework builds its optimizer, for messages (`verl builds it from module.parameters()`).

    Raises:
        CkptctlError: the mapping cannot be proved (with why).
    """
    hint = "save the state with get_optimizer_state_dict (keyed by name) or reshard a save whose mapping is plain"
    if len(groups) != 1:
        raise CkptctlError(
            f"{where}: the optimizer has {len(groups)} parameter groups; {built} in one group, so the order of "
            "its parameters cannot be proved to be the model's",
            hint,
        )
    params = groups[0].get("params")
    if isinstance(params, list | tuple) and len(params) != len(model):
        raise CkptctlError(
            f"{where}: the optimizer numbers {len(params)} parameters and the model's state dict holds {len(model)} "
            "tensors (buffers or tied copies), so which index is which parameter cannot be proved",
            hint,
        )
    return grouped_state([[name for name, _ in model]], dict(model), state, groups, where, built, hint)


def grouped_state(
    members: Sequence[Sequence[str]],
    params: Mapping[str, StateTensor],
    state: Mapping[int, Mapping[str, StateTensor | int | float]],
    groups: Sequence[Mapping[str, Any]],
    where: str,
    built: str,
    hint: str,
) -> tuple[dict[str, dict[str, StateTensor | int | float]], tuple[dict[str, Any], ...]]:
    """The optimizer state and groups keyed by parameter name, where the framework's own code says which
    parameters each group holds, in order: torch numbers them 0, 1, ... across the groups in that order.

    Args:
        members: the names of each group's parameters, in the order the framework gave them to the optimizer.
        params: every parameter by name (its shape is checked against its state's).
        state: parameter index -> its state.
        groups: the saved `param_groups` (`params`: indices).
        where: the file, for messages.
        built: how the framework builds its optimizer, for messages.
        hint: what to do instead, for messages.

    Raises:
        CkptctlError: the saved groups are not the ones `members` describes, or a state tensor is not of its
            parameter's shape (with why).
    """
    if len(groups) != len(members):
        raise CkptctlError(
            f"{where}: the optimizer has {len(groups)} parameter groups, and {built} makes {len(members)}, so which "
            "index is which parameter cannot be proved",
            hint,
        )
    names: list[str] = []
    for number, (group, expected) in enumerate(zip(groups, members, strict=True)):
        saved = group.get("params")
        if not isinstance(saved, list | tuple) or list(saved) != list(range(len(names), len(names) + len(saved))):
            raise CkptctlError(f"{where}: the optimizer's parameters are not numbered 0, 1, ... in order", hint)
        if len(saved) != len(expected):
            raise CkptctlError(
                f"{where}: parameter group {number} numbers {len(saved)} parameters, and {built} puts "
                f"{len(expected)} there, so which index is which parameter cannot be proved",
                hint,
            )
        names.extend(expected)
    unknown = sorted(set(state) - set(range(len(names))))
    if unknown:
        raise CkptctlError(f"{where}: the optimizer holds state of parameter {unknown[0]}, which no group numbers")
    named: dict[str, dict[str, StateTensor | int | float]] = {}
    for index, per_param in state.items():
        name = names[index]
        param = params[name]
        for key, value in per_param.items():
            if isinstance(value, StateTensor) and value.shape and value.shape != param.shape:
                raise CkptctlError(
                    f"{where}: the {key} of parameter {index} has shape {list(value.shape)}, and {name}, which "
                    f"{built} numbers {index}, {list(param.shape)}: the optimizer's order is not the model's",
                    hint,
                )
        named[name] = dict(per_param)
    out_groups: list[dict[str, Any]] = []
    start = 0
    for group, expected in zip(groups, members, strict=True):
        out_groups.append({**group, "params": list(names[start : start + len(expected)])})
        start += len(expected)
    return named, tuple(out_groups)
