"""Multi-rank support: who we are in the process group, collectives, and torch DCP for sharded state.

Module and optimizer entries of a multi-rank save go through `torch.distributed.checkpoint` (DCP) into the
checkpoint's `dcp/` folder, keyed `{entry}.{flattened state_dict key}`. Their state dicts come from
`get_model_state_dict`/`get_optimizer_state_dict`, so FSDP2 (`fully_shard`) DTensor state stays sharded
and optimizer state is keyed by parameter FQN; DCP reshards on load, so a checkpoint restores in one
process (no process group) or in any number of ranks.

`torch.distributed.checkpoint` is imported inside the functions: it costs about a second and single-process
training never needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ckptctl import io
from ckptctl.errors import CkptctlError, CorruptCheckpoint, SerializationError
from ckptctl.formats.dcp_metadata import MAX_METADATA_BYTES, parse_dcp_metadata
from ckptctl.formats.dcp_metadata_classes import DCP_METADATA_GLOBALS
from ckptctl.formats.digest import HashingStream
from ckptctl.formats.manifest import FileRecord
from ckptctl.formats.safe_pickle import safe_loads
from ckptctl.formats.torch_save import inspect_archive_at, load_object_archive
from ckptctl.io.sweep import ReadInto, local_reader

__all__ = [
    "World",
    "all_gather",
    "background_group",
    "broadcast",
    "current_world",
    "dcp_state",
    "default_group",
    "is_lost_peer",
    "load_dcp",
    "load_full_module",
    "load_full_optimizer",
    "save_dcp",
]


@dataclass(frozen=True, slots=True)
class World:
    """This process's place in the default process group (rank 0 of 1 when there is none)."""

    rank: int = 0
    size: int = 1
    #: Whether torch.distributed's default process group is initialised (a group of one included).
    grouped: bool = False

    @property
    def multi(self) -> bool:
        """Whether saves and restores take the process-group path: modules and optimizers through DCP, rank 0
        commits, the ranks agree through collectives.

        A group of one takes it too. Its FSDP2 (`fully_shard`) parameters are DTensors even on one rank:
        the single-process path saves their full values and restores them with `load_state_dict`, which
        cannot copy a plain tensor into a DTensor ("mixed torch.Tensor and DTensor"); the group path
        restores through `set_model_state_dict`/`set_optimizer_state_dict`, as on many ranks. A script
        then also writes the same layout on one GPU as on eight (DESIGN §3: DCP once torch.distributed is
        initialised)."""
        return self.size > 1 or self.grouped


def current_world() -> World:
    """The default process group's rank and size, or a world of one when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), grouped=True)
    return World()


def broadcast(obj: Any, src: int = 0, group: Any = None) -> Any:
    """`obj` of rank `src` on every rank of `group` (default: the default group; picklable objects only,
    small control messages)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, indexed by rank (of `group`, default: the default group)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def default_group() -> Any:
    """The default process group object (None when torch.distributed is not initialised)."""
    return dist.group.WORLD if dist.is_initialized() else None


def is_lost_peer(exc: BaseException) -> bool:
    """Whether a collective failed because another rank is gone (killed, its connection dropped) or did
    not answer in time, rather than because of something this rank did."""
    if isinstance(exc, dist.DistError):  # DistBackendError, DistNetworkError, DistStoreError
        return True
    text = str(exc).lower()
    # gloo's own wording (transport/tcp/pair.cc): a peer's socket gone, or no answer to a send/recv. A
    # timeout of this rank's own write (an NFS mount, say) is not a lost rank, so "timed out" alone is not.
    peer_gone = ("connection closed", "connection reset", "broken pipe")
    no_answer = "timed out waiting" in text and ("recv" in text or "send" in text)
    return isinstance(exc, RuntimeError) and (no_answer or any(sign in text for sign in peer_gone))


