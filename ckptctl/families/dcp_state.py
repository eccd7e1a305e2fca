"""A training state saved through torch DCP as `get_state_dict` gives it (`{"model": ..., "optim": ...}`: the
model's state dict, the optimizer's keyed by parameter name), parameter by parameter (`ParamState`): what a
DCP folder and ckptctl's own multi-rank checkpoints (`dcp/`) hold, read by `reshard --to dcp`.

DCP flattens the nested state dict into dotted keys (`optim.state.layers.0.weight.exp_avg`), which cannot be
split back where names hold dots; the default planner records each key's nested path (`planner_data`:
`("optim", "state", "layers.0.weight", "exp_avg")`), which is what is read here. Non-tensor items
(hyperparameters, the names of each group's parameters) are read through the allowlisting reader.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, Component
from ckptctl.contract.capabilities import NotCarried, ParamState, StateTensor
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.families.dcp_folder import index_from_metadata
from ckptctl.families.param_state import stored_tensor
from ckptctl.formats.dcp_folder_metadata import load_dcp_metadata
from ckptctl.formats.dcp_metadata import DcpBytesItem, DcpMetadata
from ckptctl.formats.torch_save import read_object_archive

__all__ = ["dcp_param_state"]

#: The largest non-tensor item read (a group's hyperparameters and parameter names).
_MAX_ITEM = 1 << 24


def dcp_param_state(
    checkpoint: Checkpoint,
    folder: str,
    model_keys: Sequence[str],
    optimizer_keys: Sequence[str],
    not_carried: Sequence[NotCarried] = (),
) -> ParamState:
    """The model and optimizer a DCP folder of `checkpoint` holds, as `get_state_dict` names them.

    Args:
        checkpoint: the checkpoint; chunk files are read relative to its folder.
        folder: the DCP folder, relative to the checkpoint (`""`: the checkpoint is one).
        model_keys: the top-level keys the model may be saved under, best first (`model`).
        optimizer_keys: the top-level keys the optimizer may be saved under (`optim`, `optimizer`).
        not_carried: what else the checkpoint holds that the state leaves out.

    Raises:
        CorruptCheckpoint: a data file the metadata names is missing or shorter than its records.
        CkptctlError: no model or optimizer key, or keys whose nested path is not recorded.
    """
    url = io.join(checkpoint.url, folder) if folder else checkpoint.url
    metadata = load_dcp_metadata(url)
    _check_data_files(url, metadata)
    paths = metadata.planner_data
    where = url
    if not paths:
        raise CkptctlError(
            f"{where}: its .metadata records no nested key paths (planner_data), so its keys cannot be split "
            "into parameter names",
            "save with torch's DefaultSavePlanner (dcp.save's default)",
        )
    tops = {path[0] for path in paths.values()}
    model_key = next((k for k in model_keys if k in tops), None)
    optimizer_key = next((k for k in optimizer_keys if k in tops), None)
    if model_key is None or optimizer_key is None:
        raise CkptctlError(
            f"{where}: holds no {'model' if model_key is None else 'optimizer'} state under "
            f"{' or '.join(repr(k) for k in (model_keys if model_key is None else optimizer_keys))} "
            f"(its top-level keys: {', '.join(sorted(map(str, tops)))})",
            "only states saved as get_state_dict gives them ({'model': ..., 'optim': ...}) are read",
        )
    prefix = f"{folder}/" if folder else ""
    entries = {e.name: e for e in index_from_metadata(metadata, lambda _key: Component.MODEL, prefix)}
    model: list[tuple[str, StateTensor]] = []
    optimizer: dict[str, dict[str, StateTensor | int | float]] = {}
    groups: dict[int, dict[str, Any]] = {}
    skipped: list[str] = []
    for key in metadata.entries:
        path = paths.get(key)
        if path is None or path[0] not in (model_key, optimizer_key):
            continue
        if path[0] == model_key and len(path) == 2 and key in entries:
            model.append((str(path[1]), stored_tensor(checkpoint.url, entries[key])))
        elif path[0] == model_key:
            skipped.append(key)
        elif len(path) == 4 and path[1] == "state" and isinstance(path[2], str) and isinstance(path[3], str):
            value = stored_tensor(checkpoint.url, entries[key]) if key in entries else _number(url, metadata, key)
            optimizer.setdefault(path[2], {})[path[3]] = value
        elif len(path) == 4 and path[1] == "param_groups" and isinstance(path[2], int) and isinstance(path[3], str):
            groups.setdefault(path[2], {})[path[3]] = _item(url, metadata, key)
        else:
            raise CkptctlError(
                f"{where}: optimizer key {key!r} is neither per-parameter state nor a parameter group's setting",
                "only torch optimizers' state dicts as get_optimizer_state_dict gives them are read",
            )
    names = {name for name, _ in model}
    param_groups = tuple(groups[i] for i in sorted(groups))
    for i, group in enumerate(param_groups):
        params = group.get("params")
        if not isinstance(params, list | tuple) or not all(isinstance(p, str) for p in params):
            raise CkptctlError(f"{where}: parameter group {i} names its parameters by no names", _KEYED_HINT)
        unknown = sorted(set(params) - names)
        if unknown:
            raise CorruptCheckpoint(f"{where}: parameter group {i} names {unknown[0]!r}, which the model lacks")
    unknown = sorted(set(optimizer) - names)
    if unknown:
        raise CorruptCheckpoint(f"{where}: the optimizer holds state of {unknown[0]!r}, which the model lacks")
    extra = [NotCarried(k, "a non-tensor entry of the model's state dict, which is not carried") for k in skipped]
    extra.extend(
        NotCarried(
            f"{prefix}{top}",
            "saved beside the model and optimizer; the output holds only what get_state_dict gives: load it "
            "from the source",
        )
        for top in sorted(map(str, tops - {model_key, optimizer_key}))
    )
    return ParamState(tuple(model), optimizer, param_groups, (*not_carried, *extra))


_KEYED_HINT = "only optimizers saved by get_optimizer_state_dict (keyed by parameter name) are read"


def _item(url: str, metadata: DcpMetadata, key: str) -> Any:
    """A non-tensor item's value, through the allowlisting reader."""
    record = metadata.storage.get((key, None))
    if record is None or not isinstance(metadata.entries.get(key), DcpBytesItem):
        raise CorruptCheckpoint(f"{url}: item {key!r} has no storage record")
    if record.transforms or record.length > _MAX_ITEM:
        raise CkptctlError(f"{url}: item {key!r} is stored in a way ckptctl does not read (transforms or size)")
    blob = io.read_bytes(io.join(url, record.relative_path), record.offset, record.length)
    return read_object_archive(blob, f"{url}/{record.relative_path}: item {key!r}")


def _number(url: str, metadata: DcpMetadata, key: str) -> int | float:
    value = _item(url, metadata, key)
    if type(value) not in (int, float):
        raise CkptctlError(f"{url}: optimizer state {key!r} is a {type(value).__name__}, not a tensor or a number")
    return value


def _check_data_files(url: str, metadata: DcpMetadata) -> None:
    """Refuse a torn folder before anything is read: every data file the records name, whole."""
    sizes: Mapping[str, int] = {entry.name: entry.size for entry in io.list_dir(url) if not entry.is_dir}
    for name, end in sorted(metadata.referenced_files().items()):
        size = sizes.get(name)
        if size is None:
            raise CorruptCheckpoint(f"{io.join(url, name)} is missing: the save is torn", "reshard a whole checkpoint")
        if size < end:
            raise CorruptCheckpoint(
                f"{io.join(url, name)} holds {size} bytes, its records reach byte {end}: the file is truncated",
                "reshard a whole checkpoint",
            )
