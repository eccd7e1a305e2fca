"""What the training-state sources of frameworks share (`TrainingStateSource`): a stored tensor read when asked
(`stored_tensor`), and a torch optimizer's own `state_dict()` (state keyed by the index of each parameter, in the order the optimizer
was given them), named by the model's parameters where that order is provably the model's: shared by the
training-state sources of frameworks that save it so (verl, ...).

torch numbers the parameters of `optimizer.state_dict()` 0, 1, ... across its groups in order. A framework that
builds its optimizer from `model.parameters()` in one group numbers them in `named_parameters()` order, which is
the model's state-dict order less its buffers and tied copies. The mapping is taken only when it is proved by
what the checkpoint holds: one group numbering exactly as many parameters as the model's state dict holds tensors
(so there is no buffer or tied copy to skip), and each parameter's state tensors of that parameter's shape.
Anything else is refused with why, never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ckptctl.checkpoint import TensorEntry
from ckptctl.errors import CkptctlError
from ckptctl.formats.chunks import read_tensor
from ckptctl.layouts.capabilities import StateTensor

__all__ = ["name_indexed_state", "stored_tensor"]


def stored_tensor(checkpoint_url: str, entry: TensorEntry) -> StateTensor:
    """The full tensor of an index entry of the checkpoint at `checkpoint_url`, read (from its chunks) when asked."""

    def read() -> Any:
        return read_tensor(checkpoint_url, entry)

    return StateTensor(entry.dtype, entry.shape, read)


def name_indexed_state(
    model: Sequence[tuple[str, StateTensor]],
    state: Mapping[int, Mapping[str, StateTensor | int | float]],
    groups: Sequence[Mapping[str, Any]],
    where: str,
    built: str,
) -> tuple[dict[str, dict[str, StateTensor | int | float]], tuple[dict[str, Any], ...]]:
    """The optimizer state and groups keyed by parameter name.

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
    if not isinstance(params, list | tuple) or list(params) != list(range(len(params))):
        raise CkptctlError(f"{where}: the optimizer's parameters are not numbered 0, 1, ... in order", hint)
    if len(params) != len(model):
        raise CkptctlError(
            f"{where}: the optimizer numbers {len(params)} parameters and the model's state dict holds {len(model)} "
            "tensors (buffers or tied copies), so which index is which parameter cannot be proved",
            hint,
        )
    unknown = sorted(set(state) - set(params))
    if unknown:
        raise CkptctlError(f"{where}: the optimizer holds state of parameter {unknown[0]}, which no group numbers")
    named: dict[str, dict[str, StateTensor | int | float]] = {}
    for index, per_param in state.items():
        name, param = model[index]
        for key, value in per_param.items():
            if isinstance(value, StateTensor) and value.shape and value.shape != param.shape:
                raise CkptctlError(
                    f"{where}: the {key} of parameter {index} has shape {list(value.shape)}, and the model's "
                    f"tensor {index} ({name}) {list(param.shape)}: the optimizer's order is not the model's",
                    hint,
                )
        named[name] = dict(per_param)
    names = [name for name, _ in model]
    return named, ({**groups[0], "params": names},)
