"""`diff`: what differs between two checkpoints, of the same layout or not, tensor by tensor.

Tensors of one component (the model by default) are matched by name after the namespace rules that
`convert` uses (`ops.naming`: `model.` of DCP state dicts, the entry name of a save) and the user's
renames; a model that its framework names and lays out otherwise (Megatron's fused projections and stacked
layers) is taken under transformers names (`ConvertSource.hf_model`) or under the names its own load gives the
model (`ConvertSource.native_model`), whichever matches the other side's names best. Each matched pair is
classified as equal, or changed in shape, dtype or values; values are compared element by element after
upcasting both sides (float64, complex128 for complex tensors, int64 differences for integer ones), in
cache-sized blocks (`ops.tensor_stats`). Only tensors that are compared are read.

Reading runs at the speed of the reads: a pair whose bytes both sides store raw (safetensors, the records
of local torch.save archives such as DCP items) is streamed in blocks on a pool of threads, so memory
stays at a few blocks per thread whatever the tensor's size; when both sides store the same dtype, each
block's bytes are compared first and only blocks that differ are decoded. Other pairs (small ones, and
records that must be decoded) are read whole, one pair at a time.

Equal means every element satisfies `|b - a| <= atol + rtol * |a|` (NaN equals NaN; the defaults 0 and 0
ask for equal values). Per tensor: the largest absolute difference and the relative L2 difference
`||a - b|| / max(||a||, ||b||)` (0 for equal tensors, at most 2).

Reading is skipped, and the pair counted equal, when both sides provably hold the same bytes: every
chunk pairs with a chunk at the same tensor offsets, of the same size and encoding, at the same byte
range of either the same file (same path or inode) or of files whose recorded blake3 digests
(`ckptctl-manifest.json` / `ckptctl-digests.json`) are equal and whose sizes on disk still match the
record. That trusts the records the way `verify` checks them; `read_all` turns it off.

Metadata differences (step, epoch, world size, config fields, counters) are reported but do not make two
checkpoints different: `equal` is about tensors.
"""

from __future__ import annotations

import bisect
import enum
import math
import os
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, Component, TensorChunk, TensorEntry, dtype_itemsize
from ckptctl.contract.capabilities import HfModel, NativeModel
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.documents import read_json
from ckptctl.formats.manifest import FileRecord, Manifest, read_manifest
from ckptctl.layouts import open_checkpoint
from ckptctl.ops.convert_source import convert_source
from ckptctl.ops.distributed_work import Ranks, split
from ckptctl.ops.naming import Renames, normalised_names
from ckptctl.ops.report import SCHEMA_VERSION, NoProgress, Progress, flatten, jsonable
from ckptctl.ops.tensor_stats import (
    BlockStats,
    ValueStats,
    compare_block,
    fold,
    norms_block,
    raw_from_bytes,
    raw_from_tensor,
)

if TYPE_CHECKING:
    import torch

    from ckptctl.formats.raw_chunks import FlatRange

#: Bytes of a block: a view of a mapped local file, or what a read returned.
Buffer = bytes | memoryview
#: One side's tensors by the names they are matched by.
Named = dict[str, TensorEntry]

__all__ = [
    "ChangeKind",
    "DiffOptions",
    "DiffReport",
    "Evidence",
    "MetadataDiff",
    "TensorDiff",
    "ValueStats",
    "compare_values",
    "diff",
    "metadata_differences",
]

#: Elements upcast and compared at once: their float64 copies and temporaries stay in the CPU cache.
_BLOCK = 1 << 16
#: Elements of each side a task of a streamed pair reads at once (a multiple of `_BLOCK`).
_READ_BLOCK = 1 << 20
#: Tensors stored in raw ranges shorter than this on average (interleaved rows of tensor-parallel
#: shards) are decoded whole rather than read range by range.
_MIN_AVERAGE_RANGE = 64 << 10
#: Metadata keys that differ between any two saves and say nothing about them: a save's id, and what a
#: layout met reading one (`error`, and `*_error` keys, whose messages name each checkpoint's own paths).
_IGNORED_METADATA = frozenset({"save_id", "error"})


class ChangeKind(enum.StrEnum):
    """How a tensor present on both sides changed."""

    SHAPE = "shape"
    DTYPE = "dtype"
    VALUES = "values"


class Evidence(enum.StrEnum):
    """How the values of a pair were judged."""

    READ = "read"
    SAME_FILE = "same_file"
    DIGEST = "digest"


