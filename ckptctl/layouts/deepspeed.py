"""DeepSpeed ZeRO save folders, as `engine.save_checkpoint` writes them (LAYOUTS.md, DeepSpeed).

```
SAVE_DIR/latest                         the newest tag, e.g. `global_step40`
SAVE_DIR/{tag}/                         one checkpoint (a "tag folder")
    mp_rank_{mp:02d}_model_states.pt                        ZeRO 0-2: module weights + metadata
    zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt      ZeRO-3: one per DP rank, no weights inside
    [bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt   one per DP rank: fp32 flat partitions
```

Everything is read through `formats.torch_pickle` (the `data.pkl` of each file and its zip directory),
so neither DeepSpeed nor torch is needed and no tensor bytes are read to list, inspect or verify.

The tensor index reproduces what DeepSpeed's `zero_to_fp32.py` computes, as byte ranges instead of
tensors: ZeRO-1/2 concatenate each group's per-rank fp32 partitions and lay parameters out one after
another (plus `param_alignment_paddings`); ZeRO-3 partitions each parameter separately into
`ceil(numel / dp)` elements per rank. Each parameter's piece on each rank is a contiguous element range,
which `formats.chunks.flat_range_boxes` turns into RAW chunks. So the index holds the model (bf16 `module`
weights under ZeRO 0-2; the fp32 master weights under ZeRO-3), and the optimizer state unflattened per
parameter (`optimizer.state.<name>.exp_avg`, ZeRO-1/2 fp32 masters as `optimizer.fp32.<name>`).

The pieces the trainer layout reuses for a DeepSpeed folder inside `checkpoint-N/` take a `path_prefix`
that makes file names relative to the outer checkpoint: `tag_files`, `read_tag`, `tag_index`, `verify_tag`.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import (
    Checkpoint,
    CheckpointRef,
    CheckpointState,
    ChunkEncoding,
    Component,
    Problem,
    ProblemKind,
    TensorChunk,
    TensorEntry,
    dtype_itemsize,
)
from ckptctl.errors import CkptctlError, CorruptCheckpoint, UnknownLayout, UnsafePickle
from ckptctl.formats.chunks import flat_range_boxes, tiling_problem
from ckptctl.formats.safe_pickle import FrameworkObject, StandIn, TensorRef, state_fields
from ckptctl.formats.torch_pickle import TorchPickle, open_torch_pickle, storage_problems, tensor_refs
from ckptctl.io import DirEntry
from ckptctl.layouts.base import LISTED_ABSENT, folder_size, newest_mtime, step_from_name, timestamp

__all__ = [
    "ENGINE_KEYS",
    "LATEST_NAME",
    "DeepSpeedLayout",
    "DeepSpeedTag",
    "MasterWeights",
    "TagFiles",
    "latest_problem",
    "master_weights",
    "read_latest",
    "read_tag",
    "tag_files",
    "tag_index",
    "verify_tag",
]

LATEST_NAME = "latest"
_MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(?P<dp>\d+)_)?mp_rank_(?P<mp>\d+)_model_states\.pt$")
_OPTIM_STATES = re.compile(r"^(?P<bf16>bf16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
#: Top-level keys of model_states that DeepSpeed itself writes; every other key is client state.
_ENGINE_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "checkpoint_parallel_dimensions",
        "universal_checkpoint_info",
        "compiled_autograd",
    }
)
#: The same, for the layouts built on DeepSpeed that read client state themselves (OpenRLHF, open-instruct).
ENGINE_KEYS = _ENGINE_KEYS
_COUNTERS = ("global_steps", "global_samples", "skipped_steps")
_MAX_LATEST_BYTES = 4096


# --------------------------------------------------------------------------------------------------
# Names: which rank files a tag folder holds, and which ones it lacks (no file is read).
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TagFiles:
    """The rank files of a tag folder, from its listing.

    Attributes:
        model: (DP rank, or None for the ZeRO 0-2 naming; MP rank) -> model-states file name.
        optim: (DP rank, MP rank) -> optim-states file name.
        sizes: file name -> size, for every file in the folder.
        bf16: whether the optim files carry the `bf16_` prefix.
    """

    model: dict[tuple[int | None, int], str]
    optim: dict[tuple[int, int], str]
    sizes: dict[str, int]
    bf16: bool

    @property
    def per_dp_model_files(self) -> bool:
        """Whether model states are saved per DP rank (`zero_pp_rank_*`: ZeRO-3)."""
        return any(dp is not None for dp, _ in self.model)

    def model_name(self, dp: int, mp: int) -> str:
        return (
            f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt" if self.per_dp_model_files else self.model_name_0(mp)
        )

    @staticmethod
    def model_name_0(mp: int) -> str:
        return f"mp_rank_{mp:02d}_model_states.pt"

    def optim_name(self, dp: int, mp: int) -> str:
        return f"{'bf16_' if self.bf16 else ''}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"

    def rank0_model(self, mp: int = 0) -> str | None:
        """The model-states file that holds the tag's metadata for an MP rank (DP rank 0)."""
        return self.model.get((0, mp)) or self.model.get((None, mp))

    def missing_from_names(self) -> list[str]:
        """Rank files the names of the others promise but the folder lacks (the first `LISTED_ABSENT`).

        MP ranks must run 0..max; DP ranks too, and under ZeRO-3 the model and optim files must cover the
        same DP ranks. A missing highest rank is only seen by `verify_tag`, which reads `dp_world_size`.
        """
        mps = {mp for _, mp in self.model} | {mp for _, mp in self.optim}
        mp_count = max(mps) + 1 if mps else 1
        dps = {dp for dp, _ in self.optim} | {dp for dp, _ in self.model if dp is not None}
        dp_count = max(dps) + 1 if dps else 0

        def expected() -> Iterator[str]:
            for mp in range(mp_count):
                if self.per_dp_model_files:
                    yield from (self.model_name(dp, mp) for dp in range(max(dp_count, 1)))
                else:
                    yield self.model_name_0(mp)
                if self.optim or self.per_dp_model_files:
                    yield from (self.optim_name(dp, mp) for dp in range(max(dp_count, 1)))

        # The first few only: one stray `zero_pp_rank_99999999_...` name would otherwise promise (and make
        # us list) a hundred million files.
        return list(itertools.islice((name for name in expected() if name not in self.sizes), LISTED_ABSENT))


