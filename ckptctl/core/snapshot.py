"""What a save writes, taken from the live training state: tensors on CPU, the rest as JSON-ready trees.

An async save copies the tensors into CPU buffers kept from one save to the next (`Stager`), so that the
training loop pays for a memory copy only; a sync save encodes the live tensors, which are written before
`save` returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptctl.core import distributed as dist_
from ckptctl.core import rng
from ckptctl.core.entries import check_name, kind_of, state_of
from ckptctl.errors import SerializationError
from ckptctl.formats import state_tree
from ckptctl.formats.manifest import FileRecord
from ckptctl.formats.state_tree import EncodedTree

__all__ = ["SHARDED_KINDS", "EntrySnapshot", "Snapshot", "Stager", "plain_metrics", "take", "write_tree"]

#: Entry kinds that a multi-rank save stores through torch DCP.
SHARDED_KINDS = ("module", "optimizer")


@dataclass(frozen=True, slots=True)
class EntrySnapshot:
    name: str
    kind: str
    encoded: EncodedTree
    extra: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a save writes, taken from the live state: tensors on CPU, the rest as JSON-ready trees."""

    entries: tuple[EntrySnapshot, ...]
    rng: EncodedTree
    sharded: Mapping[str, tuple[str, Any]]
    modules: Mapping[str, torch.nn.Module]


class Stager:
    """Copies tensors into CPU buffers kept from one async save to the next.

    Reusing the buffers means the training loop pays for a memory copy only, not for allocating (and
    page-faulting) a fresh copy of the whole state on every save. The next save starts only after the
    previous one has finished writing, so a buffer is never overwritten while it is being written out.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()
        self._pin = torch.cuda.is_available()
        self._cuda_copies = False

    def for_entry(self, entry: str) -> state_tree.Stage:
        def stage(key: str, tensor: torch.Tensor) -> torch.Tensor:
            slot = f"{entry}/{key}"
            buf = self._buffers.get(slot)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
                self._buffers[slot] = buf
            self._cuda_copies |= tensor.is_cuda
            buf.copy_(tensor, non_blocking=tensor.is_cuda)
            self._used.add(slot)
            return buf

        return stage

    def finish(self) -> None:
        """Wait for device copies and release the buffers of tensors the state no longer has."""
        if self._cuda_copies:
            torch.cuda.synchronize()
        for slot in set(self._buffers) - self._used:
            del self._buffers[slot]
        self._used.clear()
        self._cuda_copies = False


def take(state: Mapping[str, Any], world: dist_.World, stager: Stager | None) -> Snapshot:
    """The snapshot of `state` a save of this rank writes; tensors are copied into `stager`'s buffers when
    one is given (an async save), else encoded as they are.

    Raises:
        SerializationError: `state` is not a dict, or an entry cannot be stored without pickle.
    """
    if not isinstance(state, Mapping):
        raise SerializationError(f"state must be a dict of entries, not {type(state).__name__}")
    entries = []
    sharded: dict[str, tuple[str, Any]] = {}
    modules = {}
    for name, obj in state.items():
        check_name(name)
        kind = kind_of(name, obj)
        if kind == "module":
            modules[name] = obj
        if world.multi and kind in SHARDED_KINDS:
            sharded[name] = (kind, obj)
            continue
        if world.rank != 0:  # rank 0 alone writes the unsharded entries
            continue
        value, extra = state_of(kind, obj)
        stage = stager.for_entry(name) if stager is not None else None
        encoded = state_tree.encode(value, name=f"state[{name!r}]", root_key=name, stage=stage)
        entries.append(EntrySnapshot(name, kind, encoded, extra))
    rng_tree = state_tree.encode(
        rng.capture(), name="rng", stage=stager.for_entry("rng") if stager is not None else None
    )
    if stager is not None:
        stager.finish()
    return Snapshot(tuple(entries), rng_tree, sharded, modules)


def write_tree(
    folder: str, stem: str, encoded: EncodedTree, extra: Mapping[str, Any], files: dict[str, FileRecord]
) -> tuple[str, ...]:
    """Write one encoded tree as `stem.safetensors`/`stem.json` into `folder`, recording each file in
    `files`; returns their names."""
    written = state_tree.write_files(folder, stem, encoded, extra)
    for name, w in written.items():
        files[name] = FileRecord(w.size, w.blake3)
    return tuple(written)


def plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metrics as JSON values: 1-element tensors and numpy scalars become Python numbers.

    Raises:
        SerializationError: a value is not a number, a string, or a list or dict of them.
    """
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise SerializationError(f"metrics must be a dict, not {type(metrics).__name__}")

    def clean(value: Any, where: str) -> Any:
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.item()
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return value.item()
        if isinstance(value, Mapping):
            return {str(k): clean(v, f"{where}[{k!r}]") for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v, f"{where}[{i}]") for i, v in enumerate(value)]
        raise SerializationError(
            f"cannot store {type(value).__qualname__} at {where}", "metrics hold numbers and strings"
        )

    return {str(k): clean(v, f"metrics[{k!r}]") for k, v in metrics.items()}
