"""`convert --to hf`: safetensors shards (and their index) streamed from the source's raw records.

From any layout with a tensor index (torch DCP of any world size, ckptctl's own checkpoints, ZeRO
partitions, or HF itself for resharding/casting), the output is laid out from the tensor index alone
(names, dtypes, shapes → shard files and their headers), then filled as one sequential stream per file
(`formats.safetensors_stream`, O_DIRECT where possible). Chunks that are full in their trailing dimensions
(FSDP dim-0 shards, tensor-parallel column shards, whole tensors) are byte-copied, run of rows by run of
rows, from the raw records inside the source files into their precomputed output offsets, converted block
by block when `dtype` asks. Other chunks (strided views inside their archive, scattered tiny runs) are
assembled in memory one tensor at a time (`chunks.read_tensor`). Peak memory is a few copy buffers plus
the largest assembled tensor, whatever the model size.
"""

from __future__ import annotations

import json
import os

from ckptctl.checkpoint import dtype_itemsize
from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.manifest import FileRecord
from ckptctl.formats.raw_chunks import ChunkLocator, flat_ranges
from ckptctl.formats.safetensors import WrittenFile, build_header, read_header, tensor_bytes
from ckptctl.formats.safetensors_stream import BufferSource, RangeSource, Source, StreamCopier, plan_shards
from ckptctl.formats.safetensors_stream import shard_file_names as _shard_names
from ckptctl.ops.commit import write_small
from ckptctl.ops.convert.options import ConvertOptions
from ckptctl.ops.convert.plan import Planned, Written, read_planned
from ckptctl.ops.distributed_work import Ranks, split
from ckptctl.ops.report import Progress

INDEX_NAME = "model.safetensors.index.json"


def _workers(requested: int | None) -> int:
    return requested or max(2, min(8, os.cpu_count() or 2))


def write_hf(
    checkpoint_url: str,
    plan: list[Planned],
    out: str,
    options: ConvertOptions,
    progress: Progress,
    ranks: Ranks | None = None,
    file_name: str | None = None,
) -> Written:
    """Write the safetensors shards (+ index), streaming every tensor that allows it, and check them.

    Over a job's `ranks` (all of them call this), each rank writes and checks its share of the shard files,
    balanced by bytes, and rank 0 writes the index; every rank returns the digests of all files. Given
    `file_name`, every tensor goes into that one file (an adapter's weights file, which is never sharded).
    """
    if file_name is not None:
        shards, names = [list(range(len(plan)))], [file_name]
    else:
        shards = plan_shards([p.nbytes for p in plan], options.max_shard_size)
        names = _shard_names(len(shards))
    expected = {file_name: [plan[i] for i in members] for file_name, members in zip(names, shards, strict=True)}
    headers = {
        file_name: build_header([(p.name, p.dtype, p.shape) for p in items], {"format": "pt"})
        for file_name, items in expected.items()
    }
    sizes = [len(headers[name]) + sum(p.nbytes for p in expected[name]) for name in names]

    def write(indices: list[int]) -> dict[int, tuple[WrittenFile, int]]:
        """Write the files `indices`: each file's size and digest, and how many of its tensors streamed."""
        members = [i for k in indices for i in shards[k]]
        with ChunkLocator(checkpoint_url) as locator:
            sources = {i: _sources(plan[i], locator) for i in members}
        done: dict[int, tuple[WrittenFile, int]] = {}
        progress.start("converting", sum(plan[i].nbytes for i in members))
        with StreamCopier(_workers(options.workers), on_bytes=progress.advance) as copier:
            for k in indices:
                file_sources: list[Source] = []
                for i in shards[k]:
                    found = sources[i]
                    file_sources.extend(found if found is not None else [_assembled_source(checkpoint_url, plan[i])])
                streamed = sum(sources[i] is not None for i in shards[k])
                done[k] = (copier.write_file(os.path.join(out, names[k]), headers[names[k]], file_sources), streamed)
            progress.finish()
            mine = {names[k]: expected[names[k]] for k in indices}
            files = {names[k]: done[k][0] for k in indices}
            _check_hf_output(out, mine, files, copier if options.reread else None, progress)
        return done

    results = split(ranks, sizes, write)
    written = {name: result[0] for name, result in zip(names, results, strict=True)}
    streamed = sum(result[1] for result in results)
    if len(names) > 1 and (ranks is None or ranks.leader):
        weight_map = {p.name: file_name for file_name, items in expected.items() for p in items}
        index = {
            "metadata": {
                "total_size": sum(p.nbytes for p in plan),
                "total_parameters": sum(p.entry.numel for p in plan),
            },
            "weight_map": dict(sorted(weight_map.items())),
        }
        write_small(os.path.join(out, INDEX_NAME), json.dumps(index, indent=2).encode() + b"\n")
    digests = {name: FileRecord(w.size, w.blake3) for name, w in written.items()}
    return Written(streamed, len(plan) - streamed, digests)


#: Row runs of interleaved chunks shorter than this on average are not worth one read each: the tensor is
#: assembled instead.
_MIN_AVERAGE_RUN_BYTES = 256


def _sources(planned: Planned, locator: ChunkLocator) -> list[Source] | None:
    """Byte ranges that make up the tensor in row-major order, or None when it must be assembled (or computed)."""
    if planned.rows is not None or planned.derived is not None:  # reordered rows, or computed: one at a time
        return None
    entry = planned.entry
    ranges = flat_ranges(entry, locator, _MIN_AVERAGE_RUN_BYTES)
    if ranges is None:
        return None
    itemsize = dtype_itemsize(entry.dtype)
    return [RangeSource(r.url, r.offset, r.count * itemsize, entry.dtype, planned.dtype) for r in ranges]


def _assembled_source(checkpoint_url: str, planned: Planned) -> BufferSource:
    def produce() -> memoryview:
        derived = planned.derived
        as_computed = derived is not None and planned.rows is None and planned.dtype == derived.dtype
        if as_computed and derived is not None and derived.compute_bytes is not None:
            data = derived.compute_bytes()
            if len(data) != planned.nbytes:
                raise CorruptCheckpoint(
                    f"{planned.name}: computed {len(data)} bytes where {planned.nbytes} were planned",
                    "this is a bug in ckptctl",
                )
            return data
        return tensor_bytes(read_planned(checkpoint_url, planned))

    return BufferSource(produce, planned.nbytes)


def _check_hf_output(
    out: str,
    expected: dict[str, list[Planned]],
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
