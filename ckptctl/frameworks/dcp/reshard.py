"""`reshard --to dcp`: any training state whose framework names it parameter by parameter
(`TRAINING_STATE_SOURCE`) written as a DCP folder in the shape `get_state_dict` gives for a model and a torch
optimizer, saved by `dcp.save` (`TrainingStateWriter`): keys `model.<name>`, `optim.state.<name>.exp_avg` ...,
`optim.param_groups.<i>.<setting>` (and `.params`, the group's parameter names). A trainer on any number of
ranks resumes with `dcp.load({"model": msd, "optim": osd})` + `set_state_dict`, which reshards as it loads.

The folder is what torch's `dcp.save` writes for that state on one rank, written without importing torch
where the source stores its tensors raw (a ZeRO tag's flat partitions, a DCP folder's items, safetensors): the
keys and nested paths as torch's `flatten_state_dict` makes them (`_flatten`), each data file a sequence of
`torch.save` archives written by hand (`formats.dcp_writer.write_data_file`), a bounded group of parameters a
file (a parameter, its moments and step together; `--threads` files side by side), each tensor's bytes read
from the source's files a block at a time (mapped where the file system is local) when its item comes up;
a tensor stored otherwise (a view, a remote file) is read with torch when its turn comes and let go once
written, so memory holds one tensor, not a file's group nor the state. Every file is hashed as it is written
(`WrittenState.digests`): the digests file reads none of it back.
`.metadata` (`formats.dcp_metadata_write`, torch's classes pickled by name) is written last: it completes the
folder. Measured (bench/reshard.py, ZeRO-2/3 of ~100M parameters): importing torch alone cost more than the
copy, and torch's writer another pass over every tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import (
    TRAINING_STATE_SOURCE,
    ParamState,
    ReshardRequest,
    StateTensor,
    WrittenState,
)
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.dcp_metadata import (
    METADATA_NAME,
    DcpBytesItem,
    DcpChunk,
    DcpTensor,
    StorageKey,
    StorageRecord,
)
from ckptctl.formats.dcp_metadata_write import dcp_metadata_bytes
from ckptctl.formats.dcp_writer import DataFile, write_data_file
from ckptctl.formats.digest import bytes_digest
from ckptctl.formats.manifest import FileRecord
from ckptctl.formats.torch_save_writer import RawTensor
from ckptctl.layouts import capability

__all__ = ["WRITER", "DcpStateWriter"]

#: The tensor bytes one data file holds at most, unless one parameter's row alone is larger.
FILE_BYTES = 64 << 20
#: The DCP format version torch 2.13's writer records (`filesystem.CURRENT_DCP_VERSION`).
DCP_VERSION = "1.0.0"
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
        state = _state_of(request.source)
        tensors = dict(_stand_in_rows(state))
        flat = _flatten(_nested(state, {path: tensor for path, (tensor, _) in tensors.items()}))
        flat_of = {path: key for key, (path, _) in flat.items()}
        groups = _file_groups(state, flat_of)
        grouped = {key for group in groups for key in group}
        # Non-tensor items (settings, parameter names, plain step counters) go in the first file.
        loose = [key for key in flat if key not in grouped]
        storage: dict[StorageKey, StorageRecord] = {}
        digests: dict[str, FileRecord] = {}
        written = 0

        def one(k: int) -> tuple[str, DataFile]:
            keys = loose + groups[k] if k == 0 else groups[k]  # torch's order: byte items first
            name = f"__0_{k}.distcp"
            items = [(key, _value_of(key, flat[key][1])) for key in keys]
            return name, write_data_file(os.path.join(request.staging, name), items)

        groups = groups or [[]]
        # Files side by side on `workers` threads (each holds one tensor's block buffers); the records are
        # taken in file order whatever thread wrote them, so `.metadata` is the same bytes.
        with ThreadPoolExecutor(max(1, request.workers)) as pool:
            for k, (name, data_file) in enumerate(pool.map(one, range(len(groups)))):
                for key, offset, length in data_file.items:
                    value = flat[key][1]
                    where = tuple(0 for _ in value.shape) if isinstance(value, StateTensor) else None
                    storage[(key, where)] = StorageRecord(name, offset, length, ())
                digests[name] = data_file.file
                group_bytes = sum(flat[key][1].nbytes for key in groups[k])
                written += group_bytes
                advance(group_bytes)
        entries = {key: _entry(value) for key, (_, value) in flat.items()}
        planner_data = {key: path for key, (path, _) in flat.items()}
        data = dcp_metadata_bytes(entries, storage, version=DCP_VERSION, planner_data=planner_data)
        with open(os.path.join(request.staging, METADATA_NAME), "xb") as f:
            f.write(data)
        digests[METADATA_NAME] = FileRecord(len(data), bytes_digest(data))
        return WrittenState(
            tensors=len(tensors),
            bytes=written,
            files=(*digests,),
            world_size=None,
            not_carried=state.not_carried,
            resume_hint=_RESUME_HINT,
            digests=digests,
        )


def _value_of(key: str, value: Any) -> Callable[[], Any]:
    """What `write_data_file` writes for the item `key`: a tensor as its raw bytes where the source stores them
    so, else read (with torch, then only) and handed over as its bytes; any other value as it is."""
    if not isinstance(value, StateTensor):
        return lambda: value

    def raw() -> RawTensor:
        found = value.raw() if value.raw is not None else None
        return found if found is not None else _read_raw(key, value)

    return raw


def _read_raw(key: str, tensor: StateTensor) -> RawTensor:
    import torch

    value = tensor.read().detach().contiguous()
    if str(value.dtype).removeprefix("torch.") != tensor.dtype or tuple(value.shape) != tensor.shape:
        raise CorruptCheckpoint(
            f"{key}: read as {value.dtype}{list(value.shape)}, but the source says {tensor.dtype}{list(tensor.shape)}"
        )
    return RawTensor(tensor.dtype, tensor.shape, memoryview(value.reshape(-1).view(torch.uint8).numpy()))


def _entry(value: Any) -> DcpTensor | DcpBytesItem:
    """The `.metadata` entry of an item: a tensor stored whole as one chunk, or a bytes item."""
    if not isinstance(value, StateTensor):
        return DcpBytesItem()
    return DcpTensor(value.dtype, value.shape, (DcpChunk(tuple(0 for _ in value.shape), value.shape),))


def _flatten(nested: Mapping[str, Any]) -> dict[str, tuple[tuple[Any, ...], Any]]:
    """flat key -> (nested path, value), as torch's `flatten_state_dict` flattens a state dict for
    `DefaultSavePlanner` (`_traverse.traverse_state_dict`, `_nested_dict.flatten_state_dict`): mappings are
    walked with their keys as strings, lists and tuples by index only where they hold a tensor or a mapping
    (or a list that does), anything else is one item; the key is the path joined by dots.

    Raises:
        CkptctlError: two paths join to the same key (torch refuses the save with ValueError).
    """
    flat: dict[str, tuple[tuple[Any, ...], Any]] = {}

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        return not any(
            (isinstance(entry, Mapping | list) and not terminal(entry)) or isinstance(entry, StateTensor)
            for entry in value
        )

    def walk(path: tuple[Any, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk((*path, str(k)), v)
        elif terminal(value):
            key = ".".join(map(str, path))
            if key in flat:
                raise CkptctlError(f"two entries of the state flatten to the key {key!r}")
            flat[key] = (path, value)
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk((*path, i), v)

    for key, value in nested.items():
        walk((str(key),), value)
    return flat


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


WRITER = DcpStateWriter()