@dataclass(frozen=True, slots=True)
class DiffOptions:
    """What to compare and how strictly.

    Attributes:
        component: which component's tensors to compare.
        atol: absolute tolerance.
        rtol: relative tolerance (relative to A's values).
        strip_prefix: namespace prefix removed from names on both sides; None detects it per side
            (see `ops.naming`), "" keeps names as stored.
        renames: substitutions applied to the names of both sides after the prefix is removed.
        ignore_dtype: a pair whose dtypes differ but whose values agree within the tolerance is equal
            (an fp32 training checkpoint against its bf16 export, with a tolerance that fits bf16).
        keep_equal: also return the equal pairs (`DiffReport.equal_tensors`), not only their count.
        read_all: read every pair, even those the recorded digests prove equal.
        layout_a: read A as this layout instead of detecting it.
        layout_b: read B as this layout instead of detecting it.
        top: list only this many most changed pairs (None: all); the counts cover every pair.
        ranks: the ranks of a job (`ops.distributed_work.join`) that all run this comparison and share the
            pairs to read by bytes; every rank gets the whole report. None: this process alone.
    """

    component: Component = Component.MODEL
    atol: float = 0.0
    rtol: float = 0.0
    strip_prefix: str | None = None
    renames: Renames = ()
    ignore_dtype: bool = False
    keep_equal: bool = False
    read_all: bool = False
    layout_a: str | None = None
    layout_b: str | None = None
    top: int | None = None
    ranks: Ranks | None = None


@dataclass(frozen=True, slots=True)
class TensorDiff:
    """One matched pair of tensors.

    Attributes:
        name: the normalised name both sides share.
        kind: how it changed, or None when it is equal within the tolerance.
        a_name: the name A stores it under.
        b_name: the name B stores it under.
        a_dtype: A's dtype.
        b_dtype: B's dtype.
        a_shape: A's shape.
        b_shape: B's shape.
        max_abs_diff: largest `|b - a|` over the elements (inf when NaN/Inf positions differ), or None
            when the values were not compared (shape changes, pairs proven equal without reading).
        rel_l2: `||a - b|| / max(||a||, ||b||)` over the finite elements, or None when not compared.
        mismatched: elements outside the tolerance (or None when not compared).
        nonfinite_mismatched: elements where one side is NaN/Inf and the other is not the same value.
        identical: the bytes are identical (bitwise, or proven by `evidence`).
        evidence: how the values were judged (None when they were not: a shape change).
    """

    name: str
    kind: ChangeKind | None
    a_name: str
    b_name: str
    a_dtype: str
    b_dtype: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    max_abs_diff: float | None = None
    rel_l2: float | None = None
    mismatched: int | None = None
    nonfinite_mismatched: int = 0
    identical: bool = False
    evidence: Evidence | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.a_shape)

    def sort_key(self) -> tuple[int, float, float, str]:
        """Most changed first: shape changes, then by relative L2 and largest absolute difference."""
        rank = 0 if self.kind is ChangeKind.SHAPE else 1
        rel = -math.inf if self.rel_l2 is None else -self.rel_l2
        if self.nonfinite_mismatched:
            rel = -math.inf
        top = -math.inf if self.max_abs_diff is None else -self.max_abs_diff
        return (rank, rel, top, self.name)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": None if self.kind is None else self.kind.value,
            "max_abs_diff": _finite_or_none(self.max_abs_diff),
            "rel_l2": _finite_or_none(self.rel_l2),
            "mismatched": self.mismatched,
            "nonfinite_mismatched": self.nonfinite_mismatched,
            "numel": self.numel,
            "identical": self.identical,
            "evidence": None if self.evidence is None else self.evidence.value,
            "a": {"name": self.a_name, "dtype": self.a_dtype, "shape": list(self.a_shape)},
            "b": {"name": self.b_name, "dtype": self.b_dtype, "shape": list(self.b_shape)},
        }


@dataclass(frozen=True, slots=True)
class MetadataDiff:
    """A metadata field whose values differ (None: the side does not have it)."""

    field: str
    a: Any
    b: Any

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "a": jsonable(self.a), "b": jsonable(self.b)}


