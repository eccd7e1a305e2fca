"""`convert --to dcp` (from an HF folder, for resuming from a published model): a torch DCP save as
`dcp.save` makes it without a process group, keys `model.<name>`, which `dcp.load` reshards onto any world
size. A tied copy the HF folder leaves out (`lm_head.weight`) is in the plan as a key of its own
(`model_check.apply_ties`): `dcp.load({"model": model.state_dict()})` asks for every key.

The tensors go into data files of at most `dcp_file_size` bytes (`__0_0.distcp`, `__0_1.distcp`, ...; one
file, as `dcp.save` writes it, up to the default 5 GB), each written by torch's own `FileSystemWriter`.
The files are the unit a job's ranks share by bytes: the plan (`.metadata`) is made from the tensors'
shapes alone, each rank writes its files, and rank 0 writes `.metadata`, which completes the folder,
after every rank's files. The output does not depend on the number of ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import ProblemKind
from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.dcp_writer import data_file_writer
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import FileRecord
from ckptctl.formats.safetensors_stream import plan_shards
from ckptctl.layouts import get_layout
from ckptctl.ops.convert.options import Target
from ckptctl.ops.convert.plan import Planned, Written, read_planned
from ckptctl.ops.distributed_work import Ranks, split
from ckptctl.ops.report import Progress

#: The key namespace of a `--to dcp` save: `{"model": state_dict}` as training loops save and load it.
DCP_NAMESPACE = "model"


def write_dcp(
    checkpoint_url: str,
    plan: list[Planned],
    out: str,
    file_size: int,
    progress: Progress,
    ranks: Ranks | None = None,
) -> Written:
    """The DCP save of `plan` into `out`, checked against the plan.

    Over a job's `ranks` (all of them call this), each rank writes its share of the data files, balanced
    by bytes, and rank 0 writes `.metadata` and checks the output; every rank returns the digests of
    the data files. Whole tensors stored raw in local files (HF folders, ckptctl's own safetensors) are
    memory-mapped, not copied.
    """
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    # The global plan and its metadata from stand-ins of the tensors' shapes: no rank reads a tensor that
    # another rank writes.
    planner = DefaultSavePlanner()
    stand_ins = {p.name: torch.empty(p.shape, dtype=getattr(torch, p.dtype), device="meta") for p in plan}
    planner.set_up_planner({DCP_NAMESPACE: stand_ins}, None, True)
    plans, metadata = planner.create_global_plan([planner.create_local_plan()])
    items = {item.index.fqn: item for item in planner.finish_plan(plans[0]).items}
    files = plan_shards([p.nbytes for p in plan], file_size)
    names = [f"__0_{k}.distcp" for k in range(len(files))]

    def write(indices: list[int]) -> dict[int, tuple[list[Any], FileRecord, int]]:
        """Write the files `indices`: each file's write results (for `.metadata`), size and digest, and how
        many of its tensors were read and assembled rather than mapped."""
        done: dict[int, tuple[list[Any], FileRecord, int]] = {}
        progress.start("writing DCP", sum(plan[i].nbytes for k in indices for i in files[k]))
        for k in indices:
            results, record, assembled = _write_file(checkpoint_url, [plan[i] for i in files[k]], items, out, names[k])
            if record is None:  # a torch whose writer loop ckptctl does not drive: hashed after
                path = os.path.join(out, names[k])
                record = FileRecord(os.path.getsize(path), file_digest(path))
            done[k] = (results, record, assembled)
            progress.advance(sum(plan[i].nbytes for i in files[k]))
        progress.finish()
        return done

    found = split(ranks, [sum(plan[i].nbytes for i in members) for members in files], write)
    if ranks is None or ranks.leader:
        # The records anew from this rank's own plan and names: pickle shares what is one object in memory,
        # and the other ranks' records arrive as copies, which would make `.metadata`'s bytes differ.
        records = [
            [
                dataclasses.replace(
                    result,
                    index=items[result.index.fqn].index,
                    storage_data=dataclasses.replace(result.storage_data, relative_path=name),
                )
                for result in results
            ]
            for name, (results, _, _) in zip(names, found, strict=True)
        ]
        data_file_writer(out, "").finish(metadata, records)
        # Files absent here were written by other ranks into staging folders of their own (an upload).
        elsewhere = {
            name: record.size
            for name, (_, record, _) in zip(names, found, strict=True)
            if not os.path.exists(os.path.join(out, name))
        }
        _check_dcp_output(out, plan, elsewhere, metadata)
    digests = {name: record for name, (_, record, _) in zip(names, found, strict=True)}
    return Written(0, sum(assembled for _, _, assembled in found), digests)


def _write_file(
    checkpoint_url: str, members: list[Planned], items: dict[str, Any], out: str, name: str
) -> tuple[list[Any], FileRecord | None, int]:
    """One data file of `members` (torch's writer: what `dcp.save` writes, tensor by tensor); its write
    results, its size and digest when it was hashed while written, and the number of tensors read and
    assembled rather than mapped.

    A tensor that is not mapped is read (or computed) only when the writer reaches its item, and let go once
    written (`data_file_writer`): the file holds one such tensor in memory at a time, not all of them."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan

    class LazyPlanner(DefaultSavePlanner):
        """Resolves the tensors of `produce` (flattened key -> planned tensor) when their item is written."""

        def __init__(self, produce: dict[str, Planned]) -> None:
            super().__init__()
            self.produce = produce

        def lookup_object(self, index: Any) -> Any:
            planned = self.produce.get(index.fqn)
            return super().lookup_object(index) if planned is None else read_planned(checkpoint_url, planned)

    assembled = 0
    with contextlib.ExitStack() as stack:
        state: dict[str, Any] = {}
        maps: dict[str, Any] = {}
        produce: dict[str, Planned] = {}
        for planned in members:
            tensor = _mapped_tensor(checkpoint_url, planned, maps, stack)
            if tensor is None:
                tensor = torch.empty(planned.shape, dtype=getattr(torch, planned.dtype), device="meta")
                produce[f"{DCP_NAMESPACE}.{planned.name}"] = planned
                assembled += 1
            state[planned.name] = tensor
        planner = LazyPlanner(produce)
        planner.set_up_planner({DCP_NAMESPACE: state}, None, True)
        file_plan = SavePlan([items[f"{DCP_NAMESPACE}.{p.name}"] for p in members])
        writer = data_file_writer(out, name)
        results = writer.write_data(file_plan, planner).value()
        state.clear()
    return results, writer.written, assembled


def _mapped_tensor(checkpoint_url: str, planned: Planned, maps: dict[str, Any], stack: contextlib.ExitStack) -> Any:
    """A tensor over a copy-on-write map of its bytes (cast as planned) when it is one raw chunk of a local
    file, else None."""
    import mmap

    import torch

    from ckptctl.checkpoint import ChunkEncoding

    entry = planned.entry
    if len(entry.chunks) != 1 or entry.numel == 0 or planned.derived is not None:
        return None
    chunk = entry.chunks[0]
    url = io.join(checkpoint_url, chunk.file)
    # The fast path maps the local file (no copy); a remote one is read by the general path.
    if chunk.encoding != ChunkEncoding.RAW or chunk.sizes != entry.shape or not io.is_local(url):
        return None
    mapped = maps.get(url)
    if mapped is None:
        with open(io.local_path(url), "rb") as f:
            if not io.maps_safely(f.fileno()):
                # Off a known-local file system a page the storage fails to bring in is a SIGBUS, not an error.
                return None
            mapped = maps[url] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        stack.callback(_close_quietly, mapped)
    if chunk.byte_length != entry.nbytes or chunk.byte_offset + chunk.byte_length > len(mapped):
        raise CorruptCheckpoint(f"{entry.name}: its bytes lie outside {chunk.file}", "the file is truncated")
    io.count_read(chunk.byte_length)
    flat = torch.frombuffer(mapped, dtype=getattr(torch, entry.dtype), count=entry.numel, offset=chunk.byte_offset)
    tensor = flat.view(entry.shape)
    return tensor.to(getattr(torch, planned.dtype)) if planned.dtype != entry.dtype else tensor


def _close_quietly(mapped: Any) -> None:
    with contextlib.suppress(BufferError):  # a tensor still refers to it: the collector unmaps it later
        mapped.close()


def _check_dcp_output(out: str, plan: list[Planned], elsewhere: Mapping[str, int], metadata: Any) -> None:
    """The output passes its layout's verify and its index holds exactly the planned tensors.

    `elsewhere`: the data files (name -> size) that other ranks staged in folders of their own for an
    upload; they are checked against `metadata`'s records by their sizes instead of on disk.
    """
    layout = get_layout(Target.DCP)
    written = layout.open(out)
    problems = [
        p
        for p in layout.verify(written)
        if p.severity == "error" and not (p.kind is ProblemKind.MISSING_FILE and p.path in elsewhere)
    ]
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    short = sorted(name for name, size in elsewhere.items() if ends.get(name, 0) > size)
    if problems or short:
        first = problems[0].message if problems else f"{short[0]} is shorter than its records"
        raise CorruptCheckpoint(f"the DCP output fails verification: {first}", "this is a bug in ckptctl")
    stored = {entry.name: (entry.dtype, entry.shape) for entry in written.tensors()}
    want = {f"{DCP_NAMESPACE}.{p.name}": (p.dtype, p.shape) for p in plan}
    if stored != want:
        raise CorruptCheckpoint("the DCP output does not hold what was planned", "this is a bug in ckptctl")
