"""What a save writes, taken from the live training state: tensors on CPU, the rest as JSON-ready trees.

An async save copies the tensors into CPU buffers kept from one save to the next (`Stager`), so that the
training loop pays for a memory copy only; a sync save encodes the live tensors, which are written before
`save` returns.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptctl import io
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
    #: What DCP writes for the sharded entries (their state dicts, keyed by entry): the live tensors in a
    #: sync save, host copies in an async one.
    dcp: Mapping[str, Any]


class Stager:
    """Copies tensors into host buffers kept from one async save to the next.

    Reusing the buffers means the training loop pays for a memory copy only, not for allocating (and
    page-faulting) a fresh copy of the whole state on every save; the buffers of device tensors are pinned,
    so that they come over by DMA. The next save starts only after the previous one has finished
    writing, so a buffer is never overwritten while it is being written out. What the stager holds is one
    host copy of the state this process saves (its shards, on a multi-rank run) until `release()`.

    `stage` hands out the buffer at once and queues the copy; `finish` runs the queue. Device tensors are
    copied asynchronously and waited for once. Host tensors are copied in chunks by a few threads
    (`np.copyto`, a plain memcpy without the GIL) rather than by `Tensor.copy_`, whose copy is split over
    torch's intra-op threads in fixed parts and waits for the slowest: on a machine whose cores are busy
    with other work that measured 5-7x slower than one thread's memcpy. Chunks taken from a queue keep
    every thread busy whichever of them the scheduler delays.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()
        self._pin = torch.cuda.is_available()
        # Each device's copies run on its own stream: `torch.cuda.synchronize()` waits for the current device only.
        self._cuda_devices: set[torch.device] = set()
        self._host_copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def stage(self, slot: str, tensor: torch.Tensor) -> torch.Tensor:
        """The buffer of `slot` (shaped like `tensor`, on the host), to be filled with `tensor` by `finish`."""
        buf = self._buffers.get(slot)
        # Only a device tensor's buffer is pinned: it makes its copy a DMA, while page-locked memory for a
        # host tensor's copy gains nothing and takes RAM the OS can never page out, until `release()`.
        pin = self._pin and tensor.is_cuda
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype or (pin and not buf.is_pinned()):
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            self._buffers[slot] = buf
        self._used.add(slot)
        # A conjugate or negative view's bytes are not its values: `copy_` resolves them, a memcpy would not.
        if tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.dim() > 0 and not _is_lazy_view(tensor):
            self._host_copies.append((buf, tensor))
        else:
            if tensor.is_cuda:
                self._cuda_devices.add(tensor.device)
            buf.copy_(tensor, non_blocking=tensor.is_cuda)
        return buf

    def for_entry(self, entry: str) -> state_tree.Stage:
        return lambda key, tensor: self.stage(f"{entry}/{key}", tensor)

    def finish(self) -> None:
        """Run the queued copies, wait for device copies, and release the buffers of tensors the state no
        longer has."""
        jobs, self._host_copies = self._host_copies, []
        _copy_host(jobs)
        for device in self._cuda_devices:
            torch.cuda.synchronize(device)
        for slot in set(self._buffers) - self._used:
            del self._buffers[slot]
        self._used.clear()
        self._cuda_devices.clear()

    def abandon(self) -> None:
        """Drop the copies queued by a snapshot that failed before `finish`, so that the next one neither runs
        them (stale sources racing its own copies into the same buffers) nor keeps their sources alive."""
        self._host_copies.clear()
        self._used.clear()

    def release(self) -> None:
        """Give the buffers back; the next async save allocates them again."""
        self._buffers.clear()


def _is_lazy_view(tensor: torch.Tensor) -> bool:
    return tensor.is_conj() or tensor.is_neg()


#: Host copies go in pieces of this size, so that a few threads share even one large tensor.
_CHUNK = 32 << 20


def _copy_host(jobs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each (destination, source) pair of contiguous host tensors of one shape and dtype."""
    pieces = []
    for dst, src in jobs:
        # Bytes, so that every dtype (bfloat16 too, which numpy lacks) goes through the same memcpy.
        d = dst.reshape(-1).view(torch.uint8).numpy()
        s = src.detach().reshape(-1).view(torch.uint8).numpy()
        pieces += [(d[o : o + _CHUNK], s[o : o + _CHUNK]) for o in range(0, d.size, _CHUNK)]
    if len(pieces) <= 1:
        for d, s in pieces:
            np.copyto(d, s)
        return
    with ThreadPoolExecutor(min(len(pieces), _copy_threads()), thread_name_prefix="ckptctl-stage") as pool:
        for _ in pool.map(lambda p: np.copyto(*p), pieces):
            pass


@functools.cache
def _copy_threads() -> int:
    # Memory bandwidth, not cores, bounds a copy: a few threads reach it, more only contend.
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def take(state: Mapping[str, Any], world: dist_.World, stager: Stager | None) -> Snapshot:
    """The snapshot of `state` a save of this rank writes; tensors are copied into `stager`'s buffers when
    one is given (an async save), else encoded as they are.

    Raises:
        SerializationError: `state` is not a dict, or an entry cannot be stored without pickle.
    """
    if not isinstance(state, Mapping):
        raise SerializationError(f"state must be a dict of entries, not {type(state).__name__}")
    try:
        return _take(state, world, stager)
    except BaseException:
        if stager is not None:
            stager.abandon()
        raise


def _take(state: Mapping[str, Any], world: dist_.World, stager: Stager | None) -> Snapshot:
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
    dcp = dist_.dcp_state(sharded, modules) if sharded else {}
    if stager is not None:
        if dcp:
            with torch.no_grad():
                dcp = _stage_dcp(dcp, stager, "dcp")
        stager.finish()
    return Snapshot(tuple(entries), rng_tree, sharded, dcp)


def _stage_dcp(value: Any, stager: Stager, slot: str) -> Any:
    """A DCP state dict with every tensor replaced by its host buffer; a DTensor keeps its spec (mesh,
    placements, global shape) around a host copy of its local shard, as torch's own async staging does
    (`_state_dict_utils._create_cpu_state_dict`), so that DCP plans the same items as for the live state."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return DTensor(stager.stage(slot, value.to_local()), value._spec, requires_grad=False)
    if isinstance(value, torch.Tensor):
        return stager.stage(slot, value)
    if isinstance(value, Mapping):
        return {k: _stage_dcp(v, stager, f"{slot}/{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_stage_dcp(v, stager, f"{slot}/{i}") for i, v in enumerate(value))
    return value  # numbers, strings: immutable


def write_tree(
    folder: str,
    stem: str,
    encoded: EncodedTree,
    extra: Mapping[str, Any],
    files: dict[str, FileRecord],
    *,
    fsync: bool = True,
) -> tuple[str, ...]:
    """Write one encoded tree as `stem.safetensors`/`stem.json` into `folder`, recording each file in
    `files`; returns their names. Not `fsync`: the caller must `fsync_files` them before it commits."""
    written = state_tree.write_files(folder, stem, encoded, extra, fsync=fsync)
    for name, w in written.items():
        files[name] = FileRecord(w.size, w.blake3)
    return tuple(written)


def fsync_files(folder: str, names: list[str]) -> None:
    """fsync files of `folder` written without it, all at once: the first makes the file system commit
    the metadata of all of them, the others only wait for their data, whose writeback started while they
    were written (`formats.digest.HashingWriter`). One fsync per file as it was closed would wait for a
    journal commit each, one after the other."""

    def sync(name: str) -> None:
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    io.parallel_map(sync, names, max_workers=8)


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
