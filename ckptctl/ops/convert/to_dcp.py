"""`convert --to dcp` (from an HF folder, for resuming from a published model): one
`torch.distributed.checkpoint.save` without a process group, keys `model.<name>`, which `dcp.load` reshards
onto any world size. A tied copy the HF folder leaves out (`lm_head.weight`) is in the plan as a key of its
own (`model_check.apply_ties`): `dcp.load({"model": model.state_dict()})` asks for every key.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint
from ckptctl.errors import CorruptCheckpoint
from ckptctl.layouts import get_layout
from ckptctl.ops.convert.options import Target
from ckptctl.ops.convert.plan import Planned, Written, read_planned
from ckptctl.ops.report import Progress

#: The key namespace of a `--to dcp` save: `{"model": state_dict}` as training loops save and load it.
DCP_NAMESPACE = "model"


def write_dcp(checkpoint: Checkpoint, plan: list[Planned], out: str, progress: Progress) -> Written:
    """One `dcp.save({"model": ...})` without a process group, checked against the plan.

    Whole tensors stored raw in local files (HF folders, ckptctl's own safetensors) are memory-mapped, not copied.
    """
    import torch.distributed.checkpoint as dcp

    total = sum(p.nbytes for p in plan)
    progress.start("writing DCP", total)
    assembled = 0
    with contextlib.ExitStack() as stack:
        state: dict[str, Any] = {}
        maps: dict[str, Any] = {}
        for planned in plan:
            tensor = _mapped_tensor(checkpoint.url, planned, maps, stack)
            if tensor is None:
                tensor = read_planned(checkpoint.url, planned)
                assembled += 1
            state[planned.name] = tensor
        writer = dcp.FileSystemWriter(out, single_file_per_rank=True, sync_files=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "saving in non-distributed mode"
            dcp.save({DCP_NAMESPACE: state}, storage_writer=writer, no_dist=True)
        state.clear()
    progress.advance(total)
    progress.finish()
    _check_dcp_output(out, plan)
    return Written(0, assembled, {})


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
    tensor = flat.view(entry.shape)
    return tensor.to(getattr(torch, planned.dtype)) if planned.dtype != entry.dtype else tensor


def _close_quietly(mapped: Any) -> None:
    with contextlib.suppress(BufferError):  # a tensor still refers to it: the collector unmaps it later
        mapped.close()


def _check_dcp_output(out: str, plan: list[Planned]) -> None:
    """The output passes its layout's verify and its index holds exactly the planned tensors."""
    layout = get_layout(Target.DCP)
    written = layout.open(out)
    problems = [p for p in layout.verify(written) if p.severity == "error"]
    if problems:
        raise CorruptCheckpoint(f"the DCP output fails verification: {problems[0].message}", "this is a bug in ckptctl")
    stored = {entry.name: (entry.dtype, entry.shape) for entry in written.tensors()}
    want = {f"{DCP_NAMESPACE}.{p.name}": (p.dtype, p.shape) for p in plan}
    if stored != want:
        raise CorruptCheckpoint("the DCP output does not hold what was planned", "this is a bug in ckptctl")
