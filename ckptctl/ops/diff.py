"""`diff`: what differs between two checkpoints, of the same layout or not, tensor by tensor.

Tensors of one component (the model by default) are matched by name after the namespace rules that
`convert` uses (`ops.naming`: `model.` of DCP state dicts, the entry name of a save) and the user's
renames; against a checkpoint of another layout, a model that its framework names and lays out otherwise
(Megatron's fused projections) is taken under transformers names (`Layout.hf_model`). Each matched pair
is classified as equal, or changed in shape, dtype or values; values are compared element by element after
upcasting both sides (float64, complex128 for complex tensors, int64 differences for integer ones), in
blocks, so memory stays near the pair of tensors being compared. One pair is read at a time and only
tensors that are compared are read.

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

import enum
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, Component, TensorChunk, TensorEntry
from ckptctl.errors import CkptctlError
from ckptctl.formats.documents import read_json
from ckptctl.formats.manifest import FileRecord, Manifest, read_manifest
from ckptctl.layouts import get_layout, open_checkpoint
from ckptctl.ops.naming import Renames, normalised_names
from ckptctl.ops.report import SCHEMA_VERSION, NoProgress, Progress, flatten, jsonable

if TYPE_CHECKING:
    import torch

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

#: Elements upcast and compared at once: bounds the temporaries to a few tens of MiB.
_BLOCK = 1 << 20
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
    names_a = _named(left, options, right.layout)
    names_b = _named(right, options, left.layout)
    common = [name for name in names_a if name in names_b]
    digests = _Digests(left, right, enabled=not options.read_all)
    to_read = [n for n in common if names_a[n].shape == names_b[n].shape and not digests.prove(names_a[n], names_b[n])]
    progress.start("comparing", sum(names_a[n].nbytes + names_b[n].nbytes for n in to_read))
    changed: list[TensorDiff] = []
    equal: list[TensorDiff] = []
    proven = 0
    try:
        for name in common:
            result = _compare_pair(name, left, names_a[name], right, names_b[name], options, digests, progress)
            proven += result.evidence in (Evidence.SAME_FILE, Evidence.DIGEST)
            if result.kind is None:
                equal.append(result)
            else:
                changed.append(result)
    finally:
        progress.finish()
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
        proven_count=proven,
        compared=len(common),
        metadata=tuple(metadata_differences(left, right)),
        atol=options.atol,
        rtol=options.rtol,
        bytes_read=read.bytes_read,
        equal_tensors=tuple(equal) if options.keep_equal else (),
        top=options.top,
    )


def _named(checkpoint: Checkpoint, options: DiffOptions, other_layout: str) -> dict[str, TensorEntry]:
    """The tensors of the compared component under the names `diff` matches them by. Against a checkpoint of
    another layout, a model its framework stores under names of its own (Megatron) is taken under transformers
    names (`Layout.hf_model`), as `convert --to hf` writes it; when that mapping does not apply (no shape
    recorded), the stored names are kept."""
    if options.component is Component.MODEL and other_layout != checkpoint.layout:
        try:
            hf = get_layout(checkpoint.layout).hf_model(checkpoint, None)
        except CkptctlError:
            hf = None
        if hf is not None:
            return normalised_names(checkpoint.layout, hf.entries, options.strip_prefix or "", options.renames)
    entries = list(checkpoint.tensors(options.component))
    if not entries:
        present = sorted({e.component.value for e in checkpoint.tensor_index()})
        raise CkptctlError(
            f"{checkpoint.url} holds no {options.component.value} tensors",
            f"components with tensors: {', '.join(present) or 'none'}; choose one with --component",
        )
    return normalised_names(checkpoint.layout, entries, options.strip_prefix, options.renames)


def _compare_pair(
    name: str,
    left: Checkpoint,
    a: TensorEntry,
    right: Checkpoint,
    b: TensorEntry,
    options: DiffOptions,
    digests: _Digests,
    progress: Progress,
) -> TensorDiff:
    base = TensorDiff(name, None, a.name, b.name, a.dtype, b.dtype, a.shape, b.shape)
    if a.shape != b.shape:
        return replace(base, kind=ChangeKind.SHAPE)
    evidence = digests.prove(a, b)
    if evidence is not None:
        return replace(base, identical=True, evidence=evidence, max_abs_diff=0.0, rel_l2=0.0, mismatched=0)
    from ckptctl.formats.chunks import read_tensor

    tensor_a = read_tensor(left.url, a)
    progress.advance(a.nbytes)
    tensor_b = read_tensor(right.url, b)
    progress.advance(b.nbytes)
    stats = compare_values(tensor_a, tensor_b, options.atol, options.rtol)
    del tensor_a, tensor_b
    kind: ChangeKind | None = None
    if a.dtype != b.dtype and not options.ignore_dtype:
        kind = ChangeKind.DTYPE
    elif stats.mismatched:
        kind = ChangeKind.VALUES
    return replace(
        base,
        kind=kind,
        max_abs_diff=stats.max_abs_diff,
        rel_l2=stats.rel_l2,
        mismatched=stats.mismatched,
        nonfinite_mismatched=stats.nonfinite_mismatched,
        identical=stats.identical,
        evidence=Evidence.READ,
    )


# --------------------------------------------------------------------------------------------------
# Values.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ValueStats:
    """How the values of two tensors of the same shape differ (see `compare_values`)."""

    identical: bool
    max_abs_diff: float
    rel_l2: float
    mismatched: int
    nonfinite_mismatched: int


def compare_values(a: torch.Tensor, b: torch.Tensor, atol: float = 0.0, rtol: float = 0.0) -> ValueStats:
    """Compare two tensors of the same shape element by element, in blocks.

    Floating-point and complex values are upcast to float64/complex128 (so bf16 against fp32 compares
    the bf16 values exactly), integers and bools are subtracted as int64. NaN equals NaN, and infinities
    equal the same infinity; any other position where either side is not finite counts as a mismatch
    and makes `max_abs_diff` infinite; the L2 sums leave those positions (and matching infinities) out.
    """
    import torch

    if a.dtype == b.dtype and _bitwise_equal(a, b):
        return ValueStats(True, 0.0, 0.0, 0, 0)
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    floating = any(t.is_floating_point() or t.is_complex() for t in (a, b))
    complex_ = a.is_complex() or b.is_complex()
    compute = torch.complex128 if complex_ else (torch.float64 if floating else torch.int64)
    max_abs = 0.0
    sq_diff = sq_a = sq_b = 0.0
    mismatched = nonfinite = 0
    for start in range(0, flat_a.numel(), _BLOCK):
        x = flat_a[start : start + _BLOCK].to(compute)
        y = flat_b[start : start + _BLOCK].to(compute)
        same = x == y
        if floating:
            same |= torch.isnan(x) & torch.isnan(y)
        d = (x - y).abs().to(torch.float64)
        d[same] = 0.0
        finite = torch.isfinite(d)
        bad_nonfinite = int((~finite).sum())
        nonfinite += bad_nonfinite
        d = torch.where(finite, d, 0.0)
        ax = x.abs().to(torch.float64)
        ay = y.abs().to(torch.float64)
        ax = torch.where(finite & torch.isfinite(ax), ax, 0.0)
        ay = torch.where(finite & torch.isfinite(ay), ay, 0.0)
        if d.numel():
            max_abs = max(max_abs, float(d.max()))
        sq_diff += float((d * d).sum())
        sq_a += float((ax * ax).sum())
        sq_b += float((ay * ay).sum())
        mismatched += int((d > atol + rtol * ax).sum()) + bad_nonfinite
    norm = math.sqrt(max(sq_a, sq_b))
    rel = math.sqrt(sq_diff) / norm if norm > 0 else (0.0 if sq_diff == 0 else math.inf)
    return ValueStats(False, math.inf if nonfinite else max_abs, rel, mismatched, nonfinite)


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
        if url_a == url_b:
            return Evidence.SAME_FILE
        if io.is_local(url_a) and io.is_local(url_b):
            try:
                if os.path.samefile(io.local_path(url_a), io.local_path(url_b)):
                    return Evidence.SAME_FILE
            except OSError:
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