#: The most ranks (dp x mp) a tag may have: far beyond any DeepSpeed job, small enough to enumerate.
MAX_RANKS = 1 << 18


def tag_files(entries: Sequence[DirEntry]) -> TagFiles | None:
    """The rank files of a folder listing, or None when it holds no DeepSpeed model or optim states."""
    model: dict[tuple[int | None, int], str] = {}
    optim: dict[tuple[int, int], str] = {}
    sizes = {}
    bf16 = False
    for entry in entries:
        if entry.is_dir:
            continue
        sizes[entry.name] = entry.size
        if m := _MODEL_STATES.match(entry.name):
            model[(None if m.group("dp") is None else int(m.group("dp")), int(m.group("mp")))] = entry.name
        elif m := _OPTIM_STATES.match(entry.name):
            optim[(int(m.group("dp")), int(m.group("mp")))] = entry.name
            bf16 = bf16 or m.group("bf16") is not None
    if not model and not optim:
        return None
    return TagFiles(model, optim, sizes, bf16)


def read_latest(url: str, entries: Sequence[DirEntry]) -> str | None:
    """The tag a save folder's `latest` file names (None when there is no readable one)."""
    entry = next((e for e in entries if e.name == LATEST_NAME and not e.is_dir), None)
    if entry is None or entry.size > _MAX_LATEST_BYTES:
        return None
    try:
        text = io.read_bytes(io.join(url, LATEST_NAME), max_size=_MAX_LATEST_BYTES).decode("utf-8").strip()
    except (CkptctlError, UnicodeDecodeError):
        return None
    return text if text and "/" not in text and "\n" not in text else None


def latest_problem(save_dir: str, path: str) -> Problem | None:
    """A problem when `save_dir/latest` names a tag folder that does not exist (a resume would fail)."""
    try:
        entries = io.list_dir(save_dir)
    except CkptctlError:
        return None
    if not any(e.name == LATEST_NAME and not e.is_dir for e in entries):
        return None
    tag = read_latest(save_dir, entries)
    if tag is None:
        return Problem(ProblemKind.BAD_METADATA, path, f"{path} does not name a tag")
    if not any(e.name == tag and e.is_dir for e in entries):
        return Problem(
            ProblemKind.MISSING_FILE,
            path,
            f"{path} names tag {tag!r}, which does not exist: a resume that follows it fails "
            "(write the tag to resume from into it)",
        )
    return None


# --------------------------------------------------------------------------------------------------
# Reading a tag: facts from the rank-0 files.
# --------------------------------------------------------------------------------------------------


@dataclass
class DeepSpeedTag:
    """A tag folder opened from its rank-0 files; the other rank files are read on demand (and kept).

    Attributes:
        url: the tag folder.
        files: its rank files.
        states: the rank-0 model states (MP rank 0).
        zero_stage: 0-3 (from the optim states, else `ds_config`).
        dp_world_size: data-parallel ranks (`dp_world_size`).
        mp_world_size: model-parallel ranks (`mp_world_size`).
        partition_count: how many partitions the optimizer state was cut into (None without ZeRO).
        optim_kind: which optimizer wrote the optim files (`zero`, `zero3`, `bf16`), None without them.
    """

    url: str
    files: TagFiles
    states: dict[str, Any]
    zero_stage: int
    dp_world_size: int
    mp_world_size: int
    partition_count: int | None
    optim_kind: str | None
    optim_info: dict[str, Any]
    _opened: dict[str, TorchPickle] = field(default_factory=dict, repr=False)

    def open_file(self, name: str) -> TorchPickle:
        """One rank file, parsed once."""
        found = self._opened.get(name)
        if found is None:
            found = self._opened[name] = open_torch_pickle(io.join(self.url, name), self.files.sizes.get(name))
        return found

    @property
    def global_steps(self) -> int | None:
        value = self.states.get("global_steps")
        return value if type(value) is int else None

    def components(self) -> frozenset[Component]:
        found = {Component.MODEL, Component.TRAINER_STATE}
        if self.files.optim or self.states.get("optimizer") is not None:
            found.add(Component.OPTIMIZER)
        if self.states.get("lr_scheduler") is not None:
            found.add(Component.SCHEDULER)
        if self.states.get("data_sampler") is not None:
            found.add(Component.DATALOADER)
        if self.client_state():
            found.add(Component.EXTRA)
        return frozenset(found)

    def client_state(self) -> dict[str, Any]:
        """The keys `save_checkpoint(client_state=...)` added to the model states."""
        return {k: v for k, v in self.states.items() if isinstance(k, str) and k not in _ENGINE_KEYS}

    def metadata(self) -> dict[str, Any]:
        progress = {k: self.states[k] for k in _COUNTERS if _is_scalar(self.states.get(k))}
        progress.update({k: v for k, v in self.client_state().items() if _is_scalar(v)})
        info: dict[str, Any] = {
            "format": "deepspeed",
            "tag": io.name_of(self.url),
            "zero_stage": self.zero_stage,
            "dp_world_size": self.dp_world_size,
            "mp_world_size": self.mp_world_size,
            "partition_count": self.partition_count,
            "progress": progress,
            "precision": _precision(self.states.get("ds_config"), self.files.bf16),
            "ds_version": self.states.get("ds_version"),
            "model_states_files": len(self.files.model),
            "optim_states_files": len(self.files.optim),
        }
        info.update(self.optim_info)
        others = sorted(k for k, v in self.client_state().items() if not _is_scalar(v))
        if others:
            info["client_state_keys"] = ", ".join(others)
        return info