def background_group() -> Any:
    """A gloo process group of every rank, for the collectives of background saves (a collective: every
    rank calls it, from the training thread).

    Background threads must not use the default group: the training loop's own collectives (FSDP's
    all-gathers, a loss all-reduce) run on it meanwhile, and two threads issuing collectives on one group
    pair them up in different orders on different ranks, which deadlocks or mixes their data. Gloo also
    serves CUDA runs, whose default group is NCCL: the background collectives carry small pickled
    messages and DCP's plans, never tensors.
    """
    return dist.new_group(backend="gloo")


def owner_of(name: str, optimizer: torch.optim.Optimizer, modules: Mapping[str, torch.nn.Module]) -> torch.nn.Module:
    """The module entry whose parameters include every parameter of the optimizer.

    DCP's optimizer state dict is keyed by parameter FQN, which only the owning module knows.

    Raises:
        SerializationError: no single module entry of the state owns all the optimizer's parameters.
    """
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules.values():
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    raise SerializationError(
        f"optimizer state[{name!r}] updates parameters that no single module entry of the state holds",
        "put the model that owns all of the optimizer's parameters into the state",
    )


def dcp_state(entries: Mapping[str, tuple[str, Any]], modules: Mapping[str, torch.nn.Module]) -> dict[str, Any]:
    """The state dicts DCP saves and loads for module and optimizer entries (name -> (kind, object)): FSDP2
    parameters stay sharded DTensors, optimizer state is keyed by parameter FQN."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {}
    for name, (kind, obj) in entries.items():
        if kind == "module":
            state[name] = get_model_state_dict(obj)
        else:
            state[name] = get_optimizer_state_dict(owner_of(name, obj, modules), obj)
    return state


def save_dcp(path: str, state: Mapping[str, Any], group: Any = None) -> dict[str, FileRecord]:
    """Save a `dcp_state` into `path` (a collective over `group`: every rank calls it); return the size and
    blake3 digest of every file this rank wrote, keyed by name in `path` (its `__{rank}_*.distcp`, plus
    `.metadata` on the coordinator), hashed as they were written: no byte is read back.

    Args:
        path: the `dcp/` folder of the staging checkpoint (the same path on every rank).
        state: what `dcp_state` returned, or a host copy of it (an async save).
        group: the process group of DCP's collectives; None for the default group.
    """
    import torch.distributed.checkpoint as dcp

    # fsync every file: the commit protocol depends on the data being durable before the manifest
    writer = dcp.FileSystemWriter(path, sync_files=True)
    hashing = _hashing_file_system()
    writer.fs = hashing  # every stream torch opens, for data and `.metadata` alike, goes through it
    dcp.save(dict(state), storage_writer=writer, process_group=group, no_dist=not current_world().multi)
    io.fsync_dir(path)  # the new entries of `dcp/`, torch's rename of `.metadata` among them
    return hashing.records


def _hashing_file_system() -> Any:
    """torch's local `FileSystem` whose write streams hash and count every byte written (`HashingStream`).

    torch's `FileSystemWriter` opens every file it writes through `self.fs.create_stream(path, "wb")`
    (torch/distributed/checkpoint/filesystem.py: `_write_files_from_queue` for the data files,
    `_FileSystemWriter.finish` for `.metadata`, written as `.metadata.tmp` and renamed through
    `self.fs.rename`), so this one seam sees every byte of the save.
    """
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.records: dict[str, FileRecord] = {}
            self._lock = threading.Lock()  # torch writes files from `thread_count` threads

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with open(path, "wb") as raw:
                stream = HashingStream(raw)
                yield stream
                stream.flush()
            with self._lock:
                self.records[os.path.basename(path)] = FileRecord(stream.size, stream.hexdigest())

        def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
            super().rename(path, new_path)
            with self._lock:
                record = self.records.pop(os.path.basename(path), None)
                if record is not None:
                    self.records[os.path.basename(new_path)] = record

    return HashingFileSystem()


def load_dcp(path: str, entries: Mapping[str, tuple[str, Any]], modules: Mapping[str, torch.nn.Module]) -> None:
    """Load module and optimizer entries from a DCP folder into live objects, resharding as needed.

    Works in one process without a process group (full tensors assembled from every rank's shards) and
    in any number of ranks (every rank calls it).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = dcp_state(entries, modules)
    with warnings.catch_warnings():
        # torch warns that it "assumes" a single process; loading in one is what we mean to do
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        reader = _safe_reader(path)
        try:
            dcp.load(state, storage_reader=reader, planner=_safe_planner(path), no_dist=not current_world().multi)
        except CheckpointException as exc:
            # DCP wraps every rank's failure; a refusal of ours is the one worth reporting as it is, and any
            # other is still a checkpoint this rank could not load (callers catch ckptctl's types).
            failures = [reader.refusal, *(failure for failure, _ in exc.failures.values())]
            for failure in failures:
                if isinstance(failure, CkptctlError):
                    raise failure from None
            reason = next((f"{type(f).__name__}: {str(f)[:300]}" for f in failures if f), "no reason given")
            raise CorruptCheckpoint(f"{path}: torch DCP could not load it ({reason})") from exc
    for name, (kind, obj) in entries.items():
        if kind == "module":
            set_model_state_dict(obj, state[name])
        else:
            set_optimizer_state_dict(owner_of(name, obj, modules), obj, state[name])


def _safe_reader(path: str) -> Any:
    """A `FileSystemReader` whose `.metadata` goes through the allowlisting unpickler, and which reads the
    tensors it can straight into the state's own.

    torch reads `.metadata` with a plain `pickle.load`. Here the bytes are read once, validated by
    `parse_dcp_metadata` (stand-ins only), then unpickled by `SafeUnpickler` with that same allowlist
    resolved to torch's real classes (plain dataclasses: building them runs no code of the file).

    torch reads each tensor item with `torch.load` into a tensor it allocates, then copies that into the
    state's tensor: a fresh allocation (page faults) and a second pass over every byte. Where the item is a
    whole stored chunk whose bytes are one row-major range (`inspect_archive_at`: what DCP's writer writes)
    and the state's tensor is a contiguous host tensor of its dtype and shape, the range is read into the
    state's tensor's memory directly; every other item (a resharded part, a device tensor, a transform, a
    damaged archive) goes through torch's own path, which then reports damage as it always did.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType

    class SafeFileSystemReader(FileSystemReader):
        #: Why `.metadata` was refused: torch catches a failure of `read_metadata`, falls back to per-rank
        #: metadata and reports both as an AssertionError, which hides the refusal's type (`load_dcp`
        #: raises this instead).
        refusal: CkptctlError | None = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise CorruptCheckpoint(f"{path}: per-rank DCP metadata is not read by ckptctl's core")
            source = io.join(path, ".metadata")
            try:
                data = io.read_bytes(source, max_size=MAX_METADATA_BYTES)
                parse_dcp_metadata(data, source)
                metadata = safe_loads(data, _real_dcp_globals(), source)
            except CkptctlError as exc:
                self.refusal = exc
                raise
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                # transform_descriptors: items torch transforms on load (torch before 2.8 has no such field)
                info = self.storage_data[item.storage_index]
                if item.type == LoadItemType.TENSOR and not getattr(info, "transform_descriptors", None):
                    per_file.setdefault(info.relative_path, []).append(item)
            direct: set[int] = set()
            for relative, items in per_file.items():
                file = os.path.join(path, relative)
                with open(file, "rb", buffering=0) as f:
                    read_into = local_reader(f.fileno())
                    direct.update(
                        id(item)
                        for item in items
                        if _read_into_target(f.fileno(), read_into, file, item, self, planner)
                    )
            rest = [item for item in plan.items if id(item) not in direct]
            if rest:
                return super().read_data(dataclasses.replace(plan, items=rest), planner)
            # torch waits on what this returns with `.wait()`: a torch future, not a concurrent.futures one
            done: torch.futures.Future[None] = torch.futures.Future()
            done.set_result(None)
            return done

    return SafeFileSystemReader(path)


def _read_into_target(fd: int, read_into: ReadInto, file: str, item: Any, reader: Any, planner: Any) -> bool:
    """Read the tensor item `item` of the open data file `fd` (`read_into`: its range reads) straight into the
    tensor the planner loads it into, when its stored bytes are that tensor's bytes (see `_safe_reader`); False, having committed
    nothing, when torch's path must read it.

    A target read only in part (a short read: a file cut short) is read again whole by torch's path, which
    overwrites it or fails."""
    info = reader.storage_data[item.storage_index]
    target = planner.resolve_tensor(item).detach()
    if (
        type(target) is not torch.Tensor  # a wrapper subclass (torchao's) has no memory of its own to read into
        or target.device.type != "cpu"
        or not target.is_contiguous()
        or target.is_conj()
        or target.is_neg()
    ):
        return False

    def read_at(start: int, n: int) -> bytes:  # never asked past the item's end (`inspect_archive_at`)
        return os.pread(fd, n, info.offset + start)

    try:
        found = inspect_archive_at(read_at, info.length, f"{file}: item {item.storage_index.fqn!r}")
    except (CkptctlError, OSError, ValueError):
        return False  # torch's path reads it, and says what is wrong the way it always has
    shape = tuple(found.shape)
    if (
        not found.contiguous
        or getattr(torch, found.dtype, None) != target.dtype
        or tuple(target.shape) != shape
        or tuple(item.lengths) != shape
        or any(item.storage_offsets)
    ):
        return False
    memory = target.reshape(-1).view(torch.uint8).numpy()
    if memory.nbytes != found.end - found.start:
        return False
    try:
        if read_into(memory.data, info.offset + found.start) != memory.nbytes:
            return False  # the file ends sooner
    except OSError:
        return False
    # As copy_ would: autograd sees the tensor changed in place (a graph holding it cannot silently use it).
    torch.autograd.graph.increment_version(target)
    planner.commit_tensor(item, target)
    return True


@functools.cache
def _real_dcp_globals() -> dict[tuple[str, str], Any]:
    """`DCP_METADATA_GLOBALS` with each name resolved to the real object torch would import.

    Only this fixed list is ever imported (not the names a file asks for). Names this Python lacks
    (`pathlib._local` before 3.13) are left out, so a file naming them is refused as unknown.
    """
    resolved = {}
    for module, name in DCP_METADATA_GLOBALS:
        try:
            resolved[(module, name)] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return resolved


def _safe_planner(path: str) -> Any:
    """A `DefaultLoadPlanner` that reads non-tensor ("bytes") items with ckptctl's allowlisting reader.

    torch's own planner runs `torch.load(weights_only=False)` on every bytes item (learning rates, betas,
    parameter names of an optimizer state), which executes whatever a crafted pickle asks for.
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            key = read_item.dest_index.fqn
            loaded = load_object_archive(value.getbuffer(), f"{path}: item {key!r}")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[key], loaded)
            else:
                self.state_dict[key] = loaded

    return SafeLoadPlanner()