@dataclass(frozen=True, slots=True)
class DiffReport:
    """What differs between checkpoints A and B.

    Attributes:
        a: A's URL.
        b: B's URL.
        a_layout: A's layout.
        b_layout: B's layout.
        component: the component compared.
        only_in_a: normalised names only A holds.
        only_in_b: normalised names only B holds.
        changed: the pairs that differ, most changed first.
        equal_count: pairs equal within the tolerance.
        identical_count: pairs whose bytes are identical (a subset of the equal ones).
        proven_count: pairs proven identical from the same file or recorded digests, without reading.
        compared: pairs matched by name.
        metadata: metadata fields that differ.
        atol: the absolute tolerance used.
        rtol: the relative tolerance used.
        bytes_read: bytes read from both checkpoints.
        equal_tensors: the equal pairs, when asked for (`DiffOptions.keep_equal`).
        top: how many changed pairs to list in the JSON document (None: all).
    """

    a: str
    b: str
    a_layout: str
    b_layout: str
    component: Component
    only_in_a: tuple[str, ...]
    only_in_b: tuple[str, ...]
    changed: tuple[TensorDiff, ...]
    equal_count: int
    identical_count: int
    proven_count: int
    compared: int
    metadata: tuple[MetadataDiff, ...]
    atol: float
    rtol: float
    bytes_read: int
    equal_tensors: tuple[TensorDiff, ...] = ()
    top: int | None = None

    @property
    def equal(self) -> bool:
        """No tensor only on one side and no changed pair (metadata differences do not count)."""
        return not (self.only_in_a or self.only_in_b or self.changed)

    def listed_changes(self) -> tuple[TensorDiff, ...]:
        return self.changed if self.top is None else self.changed[: self.top]

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "a": self.a,
            "b": self.b,
            "equal": self.equal,
            "only_in_a": list(self.only_in_a),
            "only_in_b": list(self.only_in_b),
            "changed": [d.to_json() for d in self.listed_changes()],
            "changed_count": len(self.changed),
            "equal_count": self.equal_count,
            "identical_count": self.identical_count,
            "proven_without_reading": self.proven_count,
            "compared": self.compared,
            "metadata": [m.to_json() for m in self.metadata],
            "layouts": {"a": self.a_layout, "b": self.b_layout},
            "component": self.component.value,
            "atol": self.atol,
            "rtol": self.rtol,
            "bytes_read": self.bytes_read,
        }
        if self.equal_tensors:
            doc["equal_tensors"] = [d.to_json() for d in self.equal_tensors]
        return doc


def diff(a: str, b: str, options: DiffOptions | None = None, progress: Progress | None = None) -> DiffReport:
    """Compare the checkpoints at `a` and `b` (see the module docstring).

    Raises:
        CkptctlError: a checkpoint cannot be opened, holds none of the component's tensors, names collide
            after normalisation, or a tolerance is negative.
        CorruptCheckpoint: a tensor's bytes do not read back as its metadata says.
    """
    options = options or DiffOptions()
    if options.atol < 0 or options.rtol < 0 or math.isnan(options.atol) or math.isnan(options.rtol):
        raise CkptctlError("tolerances must be non-negative numbers")
    with io.counting() as read:
        return _diff(a, b, options, progress or NoProgress(), read)


def _diff(a: str, b: str, options: DiffOptions, progress: Progress, read: io.ByteCounter) -> DiffReport:
    left = open_checkpoint(a, options.layout_a)
    right = open_checkpoint(b, options.layout_b)
    names_a, names_b = _matched(left, right, options)
    common = [name for name in names_a if name in names_b]
    digests = _Digests(left, right, enabled=not options.read_all)
    results: dict[str, TensorDiff] = {}
    to_read: list[_Pair] = []
    for name in common:
        entry_a, entry_b = names_a[name], names_b[name]
        base = TensorDiff(
            name, None, entry_a.name, entry_b.name, entry_a.dtype, entry_b.dtype, entry_a.shape, entry_b.shape
        )
        if entry_a.shape != entry_b.shape:
            results[name] = replace(base, kind=ChangeKind.SHAPE)
            continue
        evidence = digests.prove(entry_a, entry_b)
        if evidence is not None:
            results[name] = replace(base, identical=True, evidence=evidence, max_abs_diff=0.0, rel_l2=0.0, mismatched=0)
        else:
            to_read.append(_Pair(base, entry_a, entry_b))

    def compare(indices: list[int]) -> dict[int, ValueStats]:
        share = [to_read[i] for i in indices]
        progress.start("comparing", sum(p.a.nbytes + p.b.nbytes for p in share))
        try:
            found = _compare_pairs(left, right, share, options, progress)
        finally:
            progress.finish()
        return {i: found[to_read[i]] for i in indices}

    sizes = [p.a.nbytes + p.b.nbytes for p in to_read]
    for pair, stats in zip(to_read, split(options.ranks, sizes, compare), strict=True):
        results[pair.base.name] = _judged(pair, stats, options)
    changed = [results[n] for n in common if results[n].kind is not None]
    equal = [results[n] for n in common if results[n].kind is None]
    changed.sort(key=TensorDiff.sort_key)
    return DiffReport(
        a=a,
        b=b,
        a_layout=left.layout,
        b_layout=right.layout,
        component=options.component,
        only_in_a=tuple(sorted(set(names_a) - set(names_b))),
        only_in_b=tuple(sorted(set(names_b) - set(names_a))),
        changed=tuple(changed),
        equal_count=len(equal),
        identical_count=sum(d.identical for d in equal),
        proven_count=sum(d.evidence in (Evidence.SAME_FILE, Evidence.DIGEST) for d in results.values()),
        compared=len(common),
        metadata=tuple(metadata_differences(left, right)),
        atol=options.atol,
        rtol=options.rtol,
        bytes_read=read.bytes_read,
        equal_tensors=tuple(equal) if options.keep_equal else (),
        top=options.top,
    )


