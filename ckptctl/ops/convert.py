"""`convert`: a checkpoint's model (or another component) to a Hugging Face folder or to a torch DCP folder.

To HF (from torch DCP of any world size, native checkpoints, DeepSpeed ZeRO, or HF itself for
resharding/casting): the output is laid out from the tensor index alone (names, dtypes, shapes → shard
files and their headers), then filled as one sequential stream per file (`formats.safetensors_stream`,
O_DIRECT where possible). Chunks that are full in their trailing dimensions (FSDP dim-0 shards,
tensor-parallel column shards, whole tensors) are byte-copied, run of rows by run of rows, from the raw
records inside the source files into their precomputed output offsets, converted block by block when
`dtype` asks. Other chunks (strided views inside their archive, scattered tiny runs) are assembled in
memory one tensor at a time (`chunks.read_tensor`). Peak memory is a few copy buffers plus the largest
assembled tensor, whatever the model size.

DeepSpeed ZeRO 1-3 (a tag folder, the save folder holding `latest`, or a Trainer `checkpoint-N` with
DeepSpeed inside): by default the model is the fp32 master weights DeepSpeed's `zero_to_fp32.py`
reconstructs (`frameworks.deepspeed.layout.master_weights`): trainable parameters from the optimizer's flat fp32
partitions, frozen parameters and buffers from the model states, tied parameters from `shared_params`.
The partitions are flat element ranges of the output tensors, so this is the same byte copy, never
importing DeepSpeed or loading a partition whole. `weights=stored` writes the 16-bit module weights the
model states hold instead (ZeRO 0-2), as ZeRO stage 0 always does.

Names are the model's own, by the rules `diff` matches tensors with (`ops.naming`): the namespace a save
adds (`model.` of a DCP state dict, a native entry name, the wrappers a training loop put around a
DeepSpeed model) is removed, then `renames` apply.

To DCP (from an HF folder, for resuming from a published model): one `torch.distributed.checkpoint.save`
without a process group, keys `model.<name>`, which `dcp.load` reshards onto any world size.

Safety: everything is written into a hidden staging folder next to DST (`.<name>.ckptctl-convert-<pid>/`,
holding the output one level down so that no layout reader mistakes it for a checkpoint), checked against
the plan (headers read back: names, dtypes, shapes; `reread` also reads every byte back against the
digest computed while writing), digested into `ckptctl-digests.json` (so that `ckptctl verify DST` checks
every byte later), fsynced and renamed into place. An interrupted conversion never leaves anything at
DST; the next conversion into the same DST removes the leftover staging folder.

DST on an object store (`s3://bucket/out`, any fsspec URL): the output is staged the same way in the local
temporary folder (`TMPDIR`; its free space is checked against the output's size first), then uploaded on
`io`'s bounded pool of parallel transfers in an order that no interrupted upload can pass for a complete
checkpoint (`_upload_order`): weight files, then index, config and tokenizer files, then the one file
whose arrival completes the checkpoint for its layout (DCP's `.metadata`, the smallest shard of a sharded
HF model, `model.safetensors`), then, once a listing shows every object with its size,
`ckptctl-digests.json`. Each object appears whole or not at all (a PUT is atomic). A failed upload removes
what it uploaded; a killed one leaves a prefix that `list` reports broken or in progress, and that the
next conversion refuses without `force`. `force` deletes the old objects before uploading, commit markers
first (`_MARKERS`), so that a half-deleted old output does not pass for complete either. Both commits are
`io.commit`'s protocol; the old output a `force` replaces goes through `io.trash`.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointState, Component, TensorEntry, dtype_itemsize
from ckptctl.errors import (
    CheckpointInProgress,
    CheckpointNotFound,
    CkptctlError,
    CorruptCheckpoint,
    StorageError,
    UnknownLayout,
)
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import DIGESTS_NAME, MANIFEST_NAME, FileRecord, Manifest, now_iso
from ckptctl.formats.raw_chunks import ChunkLocator, row_major_runs
from ckptctl.formats.safetensors import TORCH_TO_SAFETENSORS, WrittenFile, build_header, read_header, tensor_bytes
from ckptctl.formats.safetensors_stream import BufferSource, RangeSource, Source, StreamCopier, plan_shards
from ckptctl.formats.safetensors_stream import shard_file_names as _shard_names
from ckptctl.io import commit, trash
from ckptctl.layouts import Layout, detect
from ckptctl.ops.naming import compile_renames, normalised_names
from ckptctl.ops.report import SCHEMA_VERSION, NoProgress, Progress

if TYPE_CHECKING:
    from ckptctl.checkpoint import CheckpointRef
    from ckptctl.frameworks.deepspeed.layout import MasterWeights

__all__ = [
    "ConvertOptions",
    "ConvertResult",
    "Target",
    "Weights",
    "convert",
    "parse_dtype",
]


class Target(enum.StrEnum):
    """What `convert` writes."""

    HF = "hf"
    DCP = "dcp"


class Weights(enum.StrEnum):
    """Which weights make the model of a checkpoint that holds two copies (DeepSpeed ZeRO)."""

    #: The fp32 master weights where the checkpoint has them, else the stored model weights.
    AUTO = "auto"
    #: The fp32 master weights (what DeepSpeed's zero_to_fp32 outputs); an error where there are none.
    MASTER = "master"
    #: The model weights as stored (DeepSpeed ZeRO 0-2: the 16-bit module weights).
    STORED = "stored"


#: Accepted spellings of `dtype` -> torch dtype name.
DTYPE_NAMES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}
#: `dtype` casts these; integer, bool and float8 tensors (ids, masks, quantised weights) keep their type,
#: as `model.to(dtype)` in torch does.
_CASTABLE = frozenset({"float64", "float32", "float16", "bfloat16"})
DEFAULT_MAX_SHARD_SIZE = 5_000_000_000
INDEX_NAME = "model.safetensors.index.json"
#: The key namespace of a `--to dcp` save: `{"model": state_dict}` as training loops save and load it.
DCP_NAMESPACE = "model"
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_STAGING_TAG = ".ckptctl-convert-"
_LOCK_NAME = "lock"
_OUT_NAME = "out"


def parse_dtype(text: str) -> str:
    """The torch dtype name of `bf16`, `fp16`, `fp32` (or their long names).

    Raises:
        ValueError: an unknown spelling.
    """
    found = DTYPE_NAMES.get(text.lower())
    if found is None:
        raise ValueError(f"{text!r} is not a dtype to convert to; choose bf16, fp16 or fp32")
    return found


@dataclass(frozen=True, slots=True)
class ConvertOptions:
    """What to convert and how.

    Attributes:
        to: `hf` or `dcp`.
        dtype: cast floating-point tensors to this torch dtype name (None keeps the stored dtypes).
        max_shard_size: most bytes of tensor data per output file (HF).
        component: which component's tensors to convert.
        strip_prefix: namespace prefix removed from names; None detects it as `diff` does (`ops.naming`:
            `model.` of DCP state dicts, the entry name of native checkpoints, DeepSpeed wrappers); ""
            keeps names as stored.
        renames: `(pattern, replacement)` regex substitutions applied in order after the prefix is removed.
        config_dir: where `config.json`/`generation_config.json` come from (default: beside the source).
        tokenizer_dir: where tokenizer files come from (default: beside the source).
        force: replace a non-empty DST.
        layout: read the source as this layout instead of detecting it.
        reread: read every written file back from disk and compare its digest with the one computed while
            writing it (doubles the I/O; the headers are always read back and checked).
        workers: copy threads (default: cores, 2 to 8).
        weights: for DeepSpeed ZeRO sources, the fp32 master weights (`auto`, `master`) or the stored
            16-bit module weights (`stored`); other sources have one copy of the model.
    """

    to: Target = Target.HF
    dtype: str | None = None
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    component: Component = Component.MODEL
    strip_prefix: str | None = None
    renames: tuple[tuple[str, str], ...] = ()
    config_dir: str | None = None
    tokenizer_dir: str | None = None
    force: bool = False
    layout: str | None = None
    reread: bool = False
    workers: int | None = None
    weights: Weights = Weights.AUTO


@dataclass(frozen=True, slots=True)
class ConvertResult:
    """What a conversion wrote.

    Attributes:
        src: the source checkpoint.
        dst: the output folder.
        to: `hf` or `dcp`.
        layout: the source's layout.
        tensors: tensors written.
        bytes: bytes of tensor data written.
        files: files of the output folder, relative to it.
        bytes_read: bytes read from the source.
        seconds: wall time.
        dtype: the dtype floating-point tensors were cast to, or None.
        copied: config and tokenizer files copied into the output.
        streamed: tensors byte-copied from their raw records.
        assembled: tensors decoded and assembled in memory (non-contiguous chunks, remote archives).
        warnings: things a person should know (no config found, ...).
        checkpoint: the checkpoint folder converted (the tag `latest` names, given a DeepSpeed save folder).
        weights: `master` (fp32 master weights rebuilt from optimizer partitions) or `stored`.
        uploaded: bytes uploaded to an object store DST (every file of the output; 0 for a local DST).
    """

    src: str
    dst: str
    to: str
    layout: str
    tensors: int
    bytes: int
    files: tuple[str, ...]
    bytes_read: int
    seconds: float
    dtype: str | None
    copied: tuple[str, ...] = ()
    streamed: int = 0
    assembled: int = 0
    warnings: tuple[str, ...] = field(default_factory=tuple)
    checkpoint: str = ""
    weights: str = Weights.STORED.value
    uploaded: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "src": self.src,
            "checkpoint": self.checkpoint or self.src,
            "dst": self.dst,
            "to": self.to,
            "layout": self.layout,
            "tensors": self.tensors,
            "bytes": self.bytes,
            "files": list(self.files),
            "bytes_read": self.bytes_read,
            "bytes_uploaded": self.uploaded,
            "seconds": round(self.seconds, 3),
            "dtype": self.dtype,
            "weights": self.weights,
            "copied": list(self.copied),
            "streamed_tensors": self.streamed,
            "assembled_tensors": self.assembled,
            "digests": DIGESTS_NAME,
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True, slots=True)
class _Written:
    """What the writer did: tensors byte-copied, tensors assembled, digests of the files it wrote."""

    streamed: int
    assembled: int
    digests: dict[str, FileRecord]


@dataclass(frozen=True, slots=True)
class _Planned:
    """One output tensor: its source entry, output name and output dtype."""

    entry: TensorEntry
    name: str
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def nbytes(self) -> int:
        return self.entry.numel * dtype_itemsize(self.dtype)


def convert(
    src: str, dst: str, options: ConvertOptions | None = None, progress: Progress | None = None
) -> ConvertResult:
    """Convert the checkpoint at `src` into a new folder `dst`, a local path or an object store URL (see the
    module docstring).

    Raises:
        CkptctlError: bad options, DST not empty (without `force`) or overlapping the source, a source
            that is incomplete, broken or lacks the component, names that collide after renaming.
        CorruptCheckpoint: source bytes that disagree with their metadata (nothing is left at DST).
        StorageError: the output cannot be written or uploaded.
    """
    with io.counting() as read:
        return _convert(src, dst, options or ConvertOptions(), progress or NoProgress(), read)


def _convert(src: str, dst: str, options: ConvertOptions, progress: Progress, read: io.ByteCounter) -> ConvertResult:
    started = time.perf_counter()
    if options.max_shard_size <= 0:
        raise CkptctlError("the maximum shard size must be positive")
    dst = _check_destination(src, dst, options.force)
    url, layout, ref = _resolve_source(src, options.layout)
    if ref.state is CheckpointState.IN_PROGRESS:
        raise CheckpointInProgress(
            f"{url} is still being written ({ref.note or 'no completion marker'})", "wait for the save to finish"
        )
    checkpoint = layout.open(url)
    problems = [p for p in layout.verify(checkpoint) if p.severity == "error"]
    if problems or checkpoint.ref.state is CheckpointState.BROKEN:
        first = problems[0].message if problems else checkpoint.ref.note
        raise CorruptCheckpoint(
            f"{url} fails structural verification: {first}", f"run `ckptctl verify {url}` for the full report"
        )
    notes: list[str] = []
    plan, weights = _plan(checkpoint, options, notes)
    side_files, side_notes = _side_files(url, options)
    notes += side_notes

    staging = _Staging(dst) if io.is_local(dst) else _UploadStaging(dst)
    with staging:
        staging.check_space(sum(p.nbytes for p in plan))
        try:
            if options.to is Target.HF:
                written = _write_hf(checkpoint, plan, staging.out, options, progress)
            else:
                written = _write_dcp(checkpoint, plan, staging.out, progress)
        finally:
            progress.finish()  # a bar left running on an error would hide the terminal's cursor
        copied = _copy_side_files(side_files, staging.out, options.dtype)
        _write_digests(staging.out, written.digests)
        files = tuple(sorted(os.listdir(staging.out)))
        uploaded = staging.commit(options.force, progress)
    return ConvertResult(
        src=src,
        dst=dst,
        to=options.to.value,
        layout=layout.name,
        tensors=len(plan),
        bytes=sum(p.nbytes for p in plan),
        files=files,
        bytes_read=read.bytes_read,
        seconds=time.perf_counter() - started,
        dtype=options.dtype,
        copied=copied,
        streamed=written.streamed,
        assembled=written.assembled,
        warnings=tuple(notes),
        checkpoint=url,
        weights=weights.value,
        uploaded=uploaded,
    )


def _resolve_source(src: str, layout_name: str | None) -> tuple[str, Layout, CheckpointRef]:
    """The checkpoint folder to convert, its layout and ref: `src` itself, or, for a save folder that no
    layout recognises but whose `latest` file names a tag folder inside it (DeepSpeed), that tag."""
    try:
        layout, ref = detect(src, layout_name)
        return src, layout, ref
    except UnknownLayout:
        from ckptctl.frameworks.deepspeed.layout import read_latest

        entries = io.list_dir(src)
        tag = read_latest(src, entries)
        if tag is None or not any(e.name == tag and e.is_dir for e in entries):
            raise
    url = io.join(src, tag)
    layout, ref = detect(url, layout_name)
    return url, layout, ref


# --------------------------------------------------------------------------------------------------
# What to write: selection, names, dtypes.
# --------------------------------------------------------------------------------------------------


def _plan(checkpoint: Checkpoint, options: ConvertOptions, notes: list[str]) -> tuple[list[_Planned], Weights]:
    """The output tensors, and which weights they are; appends what the user should know to `notes`."""
    index = checkpoint.tensor_index()
    masters = _master_weights(checkpoint, options, notes) if options.component is Component.MODEL else None
    if masters is not None:
        entries, upcast = list(masters.entries), masters.upcast
    else:
        entries, upcast = [e for e in index if e.component == options.component], frozenset()
    if not entries:
        present = sorted({e.component.value for e in index})
        raise CkptctlError(
            f"{checkpoint.url} holds no {options.component.value} tensors",
            f"components with tensors: {', '.join(present) or 'none'}; choose one with --component",
        )
    named = normalised_names(
        checkpoint.layout, entries, options.strip_prefix, compile_renames(options.renames), verb="written as"
    )
    plan: list[_Planned] = []
    for name, entry in named.items():
        if options.dtype and entry.dtype in _CASTABLE:
            dtype = options.dtype
        else:
            dtype = "float32" if entry.name in upcast else entry.dtype
        if options.to is Target.HF and dtype not in TORCH_TO_SAFETENSORS:
            raise CkptctlError(f"{entry.name!r} is {dtype}, which safetensors cannot store")
        plan.append(_Planned(entry, name, dtype))
    return plan, Weights.MASTER if masters is not None else Weights.STORED


def _deepspeed_prefix(checkpoint: Checkpoint) -> str | None:
    """Where the DeepSpeed tag folder of a checkpoint is, relative to it (`""`: the checkpoint is the tag;
    `global_step4/`: inside a Trainer `checkpoint-N`), or None when it holds none.

    Layouts built on `frameworks.deepspeed.layout` (RL frameworks' folders) are recognised by their model tensors'
    chunks lying in DeepSpeed rank files.
    """
    from ckptctl.frameworks.deepspeed.layout import tag_files

    if checkpoint.layout == "deepspeed":
        return ""
    info = checkpoint.metadata.get("deepspeed")
    if isinstance(info, dict) and isinstance(info.get("tag"), str):
        return f"{info['tag']}/"
    files = {chunk.file for e in checkpoint.tensor_index() if e.component is Component.MODEL for chunk in e.chunks}
    folders = set()
    for file in files:
        folder, _, name = file.rpartition("/")
        if tag_files([io.DirEntry(name, False, 0, 0.0)]) is not None:
            folders.add(folder)
    if len(folders) != 1:
        return None
    folder = folders.pop()
    return f"{folder}/" if folder else ""


def _master_weights(checkpoint: Checkpoint, options: ConvertOptions, notes: list[str]) -> MasterWeights | None:
    """`frameworks.deepspeed.layout.MasterWeights` of a DeepSpeed source when they are wanted and present, else None.

    Raises:
        CkptctlError: `weights=master` on a source without fp32 master weights.
    """
    from ckptctl.frameworks.deepspeed.layout import master_weights, read_tag

    if options.weights is Weights.STORED:
        return None
    prefix = _deepspeed_prefix(checkpoint)
    if prefix is None:
        if options.weights is Weights.MASTER:
            raise CkptctlError(
                f"{checkpoint.url} ({checkpoint.layout}) holds no fp32 master weights apart from its model",
                "fp32 masters exist in DeepSpeed ZeRO checkpoints; drop --weights master",
            )
        return None
    tag = read_tag(io.join(checkpoint.url, prefix.rstrip("/")) if prefix else checkpoint.url)
    if not tag.files.optim or tag.optim_kind is None:
        if options.weights is Weights.MASTER:
            raise CkptctlError(
                f"{tag.url} holds no fp32 master weights (ZeRO stage {tag.zero_stage} saves no optimizer partitions)",
                "convert the module's own weights: drop --weights master",
            )
        notes.append(
            f"DeepSpeed without ZeRO (stage {tag.zero_stage}) saves no optimizer partitions: writing the module's "
            "weights as stored (DeepSpeed's zero_to_fp32 cannot read such a checkpoint)"
        )
        return None
    found = master_weights(tag, prefix)
    notes.extend(found.notes)
    return found


# --------------------------------------------------------------------------------------------------
# Writing HF.
# --------------------------------------------------------------------------------------------------


def _workers(requested: int | None) -> int:
    return requested or max(2, min(8, os.cpu_count() or 2))


def _write_hf(
    checkpoint: Checkpoint, plan: list[_Planned], out: str, options: ConvertOptions, progress: Progress
) -> _Written:
    """Write the safetensors shards (+ index), streaming every tensor that allows it, and check them."""
    shards = plan_shards([p.nbytes for p in plan], options.max_shard_size)
    names = _shard_names(len(shards))
    with ChunkLocator(checkpoint.url) as locator:
        sources = [_sources(p, locator) for p in plan]
    streamed = sum(1 for s in sources if s is not None)
    expected: dict[str, list[_Planned]] = {}
    written: dict[str, WrittenFile] = {}
    progress.start("converting", sum(p.nbytes for p in plan))
    with StreamCopier(_workers(options.workers), on_bytes=progress.advance) as copier:
        for file_name, members in zip(names, shards, strict=True):
            items = [plan[i] for i in members]
            header = build_header([(p.name, p.dtype, p.shape) for p in items], {"format": "pt"})
            file_sources: list[Source] = []
            for i in members:
                found = sources[i]
                file_sources.extend(found if found is not None else [_assembled_source(checkpoint.url, plan[i])])
            written[file_name] = copier.write_file(os.path.join(out, file_name), header, file_sources)
            expected[file_name] = items
        progress.finish()
        _check_hf_output(out, expected, written, copier if options.reread else None, progress)
    if len(names) > 1:
        weight_map = {p.name: file_name for file_name, items in expected.items() for p in items}
        index = {
            "metadata": {
                "total_size": sum(p.nbytes for p in plan),
                "total_parameters": sum(p.entry.numel for p in plan),
            },
            "weight_map": dict(sorted(weight_map.items())),
        }
        _write_small(os.path.join(out, INDEX_NAME), json.dumps(index, indent=2).encode() + b"\n")
    digests = {name: FileRecord(w.size, w.blake3) for name, w in written.items()}
    return _Written(streamed, len(plan) - streamed, digests)


#: Row runs of interleaved chunks shorter than this on average are not worth one read each: the tensor is
#: assembled instead.
_MIN_AVERAGE_RUN_BYTES = 256


def _sources(planned: _Planned, locator: ChunkLocator) -> list[Source] | None:
    """Byte ranges that make up the tensor in row-major order, or None when it must be assembled."""
    entry = planned.entry
    itemsize = dtype_itemsize(entry.dtype)
    runs: list[tuple[int, int, str, int]] = []  # (first element, count, file, byte offset)
    interleaved = False
    for chunk in entry.chunks:
        if chunk.numel == 0:
            continue
        layout = row_major_runs(entry.shape, chunk.offsets, chunk.sizes)
        if layout is None:
            return None
        found = locator.locate(entry, chunk)
        if found is None:
            return None
        interleaved = interleaved or len(layout) > 1
        runs.extend((start, count, found.url, found.offset + first * itemsize) for start, first, count in layout)
    if interleaved and entry.nbytes / len(runs) < _MIN_AVERAGE_RUN_BYTES:
        return None
    runs.sort(key=lambda run: run[0])
    merged: list[list[Any]] = []
    position = 0
    for start, count, url, offset in runs:
        if start != position:  # a gap or an overlap: let read_tensor report it with its coverage check
            return None
        position += count
        last = merged[-1] if merged else None
        if last is not None and last[2] == url and last[3] + last[1] * itemsize == offset:
            last[1] += count  # adjacent in the source too: one read
        else:
            merged.append([start, count, url, offset])
    if position != entry.numel:
        return None
    return [RangeSource(url, offset, count * itemsize, entry.dtype, planned.dtype) for _, count, url, offset in merged]


def _assembled_source(checkpoint_url: str, planned: _Planned) -> BufferSource:
    def produce() -> memoryview:
        import torch

        from ckptctl.formats.chunks import read_tensor

        tensor = read_tensor(checkpoint_url, planned.entry)
        if planned.dtype != planned.entry.dtype:
            tensor = tensor.to(getattr(torch, planned.dtype))
        return tensor_bytes(tensor)

    return BufferSource(produce, planned.nbytes)


def _check_hf_output(
    out: str,
    expected: dict[str, list[_Planned]],
    written: dict[str, WrittenFile],
    rehash: StreamCopier | None,
    progress: Progress,
) -> None:
    """Every written header names exactly the planned tensors with their dtypes and shapes, and (given a
    copier to `rehash` with) every file reads back with the digest computed while writing it."""
    for file_name, items in expected.items():
        path = os.path.join(out, file_name)
        header = read_header(path)
        got = [(t.name, t.dtype, t.shape) for t in sorted(header.tensors, key=lambda t: t.begin)]
        want = [(p.name, p.dtype, p.shape) for p in items]
        if got != want or header.file_size != written[file_name].size:
            raise CorruptCheckpoint(f"{file_name} does not hold what was planned", "this is a bug in ckptctl")
    if rehash is None:
        return
    progress.start("verifying", sum(w.size for w in written.values()))
    for file_name, record in written.items():
        if rehash.digest(os.path.join(out, file_name)) != record.blake3:
            raise CorruptCheckpoint(
                f"{file_name} reads back different from what was written", "check the disk and the filesystem"
            )
    progress.finish()


# --------------------------------------------------------------------------------------------------
# Writing DCP.
# --------------------------------------------------------------------------------------------------


def _write_dcp(checkpoint: Checkpoint, plan: list[_Planned], out: str, progress: Progress) -> _Written:
    """One `dcp.save({"model": ...})` without a process group, checked against the plan.

    Whole tensors stored raw in local files (HF, native safetensors) are memory-mapped, not copied.
    """
    import torch
    import torch.distributed.checkpoint as dcp

    from ckptctl.formats.chunks import read_tensor

    total = sum(p.nbytes for p in plan)
    progress.start("writing DCP", total)
    assembled = 0
    with contextlib.ExitStack() as stack:
        state: dict[str, Any] = {}
        maps: dict[str, Any] = {}
        for planned in plan:
            tensor = _mapped_tensor(checkpoint.url, planned.entry, maps, stack)
            if tensor is None:
                tensor = read_tensor(checkpoint.url, planned.entry)
                assembled += 1
            if planned.dtype != planned.entry.dtype:
                tensor = tensor.to(getattr(torch, planned.dtype))
            state[planned.name] = tensor
        writer = dcp.FileSystemWriter(out, single_file_per_rank=True, sync_files=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "saving in non-distributed mode"
            dcp.save({DCP_NAMESPACE: state}, storage_writer=writer, no_dist=True)
        state.clear()
    progress.advance(total)
    progress.finish()
    _check_dcp_output(out, plan)
    return _Written(0, assembled, {})


def _mapped_tensor(checkpoint_url: str, entry: TensorEntry, maps: dict[str, Any], stack: contextlib.ExitStack) -> Any:
    """A tensor over a copy-on-write map of its bytes when it is one raw chunk of a local file, else None."""
    import mmap

    import torch

    from ckptctl.checkpoint import ChunkEncoding

    if len(entry.chunks) != 1 or entry.numel == 0:
        return None
    chunk = entry.chunks[0]
    url = io.join(checkpoint_url, chunk.file)
    if chunk.encoding != ChunkEncoding.RAW or chunk.sizes != entry.shape or not io.is_local(url):
        return None
    mapped = maps.get(url)
    if mapped is None:
        with open(io.local_path(url), "rb") as f:
            mapped = maps[url] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        stack.callback(_close_quietly, mapped)
    if chunk.byte_length != entry.nbytes or chunk.byte_offset + chunk.byte_length > len(mapped):
        raise CorruptCheckpoint(f"{entry.name}: its bytes lie outside {chunk.file}", "the file is truncated")
    io.count_read(chunk.byte_length)
    flat = torch.frombuffer(mapped, dtype=getattr(torch, entry.dtype), count=entry.numel, offset=chunk.byte_offset)
    return flat.view(entry.shape)


def _close_quietly(mapped: Any) -> None:
    with contextlib.suppress(BufferError):  # a tensor still refers to it: the collector unmaps it later
        mapped.close()


def _check_dcp_output(out: str, plan: list[_Planned]) -> None:
    from ckptctl.frameworks.dcp.layout import load_dcp_metadata, verify_dcp

    problems = [p for p in verify_dcp(out) if p.severity == "error"]
    if problems:
        raise CorruptCheckpoint(f"the DCP output fails verification: {problems[0].message}", "this is a bug in ckptctl")
    stored = {key: (t.dtype, t.size) for key, t in load_dcp_metadata(out).tensors()}
    want = {f"{DCP_NAMESPACE}.{p.name}": (p.dtype, p.shape) for p in plan}
    if stored != want:
        raise CorruptCheckpoint("the DCP output does not hold what was planned", "this is a bug in ckptctl")


# --------------------------------------------------------------------------------------------------
# Config and tokenizer files.
# --------------------------------------------------------------------------------------------------


def _side_files(src: str, options: ConvertOptions) -> tuple[dict[str, str], list[str]]:
    """Config and tokenizer files to copy (name -> URL), and notes for the user."""
    beside = [src, io.parent_of(src)]
    notes: list[str] = []
    found: dict[str, str] = {}
    for names, explicit, what, flag in (
        (CONFIG_FILES, options.config_dir, "config.json", "--config"),
        (TOKENIZER_FILES, options.tokenizer_dir, "tokenizer files", "--tokenizer"),
    ):
        if explicit is not None:
            files = _present(explicit, names)
            if not files:
                raise CheckpointNotFound(f"{explicit} holds no {what}", f"pass the folder that holds them to {flag}")
            found.update(files)
            continue
        for folder in beside:
            files = _present(folder, names)
            if files and (names is TOKENIZER_FILES or "config.json" in files):
                found.update(files)
                break
        else:
            notes.append(f"no {what} found beside {src}; pass {flag} DIR to include them")
    return found, notes


def _present(folder: str, names: Sequence[str]) -> dict[str, str]:
    try:
        entries = {e.name for e in io.list_dir(folder) if not e.is_dir}
    except CkptctlError:
        return {}
    return {name: io.join(folder, name) for name in names if name in entries}


def _copy_side_files(files: dict[str, str], out: str, dtype: str | None) -> tuple[str, ...]:
    """Copy config/tokenizer files; with a cast, config.json's dtype field follows it."""
    for name, url in files.items():
        data = io.read_bytes(url)
        if name == "config.json" and dtype is not None:
            data = _config_with_dtype(data, dtype)
        _write_small(os.path.join(out, name), data)
    return tuple(sorted(files))


def _config_with_dtype(data: bytes, dtype: str) -> bytes:
    try:
        config = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return data
    if not isinstance(config, dict):
        return data
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for key in keys:
        config[key] = dtype
    return json.dumps(config, indent=2, sort_keys=True).encode() + b"\n"


# --------------------------------------------------------------------------------------------------
# Digests, staging, commit.
# --------------------------------------------------------------------------------------------------


def _write_small(path: str, data: bytes) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _write_digests(out: str, known: dict[str, FileRecord]) -> None:
    """Record size and blake3 of every output file, as `ckptctl verify --write-manifest` would.

    `known` holds the digests computed while writing the tensor files: they are not hashed again.
    """
    files = {}
    for root, _dirs, names in os.walk(out):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, out).replace(os.sep, "/")] = path
    records = {}
    for rel, path in sorted(files.items()):
        records[rel] = known.get(rel) or FileRecord(os.path.getsize(path), file_digest(path))
    _write_small(os.path.join(out, DIGESTS_NAME), Manifest(files=records, created=now_iso()).to_json())
    io.fsync_dir(out)