def _is_scalar(value: Any) -> bool:
    return type(value) in (int, float, str, bool)


def _precision(config: Any, bf16_files: bool) -> str:
    if isinstance(config, dict):
        for key in ("bf16", "bfloat16", "fp16"):
            section = config.get(key)
            if isinstance(section, dict) and section.get("enabled") is True:
                return "fp16" if key == "fp16" else "bf16"
    return "bf16" if bf16_files else "fp32"


def _enum_value(value: Any) -> Any:
    return value.value if isinstance(value, FrameworkObject) else value


def read_tag(url: str, files: TagFiles | None = None) -> DeepSpeedTag:
    """Open a tag folder: the rank-0 model states (and optim states, when there are any).

    Raises:
        CorruptCheckpoint: no rank-0 model states, or one that does not parse (UnsafePickle included).
    """
    if files is None:
        files = tag_files(io.list_dir(url))
        if files is None:
            raise UnknownLayout(f"{url} holds no DeepSpeed model or optim states")
    rank0 = files.rank0_model()
    if rank0 is None:
        raise CorruptCheckpoint(f"{url}: the rank-0 model states ({files.model_name(0, 0)}) are missing")
    tag = DeepSpeedTag(url, files, {}, 0, 1, 1, None, None, {})
    states = tag.open_file(rank0).root
    if not isinstance(states, dict):
        raise CorruptCheckpoint(f"{url}/{rank0}: not a DeepSpeed model states dict")
    tag.states = states
    dp = states.get("dp_world_size")
    mp = states.get("mp_world_size")
    tag.dp_world_size = dp if type(dp) is int and dp > 0 else max((d for d, _ in files.optim), default=0) + 1
    tag.mp_world_size = mp if type(mp) is int and mp > 0 else max(m for _, m in files.model) + 1
    if tag.dp_world_size * tag.mp_world_size > MAX_RANKS:
        # Every rank is looked for by name: a damaged count (or a stray rank file name) must not send us
        # looping over billions of them.
        raise CorruptCheckpoint(
            f"{url}: dp_world_size {tag.dp_world_size} x mp_world_size {tag.mp_world_size} is more ranks than "
            f"ckptctl believes (at most {MAX_RANKS}); the model states or the rank file names are damaged"
        )
    config = states.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    stage = zero.get("stage") if isinstance(zero, dict) else None
    tag.zero_stage = stage if type(stage) is int else 0
    optim0 = files.optim.get((0, 0))
    if optim0 is not None:
        osd = _optimizer_state_dict(tag.open_file(optim0))
        stored_stage = _enum_value(osd.get("zero_stage"))
        if type(stored_stage) is int:
            tag.zero_stage = stored_stage
        tag.optim_kind = "zero3" if "fp32_flat_groups" in osd else ("zero" if "zero_stage" in osd else "bf16")
        tag.partition_count = _partition_count(osd.get("partition_count"))
        tag.optim_info = _optim_info(osd)
    return tag


def _optimizer_state_dict(opened: TorchPickle) -> dict[str, Any]:
    root = opened.root
    osd = root.get("optimizer_state_dict") if isinstance(root, dict) else None
    if not isinstance(osd, dict):
        raise CorruptCheckpoint(f"{opened.url}: no optimizer_state_dict in a DeepSpeed optim states file")
    return osd


def _partition_count(value: Any) -> int | None:
    if type(value) is int:
        return value
    if isinstance(value, list) and value and all(type(v) is int for v in value):
        return max(value)  # one per parameter group; expert groups of MoE models may be smaller
    return None


