"""The encoded tree of docs/native-format.md: nested Python state as JSON plus one safetensors file.

A state entry `{stem}` is stored as `{stem}.json` (`{"tree": <encoded tree>, ...}`) and, when it holds
tensors or numpy arrays, `{stem}.safetensors`. Nothing here needs pickle to load, and anything that would
need it is refused at encode time with a `SerializationError` that names where in the tree it was.

Encoding (a JSON object with a single marker key is a marker; every other object is a plain dict):

- dict with string keys → object; a dict with other keys, or whose only key is a marker → `{"__dict__": [[k, v], ...]}`
- list → array; tuple → `{"__tuple__": [...]}`
- tensor → `{"__tensor__": key}`; numpy array → `{"__ndarray__": key}` (key in `{stem}.safetensors`)
- int, float (NaN/Infinity allowed), str, bool, None → themselves; bytes → `{"__bytes__": base64}`;
  torch.dtype → `{"__dtype__": "float32"}`

Tensor keys are the tree path joined by `.` (`state.0.exp_avg`), with `#2`, `#3`... on a collision; a
tensor at the root of the tree takes the `root_key` the writer chose (the core uses the entry name).

numpy scalars (`np.float32(1.0)`, `np.int64(3)`, `np.bool_`) are stored as the Python number they equal,
because state dicts and metrics carry them often and a 0-d array would restore as something else.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.errors import CorruptCheckpoint, SerializationError
from ckptctl.formats import safetensors as st
from ckptctl.formats.digest import HashingWriter
from ckptctl.formats.documents import read_json

if TYPE_CHECKING:
    import torch

__all__ = [
    "MARKERS",
    "MAX_TREE_BYTES",
    "EncodedTree",
    "Stage",
    "StoredTree",
    "decode",
    "encode",
    "read_files",
    "write_files",
]

#: The largest `{stem}.json` read: tensors live in the safetensors file, so even a big state's tree is
#: small; a plain value (a list of sample indices) may still take tens of megabytes.
MAX_TREE_BYTES = 256 << 20

MARKERS = frozenset({"__dict__", "__tuple__", "__tensor__", "__ndarray__", "__bytes__", "__dtype__"})

#: Applied to every tensor as it is encoded: (tensor key, tensor) -> the CPU tensor to store. The core
#: passes a copying stager for async saves; the default moves to CPU without copying CPU tensors.
Stage = Callable[[str, "torch.Tensor"], "torch.Tensor"]


@dataclass(frozen=True, slots=True)
class EncodedTree:
    """A tree ready to be written: its JSON form and the tensors it refers to (CPU, by key)."""

    tree: Any
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StoredTree:
    """A tree read back: the decoded value and the other top-level fields of its JSON document."""

    value: Any
    extra: Mapping[str, Any] = field(default_factory=dict)


def _label(path: tuple[Any, ...], name: str) -> str:
    return name + "".join(f"[{p!r}]" for p in path)


class _Encoder:
    def __init__(self, name: str, root_key: str, stage: Stage | None) -> None:
        import torch

        self._torch = torch
        self._name = name
        self._root_key = root_key
        self._stage = stage
        self.tensors: dict[str, torch.Tensor] = {}

    def key_for(self, path: tuple[Any, ...]) -> str:
        base = ".".join(str(p) for p in path) or self._root_key
        key, n = base, 1
        while key in self.tensors:
            n += 1
            key = f"{base}#{n}"
        return key

    def refuse(self, path: tuple[Any, ...], what: str, hint: str = "") -> SerializationError:
        return SerializationError(
            f"cannot store {what} at {_label(path, self._name)} without pickle",
            hint
            or "store plain values (numbers, strings, lists, dicts, tensors, numpy arrays) or an object with state_dict()",
        )

    def tensor(self, value: torch.Tensor, path: tuple[Any, ...]) -> str:
        torch = self._torch
        t = value.detach()
        if hasattr(t, "full_tensor"):  # a DTensor outside DCP (world size 1): store the whole tensor
            t = t.full_tensor()
        if t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_meta:
            raise self.refuse(
                path, f"a {t.layout} tensor" if t.layout != torch.strided else "a quantized, nested or meta tensor"
            )
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in st.TORCH_TO_SAFETENSORS:
            raise self.refuse(path, f"a tensor of dtype {dtype}", "safetensors cannot hold this dtype; cast it first")
        t = t.resolve_conj().resolve_neg()
        key = self.key_for(path)
        self.tensors[key] = self._stage(key, t) if self._stage else t.cpu()
        return key

    def ndarray(self, value: Any, path: tuple[Any, ...]) -> str:
        import numpy as np

        if value.dtype.kind not in "biufc":
            raise self.refuse(path, f"a numpy array of dtype {value.dtype}")
        arr = np.ascontiguousarray(value)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        try:
            t = self._torch.from_numpy(arr)
        except TypeError as exc:
            raise self.refuse(path, f"a numpy array of dtype {value.dtype}") from exc
        if str(t.dtype).removeprefix("torch.") not in st.TORCH_TO_SAFETENSORS:
            raise self.refuse(path, f"a numpy array of dtype {value.dtype}")
        key = self.key_for(path)
        self.tensors[key] = self._stage(key, t) if self._stage else t
        return key

    def encode(self, value: Any, path: tuple[Any, ...]) -> Any:
        torch = self._torch
        # bool before int (bool is an int); exact base types so that IntEnum and friends become plain values
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return float(value)
        if isinstance(value, str):
            return str(value)
        if isinstance(value, torch.Tensor):
            return {"__tensor__": self.tensor(value, path)}
        if isinstance(value, Mapping):
            return self.mapping(value, path)
        if isinstance(value, list):
            return [self.encode(v, (*path, i)) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, (*path, i)) for i, v in enumerate(value)]}
        if isinstance(value, bytes | bytearray):
            return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
        if isinstance(value, torch.dtype):
            return {"__dtype__": str(value).removeprefix("torch.")}
        module = type(value).__module__
        if module == "numpy":
            import numpy as np

            if isinstance(value, np.ndarray):
                return {"__ndarray__": self.ndarray(value, path)}
            if isinstance(value, np.bool_ | np.integer | np.floating):
                return value.item()
        raise self.refuse(path, f"a value of type {module}.{type(value).__qualname__}")

    def mapping(self, value: Mapping[Any, Any], path: tuple[Any, ...]) -> Any:
        keys = list(value)
        if all(isinstance(k, str) for k in keys) and not (len(keys) == 1 and keys[0] in MARKERS):
            return {str(k): self.encode(v, (*path, k)) for k, v in value.items()}
        pairs = []
        for k, v in value.items():
            if isinstance(k, Mapping | list | self._torch.Tensor):
                raise self.refuse(path, f"a dict key of type {type(k).__qualname__}")
            pairs.append([self.encode(k, (*path, "<key>")), self.encode(v, (*path, k))])
        return {"__dict__": pairs}


def encode(value: Any, *, name: str, root_key: str = "value", stage: Stage | None = None) -> EncodedTree:
    """Encode a nested value; tensors are collected under their tree path.

    Args:
        value: the state to encode (a state_dict, a list of RNG states, a plain value, ...).
        name: how error messages name the root (`state['model']`).
        root_key: the tensor key used when `value` itself is a tensor (its tree path is empty).
        stage: maps each tensor to the CPU tensor to store (a copy for async saves); the default moves
            tensors to CPU and leaves CPU tensors uncopied.

    Raises:
        SerializationError: a value that has no pickle-free encoding, naming where it is.
    """
    encoder = _Encoder(name, root_key, stage)
    tree = encoder.encode(value, ())
    return EncodedTree(tree, encoder.tensors)


def decode(tree: Any, tensors: Mapping[str, torch.Tensor], *, source: str) -> Any:
    """Rebuild the value of an encoded tree.

    Args:
        tree: the JSON form.
        tensors: the tensors its `__tensor__`/`__ndarray__` markers refer to.
        source: the file name, for messages.

    Raises:
        CorruptCheckpoint: an unknown marker form, a reference to a missing tensor, bad base64.
    """

    def bad(what: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{source}: {what}")

    def tensor(key: Any) -> torch.Tensor:
        if not isinstance(key, str) or key not in tensors:
            raise bad(f"refers to tensor {key!r}, which its safetensors file does not hold")
        return tensors[key]

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        if len(node) != 1 or next(iter(node)) not in MARKERS:
            return {k: walk(v) for k, v in node.items()}
        marker, arg = next(iter(node.items()))
        if marker == "__tensor__":
            return tensor(arg)
        if marker == "__ndarray__":
            return tensor(arg).numpy()
        if marker == "__tuple__":
            if not isinstance(arg, list):
                raise bad("__tuple__ must hold an array")
            return tuple(walk(v) for v in arg)
        if marker == "__dict__":
            if not isinstance(arg, list) or not all(isinstance(p, list) and len(p) == 2 for p in arg):
                raise bad("__dict__ must hold [key, value] pairs")
            try:
                return {walk(k): walk(v) for k, v in arg}
            except TypeError as exc:  # an unhashable key
                raise bad(f"__dict__ has an unusable key ({exc})") from exc
        if marker == "__bytes__":
            try:
                return base64.b64decode(arg, validate=True)
            except (ValueError, TypeError) as exc:
                raise bad("__bytes__ is not base64") from exc
        import torch

        dtype = getattr(torch, arg, None) if isinstance(arg, str) else None
        if not isinstance(dtype, torch.dtype):
            raise bad(f"unknown dtype {arg!r}")
        return dtype

    try:
        return walk(tree)
    except RecursionError as exc:
        raise bad("tree is nested too deeply") from exc


def _iter_tensor_refs(node: Any) -> Iterator[str]:
    if isinstance(node, list):
        for v in node:
            yield from _iter_tensor_refs(v)
    elif isinstance(node, dict):
        if len(node) == 1 and next(iter(node)) in ("__tensor__", "__ndarray__"):
            yield next(iter(node.values()))
        else:
            for v in node.values():
                yield from _iter_tensor_refs(v)


def write_files(
    folder: str, stem: str, encoded: EncodedTree, extra: Mapping[str, Any] | None = None, *, fsync: bool = True
) -> dict[str, st.WrittenFile]:
    """Write `{stem}.json` and, when there are tensors, `{stem}.safetensors` into a local folder.

    Both files are hashed while written and fsynced, so the caller can record them in a manifest
    without reading them back.

    Args:
        folder: the local folder (usually a staging folder).
        stem: the file name stem (the state entry name, `rng`, `rng.rank-3`).
        encoded: what `encode` returned.
        extra: more top-level fields of the JSON document (e.g. a module state_dict's `_metadata`).
        fsync: fsync each file; False leaves it to the caller, who fsyncs every file of a commit at once
            (one journal commit rather than one per file).

    Returns:
        file name (relative to `folder`) -> size and blake3 digest.
    """
    written: dict[str, st.WrittenFile] = {}
    if encoded.tensors:
        name = f"{stem}.safetensors"
        written[name] = st.write_file(os.path.join(folder, name), encoded.tensors, fsync=fsync)
    doc = {"tree": encoded.tree, **(extra or {})}
    name = f"{stem}.json"
    with open(os.path.join(folder, name), "wb") as raw:
        out = HashingWriter(raw)
        out.write(json.dumps(doc, allow_nan=True, separators=(",", ":")).encode("utf-8"))
        raw.flush()
        if fsync:
            os.fsync(raw.fileno())
    written[name] = st.WrittenFile(out.size, out.hexdigest())
    return written


def read_files(folder: str, stem: str) -> StoredTree:
    """Read `{stem}.json` (and its safetensors file, if the tree refers to tensors) back into a value.

    Raises:
        CheckpointNotFound: the JSON file, or the safetensors file its tree refers to, is missing.
        CorruptCheckpoint: invalid JSON, a tree that does not decode, a malformed safetensors file.
    """
    json_url = io.join(folder, f"{stem}.json")
    doc = read_json(json_url, max_bytes=MAX_TREE_BYTES)
    if not isinstance(doc, dict) or "tree" not in doc:
        raise CorruptCheckpoint(f"{json_url}: not an encoded tree (no 'tree' field)")
    tree = doc.pop("tree")
    tensors: Mapping[str, torch.Tensor] = {}
    if next(_iter_tensor_refs(tree), None) is not None:
        tensor_url = io.join(folder, f"{stem}.safetensors")
        if io.is_local(tensor_url):  # the fast path: mapped in place rather than read into memory
            tensors = _load_local_safetensors(io.local_path(tensor_url))
        else:
            tensors = st.read_tensors(tensor_url)
    return StoredTree(decode(tree, tensors, source=json_url), doc)


def _load_local_safetensors(path: str) -> dict[str, torch.Tensor]:
    # ckptctl's validating parser checks the header first (cheap, one read); the safetensors library
    # then loads the data through mmap, much faster than reading tensor by tensor.
    from safetensors.torch import load_file

    header = st.read_header(path)
    if not header.tensors:
        return {}
    try:
        return load_file(path)
    except Exception as exc:  # the library raises its own SafetensorError for anything malformed
        raise CorruptCheckpoint(f"{path}: cannot load tensors ({exc})") from exc