def _check_destination(src: str, dst: str, force: bool) -> str:
    """The absolute local DST (or the object store URL without a trailing `/`), refused when it would
    overwrite something it must not."""
    if not io.is_local(dst):
        return _check_remote_destination(src, dst, force)
    path = os.path.abspath(io.local_path(dst))
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CkptctlError(f"{path} exists and is not a folder", "choose a folder path for the output")
    if os.path.isdir(path) and os.listdir(path) and not force:
        raise CkptctlError(f"{path} is not empty", "pass --force to replace it, or choose another folder")
    if io.is_local(src):
        source = os.path.realpath(io.local_path(src))
        target = os.path.realpath(path)
        if source == target or source.startswith(target.rstrip(os.sep) + os.sep):
            raise CkptctlError(
                f"{path} contains the source {src}; the output would replace it", "choose another folder"
            )
    if force and os.path.isdir(path) and os.listdir(path):
        # --force swaps the whole folder out: never one a typo could name (`~`, `.`), and never one holding
        # sub-folders unless an earlier conversion wrote it (an export is flat; a run folder is not).
        io.refuse_to_replace_precious(path, "choose another output folder")
        earlier_export = os.path.isfile(os.path.join(path, DIGESTS_NAME))
        if not earlier_export and any(entry.is_dir() for entry in os.scandir(path)):
            raise CkptctlError(
                f"refusing to replace {path}: it holds sub-folders and no {DIGESTS_NAME}, so it is not an earlier export",
                "choose another output folder, or delete this one yourself if you are sure",
            )
    return path