def _matched(left: Checkpoint, right: Checkpoint, options: DiffOptions) -> tuple[Named, Named]:
    """The tensors of the compared component of each side under the names `diff` matches them by: of the ways
    each side can name them (`_namings`), the pair with the most names in common, the preferred ways on a tie."""
    namings_a = _namings(left, options, right.layout)
    namings_b = _namings(right, options, left.layout)
    pairs = [(i, j) for i in range(len(namings_a)) for j in range(len(namings_b))]
    i, j = max(pairs, key=lambda ij: (len(namings_a[ij[0]].keys() & namings_b[ij[1]].keys()), -ij[0] - ij[1]))
    return namings_a[i], namings_b[j]


def _namings(checkpoint: Checkpoint, options: DiffOptions, other_layout: str) -> list[Named]:
    """The ways to name the tensors of the compared component, preferred first. A model its framework stores
    under names and shapes of its own (Megatron's fused projections and stacked layers) is taken, against a
    checkpoint of another layout, under transformers names (`ConvertSource.hf_model`), as `convert --to hf`
    writes it; then, against any checkpoint, under the names its framework's own load gives the model
    (`ConvertSource.native_model`), as `convert --mapping none` writes it; a mapping that does not apply (no
    shape recorded, bytes that cannot be sliced) is left out. Last, the stored names (`ops.naming`)."""
    found: list[Named] = []
    if options.component is Component.MODEL:
        source = convert_source(checkpoint.layout)
        makers: list[Callable[[], HfModel | NativeModel | None]] = [lambda: source.native_model(checkpoint)]
        if other_layout != checkpoint.layout:
            makers.insert(0, lambda: source.hf_model(checkpoint, None))
        for make in makers:
            try:
                model = make()
            except CkptctlError:
                model = None
            if model is not None:
                prefix = options.strip_prefix or ""
                found.append(normalised_names(checkpoint.layout, model.entries, prefix, options.renames))
    entries = list(checkpoint.tensors(options.component))
    if not entries:
        present = sorted({e.component.value for e in checkpoint.tensor_index()})
        raise CkptctlError(
            f"{checkpoint.url} holds no {options.component.value} tensors",
            f"components with tensors: {', '.join(present) or 'none'}; choose one with --component",
        )
    found.append(normalised_names(checkpoint.layout, entries, options.strip_prefix, options.renames))
    return found


@dataclass(frozen=True, slots=True, eq=False)
class _Pair:
    """A matched pair of the same shape whose values must be read (`base`: its names, dtypes and shape)."""

    base: TensorDiff
    a: TensorEntry
    b: TensorEntry


def _judged(pair: _Pair, stats: ValueStats, options: DiffOptions) -> TensorDiff:
    kind: ChangeKind | None = None
    if pair.a.dtype != pair.b.dtype and not options.ignore_dtype:
        kind = ChangeKind.DTYPE
    elif stats.mismatched:
        kind = ChangeKind.VALUES
    return replace(
        pair.base,
        kind=kind,
        max_abs_diff=stats.max_abs_diff,
        rel_l2=stats.rel_l2,
        mismatched=stats.mismatched,
        nonfinite_mismatched=stats.nonfinite_mismatched,
        identical=stats.identical,
        evidence=Evidence.READ,
    )


