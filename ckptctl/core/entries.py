"""What a training state holds: one entry per key, each of a kind that says how it is saved and restored.

Kinds (the manifest's `components[*].kind`):

- `module`: a `torch.nn.Module` (its `state_dict()`; restored with `load_state_dict`, strict)
- `optimizer`: a `torch.optim.Optimizer`
- `scheduler`: an LR scheduler (`LRScheduler`, `ReduceLROnPlateau`)
- `dataloader`: a sampler or data loader with `state_dict()/load_state_dict()`
- `stateful`: any other object with `state_dict()/load_state_dict()`
- `value`: a plain value (number, string, list, dict, tensor, numpy array); restore replaces it in the state
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from ckptctl.errors import SerializationError

__all__ = ["KINDS", "CheckpointWarning", "check_name", "kind_of", "load_into", "state_of"]

KINDS = ("module", "optimizer", "scheduler", "dataloader", "stateful", "value")

#: File names a checkpoint uses for its own purposes: an entry may not be called so.
_RESERVED = frozenset({"rng", "dcp", "ckptctl-manifest", "ckptctl-digests"})
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_DATA_NAMES = ("sampler", "loader", "dataloader", "data_loader")


class CheckpointWarning(UserWarning):
    """A checkpoint restored, but not completely (a missing RNG state, an entry it does not hold, ...)."""


def check_name(name: object) -> str:
    """The entry name if it can be a file name stem inside a checkpoint folder.

    Raises:
        SerializationError: not a string, not a plain file name, or a name the format reserves.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise SerializationError(
            f"state key {name!r} cannot name a file in a checkpoint",
            "use letters, digits, '_', '-' and '.' (not first), e.g. 'model' or 'optimizer'",
        )
    if name in _RESERVED or name.startswith("rng."):
        raise SerializationError(f"state key {name!r} is reserved by the checkpoint format", "rename the entry")
    return name


def kind_of(name: str, obj: Any) -> str:
    """The kind of a state entry (see the module docstring)."""
    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau):
        return "scheduler"
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        looks_like_data = isinstance(obj, torch.utils.data.Sampler | torch.utils.data.DataLoader) or any(
            word in type(obj).__name__.lower() or word in name.lower() for word in _DATA_NAMES
        )
        return "dataloader" if looks_like_data else "stateful"
    return "value"


def state_of(kind: str, obj: Any) -> tuple[Any, dict[str, Any]]:
    """What to store for an entry, and extra JSON fields to keep beside it.

    A module's state_dict carries `_metadata` (per-submodule versions that `load_state_dict` passes to
    `_load_from_state_dict` for format upgrades); it is kept as `state_dict_metadata`.
    """
    if kind == "value":
        return obj, {}
    state = obj.state_dict()
    extra: dict[str, Any] = {}
    metadata = getattr(state, "_metadata", None)
    if kind == "module" and isinstance(metadata, Mapping):
        extra["state_dict_metadata"] = {str(k): dict(v) for k, v in metadata.items()}
    return state, extra


def load_into(kind: str, obj: Any, value: Any, extra: Mapping[str, Any]) -> None:
    """Load a stored state into a live object of kind `module` ... `stateful` (not `value`)."""
    if kind == "module":
        state = OrderedDict(value)
        metadata = extra.get("state_dict_metadata")
        if isinstance(metadata, Mapping):
            state._metadata = OrderedDict(metadata)  # type: ignore[attr-defined]
        obj.load_state_dict(state)
    else:
        obj.load_state_dict(value)