def _check_remote_destination(src: str, dst: str, force: bool) -> str:
    """`dst` without a trailing `/`, refused when objects are below it (without `force`), when it is an
    object itself, or when it holds the source."""
    url = dst.rstrip("/")
    scheme, _, path = url.partition("://")
    if not path.strip("/"):
        raise CkptctlError(f"{dst} names no bucket or folder", f"write into a prefix, e.g. {scheme}://BUCKET/export")
    if not io.is_local(src):
        source = src.rstrip("/")
        if source == url or source.startswith(url + "/"):
            raise CkptctlError(f"{url} contains the source {src}; the output would replace it", "choose another prefix")
    existing = io.list_tree(url)
    if existing and not force:
        raise CkptctlError(
            f"{url} is not empty ({len(existing)} object(s) below it)",
            "pass --force to replace them, or choose another prefix; an upload that was killed also leaves "
            "objects behind, which --force removes",
        )
    if not existing and io.exists(url):
        raise CkptctlError(f"{url} is an object, not a folder", "choose a folder path for the output")
    return url


class _Staging:
    """The hidden folder a conversion writes into, its lock, and the final rename.

    `.<name>.ckptctl-convert-<pid>/` next to DST holds `lock` (flock'ed while the conversion runs) and
    `out/` (the future DST). A staging folder whose lock nobody holds is left over from a killed
    conversion and is removed by the next conversion into the same DST.
    """

    def __init__(self, dst: str, parent: str | None = None, stem: str | None = None) -> None:
        """`parent` and `stem`: the folder that holds the staging folder and the start of its name (next to
        DST, `.<name of DST>`, unless given)."""
        self.dst = dst
        self.parent = os.path.dirname(dst) if parent is None else parent
        self.stem = f".{os.path.basename(dst)}" if stem is None else stem
        self.root = os.path.join(self.parent, f"{self.stem}{_STAGING_TAG}{os.getpid()}")
        self.out = os.path.join(self.root, _OUT_NAME)
        self._lock_fd: int | None = None

    def __enter__(self) -> _Staging:
        try:
            os.makedirs(self.parent, exist_ok=True)
            self._clean_stale()
            os.mkdir(self.root)
            self._lock_fd = os.open(os.path.join(self.root, _LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            os.mkdir(self.out)
        except OSError as exc:
            self._remove()
            raise StorageError(f"cannot create a staging folder in {self.parent}: {exc.strerror or exc}") from exc
        return self

    def check_space(self, tensor_bytes: int) -> None:
        """Nothing to check next to DST: the output is written where the user asked for it."""

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _clean_stale(self) -> None:
        prefix = f"{self.stem}{_STAGING_TAG}"
        for name in os.listdir(self.parent):
            if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
                continue
            folder = os.path.join(self.parent, name)
            try:
                fd = os.open(os.path.join(folder, _LOCK_NAME), os.O_RDWR)
            except OSError:  # no lock (yet): being created, or not ours to judge
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CkptctlError(
                    f"another conversion into {self.dst} is running ({folder})",
                    "wait for it to finish, or stop it; its staging folder is removed by the next run",
                ) from None
            else:
                shutil.rmtree(folder, ignore_errors=True)
            finally:
                os.close(fd)

    def commit(self, force: bool, progress: Progress) -> int:
        """Move `out/` to DST (`commit.install`: a plain rename, or an atomic exchange with a non-empty DST
        under `force`, whose old content is then deleted). Returns the bytes uploaded: none."""
        io.fsync_dir(self.out)
        dst = self.dst
        if os.path.isdir(dst) and os.listdir(dst) and not force:
            raise CkptctlError(f"{dst} was filled while converting", "pass --force to replace it")
        try:
            replaced = commit.install(self.out, dst)
        except OSError as exc:
            raise StorageError(f"cannot move the output into {dst}: {exc.strerror or exc}") from exc
        if replaced is not None:
            trash.purge(replaced)
        return 0


class _UploadStaging(_Staging):
    """The local folder an output for an object store is written into, and its upload.

    `.ckptctl-upload-<hash of DST>.ckptctl-convert-<pid>/` in the temporary folder (`TMPDIR`), locked like
    a staging folder next to a local DST: a conversion into the same DST that runs on this machine is
    refused, and one that was killed has its staging folder removed by the next.
    """

    def __init__(self, dst: str) -> None:
        digest = hashlib.sha256(dst.encode()).hexdigest()[:16]
        super().__init__(dst, tempfile.gettempdir(), f".ckptctl-upload-{digest}")

    def check_space(self, tensor_bytes: int) -> None:
        """Raise `StorageError` when the temporary folder's disk cannot hold an output of `tensor_bytes`
        (before converting, rather than on a full disk halfway)."""
        try:
            usage = shutil.disk_usage(self.root)
        except OSError:
            return
        need = tensor_bytes + (1 << 20)  # headers, index, config
        if usage.total and usage.free < need:
            raise StorageError(
                f"staging the output for {self.dst} needs {need} bytes in {self.parent}, which has {usage.free} free",
                "point TMPDIR at a folder on a disk with room for the output (it is uploaded from there)",
            )

    def commit(self, force: bool, progress: Progress) -> int:
        """Upload `out/` to DST in `_upload_order`, then, once a listing shows every object with its size,
        the digests; returns the bytes uploaded.

        Objects that appeared below DST while converting are refused without `force` and deleted first
        with it. A failed upload deletes what it uploaded (the old objects, under `force`, are gone).
        """
        sizes = {
            os.path.relpath(os.path.join(root, name), self.out).replace(os.sep, "/"): os.path.getsize(
                os.path.join(root, name)
            )
            for root, _dirs, names in os.walk(self.out)
            for name in names
        }
        upload = commit.ObjectStoreUpload(self.out, self.dst, _MARKERS, lambda rel: progress.advance(sizes[rel]))
        existing = io.list_tree(self.dst)
        if existing:
            if not force:
                raise CkptctlError(f"{self.dst} was filled while converting", "pass --force to replace it")
            upload.clear(existing)
        progress.start("uploading", sum(sizes.values()))
        try:
            upload.upload(_upload_order(sizes))
            self._check_uploaded({rel: size for rel, size in sizes.items() if rel != DIGESTS_NAME})
            upload.finish(DIGESTS_NAME)
        except BaseException:
            with contextlib.suppress(Exception):
                upload.undo()
            raise
        finally:
            progress.finish()
        return sum(sizes.values())

    def _check_uploaded(self, sizes: Mapping[str, int]) -> None:
        """Every uploaded object is listed with the size of its local file (before the digests go up)."""
        listed = {rel: entry.size for rel, entry in io.list_tree(self.dst).items()}
        wrong = sorted(rel for rel, size in sizes.items() if listed.get(rel) != size)
        if wrong:
            raise StorageError(
                f"the object store lists {wrong[0]} below {self.dst} "
                + ("as missing" if wrong[0] not in listed else f"with {listed[wrong[0]]} bytes, not {sizes[wrong[0]]}"),
                "another writer may be using the same prefix; convert again with --force",
            )


_HF_SHARD = re.compile(r"-\d{5}-of-\d{5}\.safetensors$")
#: What `trash` deletes first of an output in a folder of an object store (replaced under `force`, or an
#: upload undone), so that no moment of it passes for complete: the digests, then the files whose presence
#: completes a checkpoint for some layout (the index, DCP and native metadata, the first shard of each
#: sharded model), then the rest.
_MARKERS = (
    (DIGESTS_NAME,),
    (MANIFEST_NAME, ".metadata", INDEX_NAME, "model.safetensors", "*-00001-of-[0-9][0-9][0-9][0-9][0-9].safetensors"),
)


def _keystone(sizes: Mapping[str, int]) -> str | None:
    """The file of an output whose arrival makes its layout call the folder complete: DCP's `.metadata`
    (without it a DCP folder is in progress), the smallest shard of a sharded HF model (with one missing,
    the shard naming shows it broken), or `model.safetensors`."""
    if ".metadata" in sizes:
        return ".metadata"
    shards = [rel for rel in sizes if "/" not in rel and _HF_SHARD.search(rel)]
    if shards:
        return min(shards, key=lambda rel: (sizes[rel], rel))
    return "model.safetensors" if "model.safetensors" in sizes else None


def _upload_order(sizes: Mapping[str, int]) -> list[list[str]]:
    """Batches of an output's files (the digests aside, which go up last) to upload one after another,
    each batch in parallel: weight files; index, config, tokenizer and other small files; the keystone
    (`_keystone`). Until the keystone is up, the prefix lists as broken or in progress, or holds no
    checkpoint at all."""
    keystone = _keystone(sizes)
    rest = [rel for rel in sorted(sizes) if rel not in (keystone, DIGESTS_NAME)]
    data = [rel for rel in rest if rel.endswith((".safetensors", ".distcp"))]
    small = [rel for rel in rest if rel not in data]
    return [batch for batch in (data, small, [keystone] if keystone else []) if batch]