# --------------------------------------------------------------------------------------------------
# Reading and comparing.
# --------------------------------------------------------------------------------------------------


def _compare_pairs(
    left: Checkpoint, right: Checkpoint, pairs: list[_Pair], options: DiffOptions, progress: Progress
) -> dict[_Pair, ValueStats]:
    """The values of every pair, compared on a pool of threads.

    Pairs whose bytes both sides store raw (`raw_chunks.flat_ranges`: safetensors, and the records of
    local torch.save archives) are streamed: tasks of `_READ_BLOCK` elements run on `_workers()` threads,
    at most twice that many queued, so memory stays at a few blocks per thread, and torch is not even
    imported. The rest (strided or remote torch.save records) are read whole (`chunks.read_tensor`) and
    compared one pair at a time on one more thread, as are all pairs of a comparison whose tensors are
    all smaller than a block: there, whole tensors are as small as blocks.
    """
    from ckptctl.formats.raw_chunks import ChunkLocator, flat_ranges

    streamed: list[_Streamed] = []
    whole: list[_Pair] = []
    any_large = any(pair.a.numel > _BLOCK for pair in pairs)
    with ChunkLocator(left.url) as locate_a, ChunkLocator(right.url) as locate_b:
        for pair in pairs:
            ranges_a = ranges_b = None
            if any_large:
                ranges_a = flat_ranges(pair.a, locate_a, _MIN_AVERAGE_RANGE)
                ranges_b = flat_ranges(pair.b, locate_b, _MIN_AVERAGE_RANGE) if ranges_a is not None else None
            if ranges_a is None or ranges_b is None:
                whole.append(pair)
            else:
                streamed.append(_Streamed(pair, ranges_a, ranges_b, options.atol, options.rtol))
    results: dict[_Pair, ValueStats] = {}
    blocks = ((stream, k, False) for stream in streamed for k in range(len(stream.spans)))
    rereads: deque[tuple[_Streamed, int, bool]] = deque()  # go first, while the bytes are still cached
    workers = _workers(left.url, right.url)
    pending: dict[Future[Any], Callable[[Any], None]] = {}
    blocks_pending = 0

    def finished_block(stream: _Streamed) -> Callable[[_BlockResult], None]:
        def record(result: _BlockResult) -> None:
            nonlocal blocks_pending
            blocks_pending -= 1
            progress.advance(result.nbytes)
            again = stream.record(result)
            if again is None:
                results[stream.pair] = stream.stats()
            else:
                rereads.extend((stream, k, True) for k in again)

        return record

    def finished_whole(pair: _Pair) -> Callable[[ValueStats], None]:
        def record(stats: ValueStats) -> None:
            progress.advance(pair.a.nbytes + pair.b.nbytes)
            results[pair] = stats

        return record

    with io.ContextThreadPool(max_workers=workers) as pool, io.ContextThreadPool(max_workers=1) as one:
        for pair in whole:
            future = one.submit(_compare_whole, left.url, right.url, pair, options.atol, options.rtol)
            pending[future] = finished_whole(pair)
        try:
            while True:
                while blocks_pending < 2 * workers:
                    task = rereads.popleft() if rereads else next(blocks, None)
                    if task is None:
                        break
                    stream, k, norms_only = task
                    pending[pool.submit(stream.norms if norms_only else stream.compare, k)] = finished_block(stream)
                    blocks_pending += 1
                if not pending:
                    break
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    pending.pop(future)(future.result())
        except BaseException:  # an error or Ctrl-C: start nothing more; the pools wait for running tasks
            for future in pending:
                future.cancel()
            raise
    return results


def _workers(url_a: str, url_b: str) -> int:
    """Threads for streamed pairs: one per core (they decode and compare), or the I/O pool's size when
    a side is remote (they mostly wait on range reads)."""
    if not (io.is_local(url_a) and io.is_local(url_b)):  # a tuning choice: remote reads wait, local ones compute
        return io.workers()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(2, min(8, cores))


def _compare_whole(url_a: str, url_b: str, pair: _Pair, atol: float, rtol: float) -> ValueStats:
    from ckptctl.formats.chunks import read_tensor

    tensor_a = read_tensor(url_a, pair.a)
    tensor_b = read_tensor(url_b, pair.b)
    return compare_values(tensor_a, tensor_b, atol, rtol)


class _BlockResult(NamedTuple):
    """What a task of a streamed pair found in its block: each `_BLOCK`'s statistics, or None for a
    bit-identical block whose norms are not computed yet; `nbytes` read for it (not counting re-reads)."""

    block: int
    stats: list[BlockStats] | None
    nbytes: int


