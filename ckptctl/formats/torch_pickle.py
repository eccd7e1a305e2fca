"""Whole torch.save files of a training state, read without running them and without their tensor bytes.

`optimizer.pt`, `scheduler.pt`, `rng_state*.pth`, `training_args.bin` (HF Trainer) and DeepSpeed's
`*_model_states.pt` / `*_optim_states.pt` are torch.save zip files: `<archive>/data.pkl` is a pickle of the
whole object, and each tensor storage is a record `<archive>/data/<key>` stored uncompressed.

- `read_pickled_structure` (and `open_torch_pickle`, which also keeps the zip directory) reads the zip
  directory and `data.pkl` only, through the allowlisting unpickler with `TORCH_PICKLE_GLOBALS`: tensors
  come back as `TensorRef` facts, framework objects (DeepSpeed's loss scaler and ZeRO stage, transformers'
  `TrainingArguments`, numpy RNG arrays, ...) as inert stand-ins, and any other global is refused with
  `UnsafePickle` before anything runs. Neither torch nor DeepSpeed nor transformers is imported.
- `load_tensor` reads one tensor's bytes (only its storage record) when they are needed.
- `TorchPickle.byte_range` says where a contiguous tensor's elements are in the file, so that the tensor
  index can point at them as plain byte ranges (`ChunkEncoding.RAW`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import dtype_itemsize
from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.safe_pickle import MAX_NESTING, StandIn, check_nesting
from ckptctl.formats.torch_pickle_classes import TORCH_PICKLE_GLOBALS, TensorRef, load_torch_pickle
from ckptctl.formats.torch_save import ZipDirectory, ZipRecord, read_zip_directory

if TYPE_CHECKING:
    import torch

__all__ = [
    "TensorRef",
    "TorchPickle",
    "load_tensor",
    "open_torch_pickle",
    "read_pickled_structure",
    "refs_of",
    "storage_problems",
    "tensor_refs",
]

#: The largest `data.pkl` accepted (a 100k-tensor optimizer state pickles to ~20 MB).
MAX_DATA_PKL = 512 << 20
#: Nesting deeper than any real state dict; bounds the walk over a hostile structure.
_MAX_DEPTH = MAX_NESTING
#: A tensor's dotted path longer than this is refused: real ones are a few hundred characters at most.
_MAX_PATH = 4096
#: The paths `tensor_refs` yields may add up to this many characters: a hostile file can reach one tensor
#: from a million places (memo references), each through long keys.
_MAX_PATHS_TEXT = 64 << 20


class TorchPickle:
    """A torch.save file opened without its tensor data: the unpickled object and the zip directory.

    Attributes:
        url: the file.
        size: its size in bytes.
        root: the unpickled object (dicts, lists, scalars, `TensorRef`s and stand-ins).
        records: the zip directory, record name -> `ZipRecord`.
        prefix: the archive's folder inside the zip (`optimizer/`).
    """

    def __init__(self, directory: ZipDirectory, root: Any, prefix: str) -> None:
        self.url = directory.url
        self.size = directory.size
        self.root = root
        self.records = directory.records
        self.prefix = prefix
        self._directory = directory
        self._starts: dict[str, int] = {}
        self._little: bool | None = None

    def storage_record(self, ref: TensorRef) -> ZipRecord:
        """The zip record holding `ref`'s storage, checked to be stored and long enough.

        Raises:
            CorruptCheckpoint: the record is missing, compressed or shorter than the storage.
        """
        record = self.records.get(f"{self.prefix}data/{ref.storage_key}")
        if record is None:
            raise CorruptCheckpoint(f"{self.url}: the storage record data/{ref.storage_key} is missing")
        if not record.stored or record.size < ref.storage_nbytes:
            raise CorruptCheckpoint(
                f"{self.url}: the storage record data/{ref.storage_key} does not hold the {ref.storage_nbytes} "
                "bytes data.pkl claims"
            )
        return record

    def data_starts(self, refs: Iterable[TensorRef]) -> dict[str, int]:
        """Where the storage of each of `refs` starts in the file, by storage key (reads only local headers).

        Raises:
            CorruptCheckpoint: a record is missing, short, or runs past the end of the file (truncated).
        """
        wanted = {}
        for ref in refs:
            if ref.storage_key not in self._starts and ref.storage_key not in wanted:
                wanted[ref.storage_key] = self.storage_record(ref)
        if wanted:
            found = self._directory.data_starts(wanted.values())
            for key, record in wanted.items():
                self._starts[key] = found[record.name]
        return self._starts

    def data_starts_of(self, records: Iterable[ZipRecord]) -> dict[str, int]:
        """Where the data of each of `records` starts in the file, by record name (reads only local headers).

        Raises:
            CorruptCheckpoint: a header is damaged, or a record runs past the end of the file (truncated).
        """
        return self._directory.data_starts(records)

    def read_record(self, record: ZipRecord, limit: int = MAX_DATA_PKL) -> bytes:
        """The bytes of one small record (`data.pkl`, `version`).

        Raises:
            CorruptCheckpoint: see `ZipDirectory.read_record`.
        """
        return self._directory.read_record(record, limit)

    def little_endian(self) -> bool:
        """Whether the storages are little-endian (the `byteorder` record; absent means little)."""
        if self._little is None:
            record = self.records.get(f"{self.prefix}byteorder")
            self._little = record is None or self._directory.read_record(record, 16) == b"little"
        return self._little

    def byte_range(self, ref: TensorRef) -> tuple[int, int] | None:
        """`(start, end)` of `ref`'s elements in the file when they are one row-major little-endian range.

        Raises:
            CorruptCheckpoint: as `data_starts`.
        """
        if not ref.is_contiguous or not self.little_endian():
            return None
        start = self.data_starts((ref,))[ref.storage_key] + ref.storage_offset * dtype_itemsize(ref.dtype)
        return start, start + ref.nbytes

    def tensors(self) -> list[tuple[str, TensorRef]]:
        """Every tensor of the file with its dotted path (`state.0.exp_avg`)."""
        return list(tensor_refs(self.root))


def open_torch_pickle(
    url: str, size: int | None = None, allowed: Mapping[tuple[str, str], Any] = TORCH_PICKLE_GLOBALS
) -> TorchPickle:
    """Read the zip directory and `data.pkl` of the torch.save file at `url` (nothing else).

    Args:
        url: the file.
        size: its size when the caller has it from a listing (saves a stat).
        allowed: the allowlist (`DTENSOR_PICKLE_GLOBALS` for sharded state dicts holding DTensors).

    Raises:
        UnsafePickle: `data.pkl` names a global outside `TORCH_PICKLE_GLOBALS`; nothing of it ran.
        CorruptCheckpoint: not a torch.save zip file, truncated, or a damaged pickle.
    """
    if size is None:
        size = io.file_size(url)
    directory = read_zip_directory(url, size)
    prefix = _archive_prefix(directory)
    data = directory.read_record(directory.records[prefix + "data.pkl"], MAX_DATA_PKL)
    root = load_torch_pickle(data, f"{url} (data.pkl)", allowed)
    return TorchPickle(directory, root, prefix)


def read_pickled_structure(url: str) -> Any:
    """The object a torch.save file holds, with `TensorRef`s for tensors and stand-ins for framework classes.

    Reads only the zip directory and `data.pkl`; see `open_torch_pickle` for the errors.
    """
    return open_torch_pickle(url).root


def tensor_refs(obj: Any, prefix: str = "") -> Iterator[tuple[str, TensorRef]]:
    """Every `TensorRef` inside `obj` with its dotted path, in stored order (see `refs_of`)."""
    return refs_of(obj, (TensorRef,), prefix)


def refs_of(obj: Any, kinds: tuple[type, ...], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every object of one of the exact types `kinds` (`TensorRef`, a `DTensorRef`) inside `obj` with its
    dotted path, in stored order; they are not looked into.

    Dict keys and list indices make up the path (`state.0.exp_avg`); stand-ins are looked into through
    their fields. Shared or cyclic containers are visited once. Works in memory bounded by the depth:
    paths are built only for the tensors and containers on the way to them.

    Raises:
        CorruptCheckpoint: nesting deeper than any real state dict, a path longer than `_MAX_PATH`, or
            more path text than `_MAX_PATHS_TEXT`.
    """
    seen: set[int] = set()
    text_left = _MAX_PATHS_TEXT
    # Each frame: the path of a container and its items.
    frames: list[tuple[str, Iterator[tuple[Any, Any]]]] = [(prefix, iter(((None, obj),)))]
    while frames:
        path, items = frames[-1]
        entry = next(items, None)
        if entry is None:
            frames.pop()
            continue
        key, value = entry
        if key is None:
            child: str | None = path
        else:
            name = _key_text(key)
            # Measured before joining: a 16 MiB key under 20,000 parents must not be copied 20,000 times.
            child = None if len(path) + len(name) >= _MAX_PATH else f"{path}.{name}" if path else name
        if type(value) in kinds:
            if child is None:
                raise CorruptCheckpoint(f"a tensor's path is longer than {_MAX_PATH} characters")
            text_left -= len(child)
            if text_left < 0:
                raise CorruptCheckpoint("the tensors' paths add up to more text than any real state dict")
            yield child, value
            continue
        if id(value) in seen:
            continue
        if isinstance(value, StandIn):
            seen.add(id(value))
            value = getattr(value, "state", None)
            if type(value) is tuple and len(value) == 2 and all(type(v) in (dict, type(None)) for v in value):
                value = {**(value[0] or {}), **(value[1] or {})}
        is_dict = isinstance(value, dict)
        if not (is_dict or type(value) in (list, tuple)) or id(value) in seen:
            continue
        seen.add(id(value))
        if child is None:  # a key of a string value may be long; one that holds more is not a name
            raise CorruptCheckpoint(f"a path into the state is longer than {_MAX_PATH} characters")
        if len(frames) > _MAX_DEPTH:
            raise CorruptCheckpoint(f"nesting deeper than {_MAX_DEPTH} levels at {child[:200]!r}")
        frames.append((child, iter(value.items()) if is_dict else enumerate(value)))