def load_full_module(module: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """Load a full (unsharded) module state dict on every rank of a multi-rank run; FSDP2 shards it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, dict(state), options=StateDictOptions(full_state_dict=True))


def load_full_optimizer(owner: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load a single-process optimizer state dict (keyed by parameter index) on every rank of a multi-rank run.

    The indices are mapped to FQNs through the live optimizer's parameter order (the order the saving
    optimizer had, since it was built the same way) so that DCP's state-dict helpers can shard the state.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    fqn_of = {id(p): name for name, p in owner.named_parameters()}
    index_to_fqn: dict[Any, str] = {}
    for saved, live in zip(state["param_groups"], optimizer.param_groups, strict=True):
        for index, param in zip(saved["params"], live["params"], strict=True):
            index_to_fqn[index] = fqn_of[id(param)]
    keyed: dict[str, Any] = {
        "state": {index_to_fqn[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [index_to_fqn[i] for i in g["params"]]} for g in state["param_groups"]],
    }
    set_optimizer_state_dict(owner, optimizer, keyed, options=StateDictOptions(full_state_dict=True))
    # The full-state path flattens the hyperparameters (tuples come back as lists): set them as saved,
    # the way Optimizer.load_state_dict does.
    for live, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        live.update({k: v for k, v in saved.items() if k != "params"})