class _Streamed:
    """One pair compared block by block from the raw bytes of both sides.

    Blocks of the same dtype are compared as bytes first (memcmp speed); only blocks that differ are
    decoded. A bit-identical block still adds its values to the norms of a pair that differs elsewhere
    (the relative L2 difference is over the whole tensor), so once any block of the pair differs, the
    identical ones are decoded for their norms; the ones compared before that are read again at the end
    (`record` names them). A pair whose blocks are all identical is never decoded.
    """

    def __init__(
        self, pair: _Pair, ranges_a: list[FlatRange], ranges_b: list[FlatRange], atol: float, rtol: float
    ) -> None:
        self.pair = pair
        self.side_a = _RawSide(pair.a, ranges_a)
        self.side_b = _RawSide(pair.b, ranges_b)
        self.atol, self.rtol = atol, rtol
        self.bitwise = pair.a.dtype == pair.b.dtype
        numel = pair.a.numel
        step = _READ_BLOCK - _READ_BLOCK % _BLOCK or _BLOCK  # blocks start where compare_values' would
        self.spans = [(start, min(start + step, numel)) for start in range(0, numel, step)]
        self.blocks: list[list[BlockStats] | None] = [None] * len(self.spans)
        self.differs = False  # set by the first task that meets a differing block
        self.unread = len(self.spans)
        self.unnormed: list[int] = []

    def compare(self, index: int) -> _BlockResult:
        """Compare block `index` (on a worker thread)."""
        start, stop = self.spans[index]
        data_a = self.side_a.read(start, stop)
        data_b = self.side_b.read(start, stop)
        nbytes = len(data_a) + len(data_b)
        if self.bitwise and _same_bytes(data_a, data_b):
            return _BlockResult(index, self._norms(data_a) if self.differs else None, nbytes)
        self.differs = True
        dtype_a, dtype_b = self.pair.a.dtype, self.pair.b.dtype
        raw_a, raw_b = raw_from_bytes(data_a, dtype_a), raw_from_bytes(data_b, dtype_b)
        stats = [
            compare_block(raw_a[i : i + _BLOCK], dtype_a, raw_b[i : i + _BLOCK], dtype_b, self.atol, self.rtol)
            for i in range(0, len(raw_a), _BLOCK)
        ]
        return _BlockResult(index, stats, nbytes)

    def norms(self, index: int) -> _BlockResult:
        """Read identical block `index` again for its norms (on a worker thread)."""
        start, stop = self.spans[index]
        return _BlockResult(index, self._norms(self.side_a.read(start, stop)), 0)

    def _norms(self, data: Buffer) -> list[BlockStats]:
        dtype = self.pair.a.dtype
        raw = raw_from_bytes(data, dtype)
        return [norms_block(raw[i : i + _BLOCK], dtype) for i in range(0, len(raw), _BLOCK)]

    def record(self, result: _BlockResult) -> list[int] | None:
        """Take a task's result (on the calling thread): the blocks still to read for their norms, an
        empty list while other blocks are outstanding, or None when the pair is done."""
        if result.stats is None:
            self.unnormed.append(result.block)
        else:
            self.blocks[result.block] = result.stats
        self.unread -= 1
        if self.unread:
            return []
        if self.differs and self.unnormed:
            again, self.unnormed = self.unnormed, []
            self.unread = len(again)
            return again
        return None

    def stats(self) -> ValueStats:
        """The pair's statistics, once `record` said it is done (its blocks' results are let go)."""
        blocks, self.blocks = self.blocks, []
        if not self.differs:
            return ValueStats(True, 0.0, 0.0, 0, 0)
        return fold(block for stats in blocks for block in stats or ())