def _key_text(key: Any) -> str:
    """A dict key or list index as a path component, without `str()` of anything a file could make huge."""
    if type(key) is str:
        return key
    if type(key) is int and -(10**18) < key < 10**18:
        return str(key)
    if type(key) in (bool, float, type(None)):
        return str(key)
    # A key a file could make a million levels deep (hashing it again would overflow the C stack) or
    # megabytes long once printed: checked, and named by its type.
    check_nesting(key, "a dict key")
    return f"<{type(key).__name__}>"


def load_tensor(url: str, ref: TensorRef, opened: TorchPickle | None = None) -> torch.Tensor:
    """Read one tensor of a torch.save file: only the bytes of its storage that it spans.

    Args:
        url: the file.
        ref: the tensor, from `read_pickled_structure`/`open_torch_pickle`.
        opened: the file already opened (saves reading its directory again).

    Raises:
        CorruptCheckpoint: the storage record is missing, short, or outside the file; big-endian data.
    """
    import torch

    tp = opened or _directory_only(url)
    itemsize = dtype_itemsize(ref.dtype)
    dtype = getattr(torch, ref.dtype)
    if ref.numel == 0:
        return torch.empty(ref.shape, dtype=dtype)
    if not tp.little_endian():
        raise CorruptCheckpoint(f"{url}: big-endian storages are not supported")
    start = tp.data_starts((ref,))[ref.storage_key]
    span = 1 + sum((d - 1) * s for d, s in zip(ref.shape, ref.stride, strict=True))
    first = start + ref.storage_offset * itemsize
    data = io.read_bytes(url, first, span * itemsize)
    if len(data) != span * itemsize:
        raise CorruptCheckpoint(f"{url}: the storage of a tensor is cut short", "the file is truncated")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    if ref.is_contiguous:
        return flat[: ref.numel].reshape(ref.shape)
    return torch.as_strided(flat, ref.shape, ref.stride).clone()


def _directory_only(url: str) -> TorchPickle:
    """A `TorchPickle` with the zip directory but no unpickled object (enough for `load_tensor`)."""
    directory = read_zip_directory(url)
    return TorchPickle(directory, None, _archive_prefix(directory))


def _archive_prefix(directory: ZipDirectory) -> str:
    pickles = [name for name in directory.records if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise CorruptCheckpoint(f"{directory.url}: not a torch.save file (no single data.pkl record)")
    return pickles[0][: -len("data.pkl")]


def storage_problems(opened: TorchPickle) -> list[str]:
    """Why the storages the pickle names do not all lie whole inside the file (empty when they do).

    Reads the local header of each storage record, nothing of the data.
    """
    problems = []
    present = []
    for ref in {ref.storage_key: ref for _, ref in opened.tensors()}.values():
        try:
            opened.storage_record(ref)
        except CorruptCheckpoint as exc:
            problems.append(exc.message)
        else:
            present.append(ref)
    try:
        opened.data_starts(present)
    except CorruptCheckpoint as exc:
        problems.append(exc.message)
    return problems