def _optim_info(osd: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = {}
    scaler = osd.get("loss_scaler")
    if isinstance(scaler, StandIn):
        fields = state_fields(scaler, "loss_scaler")
        if _is_scalar(fields.get("cur_scale")):
            info["loss_scale"] = fields["cur_scale"]
    groups = _base_state(osd).get("param_groups")
    if isinstance(groups, list) and groups and isinstance(groups[0], dict):
        first = groups[0]
        info["optimizer"] = {k: first[k] for k in ("lr", "weight_decay", "eps") if _is_scalar(first.get(k))}
        info["param_groups"] = len(groups)
    return info


def _base_state(osd: dict[str, Any]) -> dict[str, Any]:
    """The wrapped torch optimizer's state dict (ZeRO-3 and BF16 name it differently from ZeRO-1/2)."""
    for key in ("optimizer_state_dict", "base_optimizer_state"):
        value = osd.get(key)
        if isinstance(value, dict):
            return value
        if isinstance(value, list):  # older ZeRO-1/2: one state dict per group, no param_groups
            return {"state": dict(enumerate(value))}
    return {}


# --------------------------------------------------------------------------------------------------
# The tensor index.
# --------------------------------------------------------------------------------------------------

#: A parameter's piece on one rank: (DP rank, group, first element in the rank's flat group tensor,
#: first and one-past-last element of the piece in the full parameter, flattened).
Piece = tuple[int, int, int, int, int]


def tag_index(tag: DeepSpeedTag, path_prefix: str = "") -> tuple[TensorEntry, ...]:
    """The tensor index of a tag: model (+ buffers) and the optimizer state per parameter.

    Args:
        tag: from `read_tag`.
        path_prefix: prepended to chunk file names (the trainer layout passes `global_stepN/`).

    Raises:
        UnsafePickle, CorruptCheckpoint: a rank file does not parse, or the fp32 partitions do not hold
            what `param_shapes` says.
    """
    entries: list[TensorEntry] = []
    for mp in range(tag.mp_world_size):
        name_prefix = f"mp_rank_{mp:02d}." if tag.mp_world_size > 1 else ""
        entries += _IndexBuilder(tag, mp, path_prefix, name_prefix).build()
    return tuple(entries)


class _IndexBuilder:
    """Builds the entries of one MP rank of a tag."""

    def __init__(self, tag: DeepSpeedTag, mp: int, path_prefix: str, name_prefix: str) -> None:
        self.tag = tag
        self.mp = mp
        self.path_prefix = path_prefix
        self.name_prefix = name_prefix
        rank0 = tag.files.rank0_model(mp)
        if rank0 is None:
            raise CorruptCheckpoint(f"{tag.url}: the model states of MP rank {mp} are missing")
        self.model_file = rank0
        states = tag.open_file(rank0).root
        self.states: dict[str, Any] = states if isinstance(states, dict) else {}
        module = self.states.get("module")
        self.module: dict[str, Any] = module if isinstance(module, dict) else {}

    def build(self) -> list[TensorEntry]:
        if self.states.get("param_shapes") is None and not self.tag.files.optim:
            return self._without_zero()
        groups = _param_groups(self.states.get("param_shapes"))
        entries: list[TensorEntry] = []
        optim_names = [self.tag.files.optim.get((dp, self.mp)) for dp in range(self.tag.dp_world_size)]
        have_optim = bool(self.tag.files.optim)
        if have_optim and any(name is None for name in optim_names):
            missing = [self.tag.files.optim_name(dp, self.mp) for dp, n in enumerate(optim_names) if n is None]
            raise CorruptCheckpoint(f"{self.tag.url}: optim states missing: {', '.join(missing)}")
        flat: list[list[TensorRef]] = []
        pieces: dict[str, list[Piece]] = {}
        if have_optim:
            osds = [_optimizer_state_dict(self.tag.open_file(n)) for n in optim_names if n]
            key = "fp32_flat_groups" if self.tag.optim_kind == "zero3" else "single_partition_of_fp32_groups"
            flat = [
                _flat_groups(osd.get(key), f"{self.tag.url}/{n}: {key}")
                for osd, n in zip(osds, optim_names, strict=True)
            ]
            if self.tag.optim_kind == "zero3":
                pieces = _zero3_pieces(groups, flat, self.tag.url)
            else:
                paddings = osds[0].get("param_alignment_paddings")
                pieces = _zero12_pieces(groups, flat, paddings if isinstance(paddings, list) else None, self.tag.url)
        shapes = {name: shape for group in groups for name, shape in group.items()}
        fp32_is_model = self.tag.optim_kind == "zero3"
        for name, shape in shapes.items():
            module_ref = self.module.get(name)
            if not fp32_is_model and type(module_ref) is TensorRef and module_ref.shape == shape:
                entries.append(self._from_file(name, Component.MODEL, self.model_file, module_ref))
            elif name in pieces:
                entries.append(self._from_pieces(name, Component.MODEL, shape, pieces[name], flat, optim_names))
            else:
                entries.append(TensorEntry(self.name_prefix + name, Component.MODEL, "float32", shape, ()))
        entries += self._frozen()
        entries += self._buffers(shapes)
        if have_optim:
            if not fp32_is_model:
                entries += [
                    self._from_pieces(
                        f"optimizer.fp32.{name}", Component.OPTIMIZER, shape, pieces[name], flat, optim_names
                    )
                    for name, shape in shapes.items()
                    if name in pieces
                ]
            entries += self._optimizer_states(groups, flat, pieces, optim_names)
        return entries

    def _without_zero(self) -> list[TensorEntry]:
        """ZeRO stage 0: no param_shapes, the module holds every weight and the model states the optimizer."""
        opened = self.tag.open_file(self.model_file)
        entries = [
            self._from_file(name, Component.MODEL, self.model_file, ref, opened)
            for name, ref in self.module.items()
            if type(ref) is TensorRef
        ]
        if self.states.get("optimizer") is not None:
            entries += [
                self._from_file(f"optimizer.{path}", Component.OPTIMIZER, self.model_file, ref, opened)
                for path, ref in tensor_refs(self.states["optimizer"])
            ]
        return entries

    def _from_file(
        self, name: str, component: Component, file: str, ref: TensorRef, opened: TorchPickle | None = None
    ) -> TensorEntry:
        opened = opened or self.tag.open_file(file)
        found = opened.byte_range(ref)
        chunks: tuple[TensorChunk, ...] = ()
        if found is not None:
            chunk = TensorChunk(
                self.path_prefix + file,
                found[0],
                found[1] - found[0],
                (0,) * len(ref.shape),
                ref.shape,
                ChunkEncoding.RAW,
            )
            chunks = (chunk,)
        return TensorEntry(self.name_prefix + name, component, ref.dtype, ref.shape, chunks)

    def _from_pieces(
        self,
        name: str,
        component: Component,
        shape: tuple[int, ...],
        pieces: list[Piece],
        flat: list[list[TensorRef]],
        files: Sequence[str | None],
    ) -> TensorEntry:
        dtype = flat[0][0].dtype if flat and flat[0] else "float32"
        chunks = []
        for rank, group, local, lo, hi in pieces:
            source = flat[rank][group]
            file = files[rank]
            assert file is not None
            chunks += _chunks(self.tag.open_file(file), source, local, lo, hi, shape, self.path_prefix + file)
        return TensorEntry(self.name_prefix + name, component, dtype, shape, tuple(chunks))

    def _frozen(self) -> list[TensorEntry]:
        frozen = self.states.get("frozen_param_shapes")
        if not isinstance(frozen, dict) or not frozen:
            return []
        out = []
        for name, raw_shape in frozen.items():
            shape = _shape(raw_shape)
            module_ref = self.module.get(name)
            if type(module_ref) is TensorRef and module_ref.shape == shape:
                out.append(self._from_file(name, Component.MODEL, self.model_file, module_ref))
                continue
            # ZeRO-3: each DP rank's model states hold its fragment; concatenated they give the weight.
            chunks: list[TensorChunk] = []
            dtype = "float32"
            start = 0
            numel = math.prod(shape)
            for dp in range(self.tag.dp_world_size):
                file = self.tag.files.model.get((dp, self.mp))
                states = self.tag.open_file(file).root if file else None
                fragments = states.get("frozen_param_fragments") if isinstance(states, dict) else None
                fragment = fragments.get(name) if isinstance(fragments, dict) else None
                if file is None or type(fragment) is not TensorRef:
                    raise CorruptCheckpoint(f"{self.tag.url}: the fragment of frozen {name} on DP rank {dp} is missing")
                dtype = fragment.dtype
                stop = min(numel, start + fragment.numel)
                chunks += _chunks(self.tag.open_file(file), fragment, 0, start, stop, shape, self.path_prefix + file)
                start = stop
            out.append(TensorEntry(self.name_prefix + name, Component.MODEL, dtype, shape, tuple(chunks)))
        return out

    def _buffers(self, params: Mapping[str, tuple[int, ...]]) -> list[TensorEntry]:
        names = self.states.get("buffer_names")
        if not isinstance(names, list):
            return []
        return [
            self._from_file(name, Component.MODEL, self.model_file, ref)
            for name in names
            if name not in params and type(ref := self.module.get(name)) is TensorRef
        ]

    def _optimizer_states(
        self,
        groups: list[dict[str, tuple[int, ...]]],
        flat: list[list[TensorRef]],
        pieces: dict[str, list[Piece]],
        files: Sequence[str | None],
    ) -> list[TensorEntry]:
        """Flat state tensors (exp_avg, ...) laid out like the fp32 partitions, unflattened per parameter;
        other state tensors (a group's `step`) from DP rank 0 as they are."""
        per_rank: list[dict[int, dict[str, Any]]] = []
        for file in files:
            state = _base_state(_optimizer_state_dict(self.tag.open_file(file or ""))).get("state")
            state = state if isinstance(state, dict) else {}
            per_rank.append({g: v for g, v in state.items() if type(g) is int and isinstance(v, dict)})
        keys = list(dict.fromkeys(k for g in per_rank[0].values() for k, v in g.items() if type(v) is TensorRef))
        shapes = {name: shape for group in groups for name, shape in group.items()}
        out: list[TensorEntry] = []
        for key in keys:
            layout: list[list[TensorRef]] = []
            for rank, states in enumerate(per_rank):
                row = [states.get(g, {}).get(key) for g in range(len(flat[rank]))]
                if not all(type(t) is TensorRef and t.numel == f.numel for t, f in zip(row, flat[rank], strict=True)):
                    break
                layout.append([t for t in row if type(t) is TensorRef])
            if len(layout) == len(per_rank):
                out += [
                    self._from_pieces(
                        f"optimizer.state.{name}.{key}", Component.OPTIMIZER, shape, pieces[name], layout, files
                    )
                    for name, shape in shapes.items()
                    if name in pieces
                ]
                continue
            for g, group_state in per_rank[0].items():
                value = group_state.get(key)
                if type(value) is TensorRef:
                    name = f"optimizer.state.group{g}.{key}"
                    out.append(self._from_file(name, Component.OPTIMIZER, files[0] or "", value))
        return out


def _chunks(
    opened: TorchPickle, source: TensorRef, local: int, lo: int, hi: int, shape: tuple[int, ...], file: str
) -> list[TensorChunk]:
    """RAW chunks for elements `lo:hi` of a tensor of `shape` stored from element `local` of `source`."""
    if hi <= lo:
        return []
    if local + (hi - lo) > source.numel:
        raise CorruptCheckpoint(
            f"{opened.url}: a flat partition holds {source.numel} elements, fewer than param_shapes need"
        )
    found = opened.byte_range(source)
    if found is None:
        raise CorruptCheckpoint(f"{opened.url}: a flat partition is not stored contiguously")
    itemsize = dtype_itemsize(source.dtype)
    return [
        TensorChunk(
            file,
            found[0] + (local + first - lo) * itemsize,
            math.prod(sizes) * itemsize,
            offsets,
            sizes,
            ChunkEncoding.RAW,
        )
        for (offsets, sizes), first in flat_range_boxes(shape, lo, hi)
    ]


def _shape(value: Any) -> tuple[int, ...]:
    if type(value) in (tuple, list) and all(type(d) is int and d >= 0 for d in value):
        return tuple(value)
    raise CorruptCheckpoint(f"a parameter shape is not a tuple of sizes: {value!r}"[:200])


def _param_groups(value: Any) -> list[dict[str, tuple[int, ...]]]:
    """`param_shapes`: one {name: shape} per parameter group (older versions: a single dict)."""
    groups = value if isinstance(value, list) else [value] if isinstance(value, dict) else None
    if groups is None or not all(isinstance(g, dict) for g in groups):
        raise CorruptCheckpoint("the model states have no param_shapes")
    return [{str(name): _shape(shape) for name, shape in group.items()} for group in groups]


def _flat_groups(value: Any, where: str) -> list[TensorRef]:
    if isinstance(value, list) and all(type(v) is TensorRef and len(v.shape) == 1 for v in value):
        return value
    raise CorruptCheckpoint(f"{where} is not a list of flat tensors")


def _zero12_pieces(
    groups: list[dict[str, tuple[int, ...]]], flat: list[list[TensorRef]], paddings: list[Any] | None, url: str
) -> dict[str, list[Piece]]:
    """ZeRO-1/2 (`zero_to_fp32._zero2_merge_trainable_params`): a group's partitions concatenated over
    ranks hold its parameters one after another, each followed by its alignment padding."""
    pieces: dict[str, list[Piece]] = {}
    for g, group in enumerate(groups):
        if any(len(ranks) <= g for ranks in flat):
            raise CorruptCheckpoint(f"{url}: the optim states have fewer fp32 groups than param_shapes")
        starts = [0]
        for ranks in flat:
            starts.append(starts[-1] + ranks[g].numel)
        group_paddings = paddings[g] if paddings is not None and g < len(paddings) else None
        offset = 0
        for k, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            own = []
            for rank in range(len(flat)):
                lo, hi = max(offset, starts[rank]), min(offset + numel, starts[rank + 1])
                if lo < hi:
                    own.append((rank, g, lo - starts[rank], lo - offset, hi - offset))
            pieces[name] = own
            offset += numel
            if isinstance(group_paddings, list) and k < len(group_paddings) and type(group_paddings[k]) is int:
                offset += group_paddings[k]
        if offset > starts[-1]:
            raise CorruptCheckpoint(
                f"{url}: param_shapes need {offset} elements in group {g} but the fp32 partitions hold {starts[-1]}"
            )
    return pieces


def _zero3_pieces(
    groups: list[dict[str, tuple[int, ...]]], flat: list[list[TensorRef]], url: str
) -> dict[str, list[Piece]]:
    """ZeRO-3 (`zero_to_fp32._zero3_merge_trainable_params`): each parameter is cut into `ceil(numel / dp)`
    elements per rank, at the same position of every rank's groups taken end to end."""
    ranks = len(flat)
    group_starts = [0]
    for tensor in flat[0]:
        group_starts.append(group_starts[-1] + tensor.numel)
    if any([t.numel for t in other] != [t.numel for t in flat[0]] for other in flat):
        raise CorruptCheckpoint(f"{url}: the DP ranks' fp32 partitions differ in size")
    pieces: dict[str, list[Piece]] = {}
    position = 0
    for group in groups:
        for name, shape in group.items():
            numel = math.prod(shape)
            per_rank = -(-numel // ranks)
            own = []
            for rank in range(ranks):
                lo, hi = rank * per_rank, min(numel, (rank + 1) * per_rank)
                at = position
                while lo < hi:  # the piece may run on into the next group
                    g = _group_of(group_starts, at, url)
                    take = min(hi - lo, group_starts[g + 1] - at)
                    own.append((rank, g, at - group_starts[g], lo, lo + take))
                    lo += take
                    at += take
            pieces[name] = own
            position += per_rank
    if position > group_starts[-1]:
        raise CorruptCheckpoint(
            f"{url}: param_shapes need {position} elements per rank but the fp32 partitions hold {group_starts[-1]}"
        )
    return pieces


def _group_of(starts: list[int], position: int, url: str) -> int:
    for g in range(len(starts) - 1):
        if starts[g] <= position < starts[g + 1]:
            return g
    raise CorruptCheckpoint(f"{url}: param_shapes need more elements than the fp32 partitions hold")


# --------------------------------------------------------------------------------------------------
# The full-precision weights, as zero_to_fp32 reconstructs them.
# --------------------------------------------------------------------------------------------------

#: Dtypes whose buffers zero_to_fp32 returns as float32 (`v.float() if v.is_floating_point()`).
_FLOATING = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
_FP32_PREFIX = "optimizer.fp32."


@dataclass(frozen=True, slots=True)
class MasterWeights:
    """The state dict DeepSpeed's `zero_to_fp32` (`get_fp32_state_dict_from_zero_checkpoint`) returns for
    a tag, as index entries named as the module's state dict names them; no tensor data is read.

    Attributes:
        entries: in the module's state-dict order: trainable parameters from the fp32 partitions, frozen
            parameters and buffers from the model states, tied parameters (`shared_params`) as copies of
            the entry they share.
        upcast: floating-point buffers, which zero_to_fp32 returns as float32 whatever their stored dtype.
        notes: where the entries depart from zero_to_fp32's output, for the user.
    """

    entries: tuple[TensorEntry, ...]
    upcast: frozenset[str]
    notes: tuple[str, ...] = ()


def master_weights(tag: DeepSpeedTag, path_prefix: str = "") -> MasterWeights:
    """The full fp32 weights of a ZeRO 1-3 tag, exactly as `zero_to_fp32` reconstructs them.

    zero_to_fp32 (DeepSpeed 0.19) returns the buffers of `buffer_names` from the rank-0 module (floating
    ones cast to float32), the frozen parameters from `frozen_param_fragments` (as stored: the 16-bit
    weights; concatenated over DP ranks under ZeRO-3), every parameter of `param_shapes` from the fp32
    partitions, and each `shared_params` alias as the parameter it shares. One departure: ZeRO-1 records
    no frozen parameters (`frozen_param_shapes` is saved only when gradients are partitioned), so
    zero_to_fp32 drops them; here they come from the module's weights, and `notes` says so.

    Args:
        tag: from `read_tag`.
        path_prefix: prepended to chunk file names (as for `tag_index`).

    Raises:
        CkptctlError: the tag holds no fp32 partitions (no ZeRO, or no optim files) or several
            model-parallel ranks (zero_to_fp32 merges data-parallel partitions only).
        CorruptCheckpoint: the model states or partitions do not hold what they promise.
    """
    if not tag.files.optim or tag.optim_kind is None:
        raise CkptctlError(
            f"{tag.url} holds no fp32 master weights (ZeRO stage {tag.zero_stage} saves no optimizer partitions)",
            "convert the module's own weights instead",
        )
    if tag.mp_world_size > 1:
        raise CkptctlError(
            f"{tag.url} holds {tag.mp_world_size} model-parallel ranks; zero_to_fp32 merges data-parallel "
            "partitions only",
            "merge the tensor-parallel ranks with the training framework's own tool first",
        )
    index = tag_index(tag, path_prefix)
    model = {e.name: e for e in index if e.component is Component.MODEL}
    fp32 = {e.name[len(_FP32_PREFIX) :]: e for e in index if e.name.startswith(_FP32_PREFIX)}
    states = tag.states
    module = states.get("module")
    module = module if isinstance(module, dict) else {}
    buffer_names = states.get("buffer_names")
    buffers = [n for n in buffer_names if isinstance(n, str)] if isinstance(buffer_names, list) else []
    frozen = states.get("frozen_param_shapes")
    frozen_names = [n for n in frozen if isinstance(n, str)] if isinstance(frozen, dict) else []
    trainable = [name for group in _param_groups(states.get("param_shapes")) for name in group]

    found: dict[str, TensorEntry] = {}
    upcast: set[str] = set()
    for name in buffers:
        entry = model.get(name)
        if entry is not None and name not in trainable:
            found[name] = entry
            if entry.dtype in _FLOATING:
                upcast.add(name)
    for name in frozen_names:
        entry = model.get(name)
        if entry is None or not entry.chunks:
            raise CorruptCheckpoint(f"{tag.url}: the weights of frozen parameter {name} are missing")
        found[name] = entry
    for name in trainable:
        entry = model.get(name) if tag.optim_kind == "zero3" else fp32.get(name)
        if entry is None or not entry.chunks:
            raise CorruptCheckpoint(f"{tag.url}: the fp32 partitions hold no {name}")
        found[name] = replace(entry, name=name, component=Component.MODEL)
    shared = states.get("shared_params")
    for alias, target in shared.items() if isinstance(shared, dict) else ():
        if isinstance(alias, str) and target in found:
            found[alias] = replace(found[target], name=alias)
            if target in upcast:
                upcast.add(alias)
    notes = []
    if tag.optim_kind != "zero3":
        builder = _IndexBuilder(tag, 0, path_prefix, "")
        outside = [n for n, ref in module.items() if isinstance(n, str) and n not in found and type(ref) is TensorRef]
        for name in outside:
            found[name] = builder._from_file(name, Component.MODEL, builder.model_file, module[name])
        if outside:
            shown = ", ".join(outside[:3]) + (", ..." if len(outside) > 3 else "")
            notes.append(
                f"{len(outside)} parameter(s) outside the optimizer's partitions ({shown}) come from the module's "
                f"{found[outside[0]].dtype} weights; zero_to_fp32 leaves them out (ZeRO-{tag.zero_stage} "
                "records no frozen parameters)"
            )
    order = {name: i for i, name in enumerate(module)}
    entries = sorted(found.values(), key=lambda e: order.get(e.name, len(order)))
    return MasterWeights(tuple(entries), frozenset(upcast), tuple(notes))


# --------------------------------------------------------------------------------------------------
# Verify.
# --------------------------------------------------------------------------------------------------


def verify_tag(url: str, path_prefix: str = "") -> list[Problem]:
    """Structural problems of a tag folder (reads every rank file's `data.pkl` and zip directory).

    Checks: every model-states file for the MP size (and, under ZeRO-3, every DP rank) and exactly one
    optim-states file per partition are present (MISSING_FILE; extra ranks are UNEXPECTED_FILE
    warnings); each parses and is safe (BAD_METADATA, UNSAFE_PICKLE) and holds every storage it names
    (TRUNCATED); the optim files agree with `dp_world_size` and `partition_count`; the fp32 partitions
    hold what `param_shapes` needs and every tensor's chunks tile it (COVERAGE).
    """
    try:
        entries = io.list_dir(url)
    except CkptctlError:
        return [Problem(ProblemKind.MISSING_FILE, path_prefix or ".", f"the DeepSpeed tag folder {url} is missing")]
    files = tag_files(entries)
    if files is None:
        return [Problem(ProblemKind.MISSING_FILE, path_prefix or ".", "no DeepSpeed model or optim states")]
    problems = [
        Problem(ProblemKind.MISSING_FILE, path_prefix + name, f"{name} is missing")
        for name in files.missing_from_names()
    ]
    try:
        tag = read_tag(url, files)
    except CkptctlError as exc:
        return [*problems, _problem(exc, path_prefix + (files.rank0_model() or files.model_name(0, 0)))]
    expected_model = {
        tag.files.model_name(dp, mp) if files.per_dp_model_files else files.model_name_0(mp)
        for mp in range(tag.mp_world_size)
        for dp in range(tag.dp_world_size)
    }
    expected_optim = (
        {files.optim_name(dp, mp) for mp in range(tag.mp_world_size) for dp in range(tag.dp_world_size)}
        if files.optim or tag.zero_stage >= 1
        else set()
    )
    reported = {p.path for p in problems}
    absent = [
        n for n in sorted((expected_model | expected_optim) - set(files.sizes)) if path_prefix + n not in reported
    ]
    for name in absent[:LISTED_ABSENT]:
        problems.append(
            Problem(
                ProblemKind.MISSING_FILE,
                path_prefix + name,
                f"{name} is missing (dp_world_size {tag.dp_world_size}, mp_world_size {tag.mp_world_size})",
            )
        )
    if len(absent) > LISTED_ABSENT:
        problems.append(
            Problem(
                ProblemKind.MISSING_FILE,
                path_prefix or ".",
                f"{len(absent) - LISTED_ABSENT} more rank files are missing "
                f"(dp_world_size {tag.dp_world_size}, mp_world_size {tag.mp_world_size})",
            )
        )
    for name in sorted((set(files.model.values()) | set(files.optim.values())) - expected_model - expected_optim):
        problems.append(
            Problem(
                ProblemKind.UNEXPECTED_FILE,
                path_prefix + name,
                f"a rank file beyond dp_world_size {tag.dp_world_size} (left by an earlier save with more ranks?)",
                severity="warning",
            )
        )
    if tag.partition_count is not None and tag.partition_count != tag.dp_world_size:
        problems.append(
            Problem(
                ProblemKind.BAD_METADATA,
                path_prefix + files.optim_name(0, 0),
                f"partition_count {tag.partition_count} differs from dp_world_size {tag.dp_world_size}",
            )
        )
    broken = False
    for name in sorted((expected_model | expected_optim) & set(files.sizes)):
        try:
            opened = tag.open_file(name)
        except CkptctlError as exc:
            problems.append(_problem(exc, path_prefix + name))
            broken = True
            continue
        problems += [Problem(ProblemKind.TRUNCATED, path_prefix + name, m) for m in storage_problems(opened)]
        if name in expected_optim:
            problems += _optim_file_problems(tag, opened, path_prefix + name)
    if broken or any(p.severity == "error" for p in problems):
        return problems
    try:
        index = tag_index(tag, path_prefix)
    except CkptctlError as exc:
        return [*problems, Problem(ProblemKind.COVERAGE, path_prefix, exc.message)]
    for entry in index:
        problem = tiling_problem(entry.shape, [(c.offsets, c.sizes) for c in entry.chunks])
        if problem is not None:
            problems.append(Problem(ProblemKind.COVERAGE, entry.name, problem))
    return problems


def _optim_file_problems(tag: DeepSpeedTag, opened: TorchPickle, path: str) -> list[Problem]:
    try:
        osd = _optimizer_state_dict(opened)
    except CorruptCheckpoint as exc:
        return [Problem(ProblemKind.BAD_METADATA, path, exc.message)]
    problems = []
    stage = _enum_value(osd.get("zero_stage"))
    if type(stage) is int and stage != tag.zero_stage:
        problems.append(
            Problem(ProblemKind.BAD_METADATA, path, f"zero_stage {stage} differs from rank 0's {tag.zero_stage}")
        )
    count = _partition_count(osd.get("partition_count"))
    if count is not None and tag.partition_count is not None and count != tag.partition_count:
        problems.append(
            Problem(
                ProblemKind.BAD_METADATA, path, f"partition_count {count} differs from rank 0's {tag.partition_count}"
            )
        )
    return problems


def _problem(exc: CkptctlError, path: str) -> Problem:
    if isinstance(exc, UnsafePickle):
        return Problem(ProblemKind.UNSAFE_PICKLE, path, exc.message)
    kind = ProblemKind.TRUNCATED if "truncated" in str(exc) else ProblemKind.BAD_METADATA
    return Problem(kind, path, exc.message)


# --------------------------------------------------------------------------------------------------
# The layout.
# --------------------------------------------------------------------------------------------------


class DeepSpeedLayout:
    """A DeepSpeed ZeRO (0-3) tag folder; its parent is the run and holds `latest`."""

    name = "deepspeed"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A ref when the folder holds DeepSpeed model/optim states (names only); BROKEN when rank files
        the other names promise are missing."""
        files = tag_files(entries)
        if files is None:
            return None
        missing = files.missing_from_names()
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=step_from_name(io.name_of(url)),
            epoch=None,
            created=timestamp(newest_mtime(entries)),
            state=CheckpointState.BROKEN if missing else CheckpointState.COMPLETE,
            size_bytes=folder_size(url, entries),
            note=f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing else "",
        )

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """The tag the save folder's `latest` file names."""
        return read_latest(url, entries)

    def open(self, url: str) -> Checkpoint:
        """Read the rank-0 model and optim states; the tensor index reads the other ranks' `data.pkl`.

        A tag whose rank-0 files do not parse still opens (so that `verify` can say why), as BROKEN,
        with a tensor index that raises the reason.
        """
        entries = io.list_dir(url)
        ref = self.identify(url, entries)
        files = tag_files(entries)
        if ref is None or files is None:
            raise UnknownLayout(f"{url} is not a DeepSpeed checkpoint (no *_model_states.pt or *_optim_states.pt)")
        all_files = {e.name: e.size for e in entries if not e.is_dir}
        try:
            tag = read_tag(url, files)
        except CorruptCheckpoint as exc:
            error = exc

            def unreadable() -> tuple[TensorEntry, ...]:
                raise error

            return Checkpoint(
                ref=replace(ref, state=CheckpointState.BROKEN, note=exc.message),
                components=frozenset(),
                world_size=None,
                metadata={"error": exc.message},
                tensor_index=unreadable,
                files=all_files,
            )
        epoch = tag.client_state().get("epoch")
        ref = replace(
            ref,
            step=tag.global_steps if tag.global_steps is not None else ref.step,
            epoch=float(epoch) if isinstance(epoch, int | float) and not isinstance(epoch, bool) else None,
            latest=read_latest(io.parent_of(url), io.list_dir(io.parent_of(url))) == io.name_of(url),
        )

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            return tag_index(tag)

        return Checkpoint(
            ref=ref,
            components=tag.components(),
            world_size=tag.dp_world_size * tag.mp_world_size,
            metadata=tag.metadata(),
            tensor_index=tensor_index,
            files=all_files,
        )

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """`verify_tag`, plus the save folder's `latest` pointer naming an existing tag."""
        problems = verify_tag(checkpoint.url)
        pointer = latest_problem(io.parent_of(checkpoint.url), f"../{LATEST_NAME}")
        if pointer is not None:
            problems.append(pointer)
        return problems