class _RawSide:
    """One side of a streamed pair: reads any run of its elements from its raw byte ranges."""

    def __init__(self, entry: TensorEntry, ranges: list[FlatRange]) -> None:
        self.entry = entry
        self.ranges = ranges
        self.starts = [r.start for r in ranges]
        self.itemsize = dtype_itemsize(entry.dtype)

    def read(self, start: int, stop: int) -> Buffer:
        """The raw bytes of elements `start:stop` (a view of the mapped file when it is local).

        Raises:
            CorruptCheckpoint: a file ends before the range its metadata gives.
        """
        pieces = []
        index = bisect.bisect_right(self.starts, start) - 1
        position = start
        while position < stop:
            run = self.ranges[index]
            end = min(stop, run.start + run.count)
            offset = run.offset + (position - run.start) * self.itemsize
            length = (end - position) * self.itemsize
            data = _read_range(run.url, offset, length)
            if len(data) != length:
                raise CorruptCheckpoint(
                    f"{run.url}@{offset} ({self.entry.name}): expected {length} bytes, read {len(data)}",
                    "the file is truncated",
                )
            pieces.append(data)
            position = end
            index += 1
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _read_range(url: str, offset: int, length: int) -> Buffer:
    """`length` bytes at `offset` of `url` (fewer where the file ends sooner).

    A local file's bytes are mapped, not copied: a block is compared (or decoded) once, so the copy a
    read makes was a third of the work on an identical pair and the same again as `cat` of it. Each block
    maps only its own range, unmapped when its last view goes, so memory stays at a few blocks per
    thread; the file's size is checked first, as a read would find it. Only on a file system known to be
    local (`io.maps_safely`): elsewhere a page the storage fails to bring in is a SIGBUS, not an error.
    """
    if not io.is_local(url) or length == 0:
        return io.read_bytes(url, offset, length)
    path = io.local_path(url)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return io.read_bytes(url, offset, length)  # its error, worded as every read's
    try:
        if not io.maps_safely(fd):
            return io.read_bytes(url, offset, length)
        available = max(0, min(length, os.fstat(fd).st_size - offset))
        if available == 0:
            return b""
        mapped = io.map_block(fd, offset, available, populate=False)
    finally:
        os.close(fd)
    if mapped is None:  # will not map after all, or shorter now: read, which says why
        return io.read_bytes(url, offset, length)
    io.count_read(available)  # as a read would have counted them
    return mapped


def _same_bytes(a: Buffer, b: Buffer) -> bool:
    """Whether two buffers hold the same bytes, compared 8 at a time without a copy (`==` of two
    memoryviews compares byte by byte in Python's own loop)."""
    x, y = np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)
    if x.size != y.size:
        return False
    whole = x.size - x.size % 8
    return bool(np.array_equal(x[:whole].view(np.uint64), y[:whole].view(np.uint64))) and bool(
        np.array_equal(x[whole:], y[whole:])
    )


# --------------------------------------------------------------------------------------------------
# Values.
# --------------------------------------------------------------------------------------------------


def compare_values(a: torch.Tensor, b: torch.Tensor, atol: float = 0.0, rtol: float = 0.0) -> ValueStats:
    """Compare two tensors of the same shape element by element, in blocks of `_BLOCK` elements.

    Floating-point and complex values are upcast to float64/complex128 (so bf16 against fp32 compares
    the bf16 values exactly), integers and bools are subtracted as int64. NaN equals NaN, and infinities
    equal the same infinity; any other position where either side is not finite counts as a mismatch
    and makes `max_abs_diff` infinite; the L2 sums leave those positions (and matching infinities) out.
    The numbers are those of the streamed comparison `diff` runs on raw bytes (`ops.tensor_stats`).
    """
    if a.dtype == b.dtype and _bitwise_equal(a, b):
        return ValueStats(True, 0.0, 0.0, 0, 0)
    dtype_a, dtype_b = (str(t.dtype).removeprefix("torch.") for t in (a, b))
    raw_a, raw_b = raw_from_tensor(a), raw_from_tensor(b)
    return fold(
        compare_block(raw_a[i : i + _BLOCK], dtype_a, raw_b[i : i + _BLOCK], dtype_b, atol, rtol)
        for i in range(0, raw_a.size, _BLOCK)
    )


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


# --------------------------------------------------------------------------------------------------
# Equality without reading.
# --------------------------------------------------------------------------------------------------


