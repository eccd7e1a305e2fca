"""The tensor index of a tag.

The tensor index reproduces what DeepSpeed's `zero_to_fp32.py` computes, as byte ranges instead of
tensors: ZeRO-1/2 concatenate each group's per-rank fp32 partitions and lay parameters out one after
another (plus `param_alignment_paddings`); ZeRO-3 partitions each parameter separately into
`ceil(numel / dp)` elements per rank. Each parameter's piece on each rank is a contiguous element range,
which `formats.chunks.flat_range_boxes` turns into RAW chunks. So the index holds the model (bf16 `module`
weights under ZeRO 0-2; the fp32 master weights under ZeRO-3), and the optimizer state unflattened per
parameter (`optimizer.state.<name>.exp_avg`, ZeRO-1/2 fp32 masters as `optimizer.fp32.<name>`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckptctl.checkpoint import ChunkEncoding, Component, TensorChunk, TensorEntry, dtype_itemsize
from ckptctl.errors import CorruptCheckpoint
from ckptctl.families.zero_tag.kept_masters import KEPT_MASTERS, kept_master_weights
from ckptctl.families.zero_tag.tag import DeepSpeedTag, base_state, optimizer_state_dict
from ckptctl.formats.chunks import flat_range_boxes
from ckptctl.formats.torch_pickle import TorchPickle, tensor_refs
from ckptctl.formats.torch_pickle_classes import TensorRef

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
        entries += IndexBuilder(tag, mp, path_prefix, name_prefix).build()
    if KEPT_MASTERS in tag.files.sizes:
        return _with_kept_masters(tag, entries, path_prefix)
    return tuple(entries)


def _with_kept_masters(tag: DeepSpeedTag, entries: list[TensorEntry], path_prefix: str) -> tuple[TensorEntry, ...]:
    """The index of a slim tag (`KEPT_MASTERS`): model entries whose bytes lay in the dropped partitions (the
    fp32 parameters of ZeRO-3) are the kept master weights."""
    kept = {
        e.name: replace(e, chunks=tuple(replace(c, file=f"{path_prefix}{c.file}") for c in e.chunks))
        for e in kept_master_weights(tag.url, "").entries
    }
    present = {f"{path_prefix}{name}" for name in tag.files.sizes}
    out = []
    for entry in entries:
        torn = not entry.chunks or any(c.file not in present for c in entry.chunks)
        if torn and entry.component is Component.MODEL and entry.name in kept:
            entry = kept[entry.name]
        out.append(entry)
    return tuple(out)


class IndexBuilder:
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
        groups = param_groups(self.states.get("param_shapes"))
        entries: list[TensorEntry] = []
        optim_names = [self.tag.files.optim.get((dp, self.mp)) for dp in range(self.tag.dp_world_size)]
        have_optim = bool(self.tag.files.optim)
        if have_optim and any(name is None for name in optim_names):
            missing = [self.tag.files.optim_name(dp, self.mp) for dp, n in enumerate(optim_names) if n is None]
            raise CorruptCheckpoint(f"{self.tag.url}: optim states missing: {', '.join(missing)}")
        flat: list[list[TensorRef]] = []
        pieces: dict[str, list[Piece]] = {}
        if have_optim:
            osds = [optimizer_state_dict(self.tag.open_file(n)) for n in optim_names if n]
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
        other state tensors (a group's `step`) from DP rank 0 as they are.

        ZeRO 1-2 saves each rank's fp32 partitions without the padding that aligns a group's partitions
        (`_get_groups_without_padding`, padding recorded as `group_paddings`), and the wrapped optimizer's state
        with it (`optimizer.state_dict()`): a state tensor that is its partition plus that padding, at the end,
        is laid out as the partition too."""
        per_rank: list[dict[int, dict[str, Any]]] = []
        paddings: list[list[Any]] = []
        for file in files:
            osd = optimizer_state_dict(self.tag.open_file(file or ""))
            state = base_state(osd).get("state")
            state = state if isinstance(state, dict) else {}
            per_rank.append({g: v for g, v in state.items() if type(g) is int and isinstance(v, dict)})
            padding = osd.get("group_paddings")
            paddings.append(padding if isinstance(padding, list) else [])
        keys = list(dict.fromkeys(k for g in per_rank[0].values() for k, v in g.items() if type(v) is TensorRef))
        shapes = {name: shape for group in groups for name, shape in group.items()}
        out: list[TensorEntry] = []
        for key in keys:
            layout: list[list[TensorRef]] = []
            for rank, states in enumerate(per_rank):
                row = [states.get(g, {}).get(key) for g in range(len(flat[rank]))]
                padded = [p if type(p) is int and p >= 0 else 0 for p in paddings[rank]]  # a hostile -1: no padding
                padded += [0] * (len(row) - len(padded))
                if not all(
                    type(t) is TensorRef and t.numel in (f.numel, f.numel + pad)
                    for t, f, pad in zip(row, flat[rank], padded, strict=False)
                ):
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


def param_groups(value: Any) -> list[dict[str, tuple[int, ...]]]:
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