@dataclass
class _Digests:
    """Proves pairs equal from file identity or recorded digests (see the module docstring)."""

    left: Checkpoint
    right: Checkpoint
    enabled: bool = True
    _manifests: dict[str, Manifest | None] = field(default_factory=dict)
    _same: dict[tuple[str, str], Evidence | None] = field(default_factory=dict)
    _proofs: dict[tuple[str, str], Evidence | None] = field(default_factory=dict)

    def prove(self, a: TensorEntry, b: TensorEntry) -> Evidence | None:
        """How the pair is known to hold the same bytes without reading it, or None."""
        if not self.enabled or a.dtype != b.dtype or a.shape != b.shape or len(a.chunks) != len(b.chunks):
            return None
        if not a.chunks:
            return None
        key = (a.name, b.name)
        if key in self._proofs:
            return self._proofs[key]
        found: Evidence | None = Evidence.SAME_FILE
        for ca, cb in zip(_ordered(a.chunks), _ordered(b.chunks), strict=True):
            if (ca.offsets, ca.sizes, ca.encoding, ca.byte_offset, ca.byte_length) != (
                cb.offsets,
                cb.sizes,
                cb.encoding,
                cb.byte_offset,
                cb.byte_length,
            ):
                found = None
                break
            evidence = self._same_bytes(ca.file, cb.file)
            if evidence is None:
                found = None
                break
            if evidence is Evidence.DIGEST:
                found = Evidence.DIGEST
        self._proofs[key] = found
        return found

    def _same_bytes(self, file_a: str, file_b: str) -> Evidence | None:
        key = (file_a, file_b)
        if key not in self._same:
            self._same[key] = self._judge(file_a, file_b)
        return self._same[key]

    def _judge(self, file_a: str, file_b: str) -> Evidence | None:
        url_a = io.join(self.left.url, file_a)
        url_b = io.join(self.right.url, file_b)
        try:
            if io.same_file(url_a, url_b):
                return Evidence.SAME_FILE
        except CkptctlError:  # a file that cannot be looked at is read, and fails there if it must
            return None
        record_a = self._record(self.left, file_a)
        record_b = self._record(self.right, file_b)
        if record_a is None or record_b is None or record_a != record_b:
            return None
        # The records describe what was written; the files must at least still have that size.
        if self.left.files.get(file_a) != record_a.size or self.right.files.get(file_b) != record_b.size:
            return None
        return Evidence.DIGEST

    def _record(self, checkpoint: Checkpoint, file: str) -> FileRecord | None:
        if checkpoint.url not in self._manifests:
            try:
                self._manifests[checkpoint.url] = read_manifest(checkpoint.url)
            except CkptctlError:
                self._manifests[checkpoint.url] = None
        manifest = self._manifests[checkpoint.url]
        return None if manifest is None else manifest.files.get(file)


def _ordered(chunks: tuple[TensorChunk, ...]) -> list[TensorChunk]:
    return sorted(chunks, key=lambda c: c.offsets)


# --------------------------------------------------------------------------------------------------
# Metadata.
# --------------------------------------------------------------------------------------------------


def metadata_differences(a: Checkpoint, b: Checkpoint) -> list[MetadataDiff]:
    """Fields whose values differ: step, epoch, layout, world size (when both know it), config fields
    (when both have a config), and the layout metadata both sides record (counters, metrics, ...)."""
    found: list[MetadataDiff] = []
    for name, value_a, value_b in (
        ("step", a.ref.step, b.ref.step),
        ("epoch", a.ref.epoch, b.ref.epoch),
        ("layout", a.layout, b.layout),
    ):
        if value_a != value_b:
            found.append(MetadataDiff(name, value_a, value_b))
    if a.world_size is not None and b.world_size is not None and a.world_size != b.world_size:
        found.append(MetadataDiff("world_size", a.world_size, b.world_size))
    config_a, config_b = _config(a), _config(b)
    if config_a is not None and config_b is not None:
        flat_a, flat_b = flatten(config_a, "config."), flatten(config_b, "config.")
        for key in sorted(set(flat_a) | set(flat_b)):
            if flat_a.get(key) != flat_b.get(key):
                found.append(MetadataDiff(key, flat_a.get(key), flat_b.get(key)))
    meta_a = flatten({k: v for k, v in a.metadata.items() if k != "config"})
    meta_b = flatten({k: v for k, v in b.metadata.items() if k != "config"})
    for key in sorted(set(meta_a) & set(meta_b)):
        if any(part in _IGNORED_METADATA or part.endswith("_error") for part in key.split(".")):
            continue
        if meta_a[key] != meta_b[key]:
            found.append(MetadataDiff(key, meta_a[key], meta_b[key]))
    return found


def _config(checkpoint: Checkpoint) -> Mapping[str, Any] | None:
    """The whole `config.json` beside the weights (a small read), else the layout's config summary."""
    if "config.json" in checkpoint.files:
        try:
            doc = read_json(io.join(checkpoint.url, "config.json"))
        except CkptctlError:
            doc = None
        if isinstance(doc, dict):
            return doc
    summary = checkpoint.metadata.get("config")
    return summary if isinstance(summary, Mapping) else None
