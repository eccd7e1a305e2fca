"""torch DCP, loaded by torch itself.

- single process (`build_single`): `torch/distributed/checkpoint/state_dict_loader.py: load` with no process
  group, in place into `tests.writers.dcp_writer.sample_state_dict()` (the state dict the writer saved), its
  tensors zeroed first so that a skipped entry shows.
- 2-rank FSDP2 (`build_fsdp`): the demo's plain `dcp.save` of `get_state_dict(model, optimizer)`, loaded as
  its writer would resume: on 2 gloo ranks, the demo's TinyLM under `fully_shard`, `get_state_dict`,
  `dcp.load`, then `torch/distributed/checkpoint/state_dict.py: set_state_dict`; each rank's local shards
  compared, the verdicts of both ranks merged (the first not `ok`). One process group for every cell.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.faults.cells import loader_verdicts
from tests.faults.loaders.common import Load, judge, load_capturing, local_shards, without_path


def load_single(path: str, options: Mapping[str, Any]) -> Any:
    import torch
    import torch.distributed.checkpoint as dcp

    from tests.writers.dcp_writer import sample_state_dict

    state = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sample_state_dict().items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*process group.*")  # "loading in non-distributed mode"
        dcp.load(state, checkpoint_id=path)
    return state


def load_fsdp(path: str, options: Mapping[str, Any]) -> Any:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from ckptctl.demo import _model

    torch.manual_seed(1234)  # other weights than the saved ones: a skipped tensor shows
    model = _model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": local_shards(model_sd), "optim": local_shards(optim_sd)}


def _rank(rank: int, spec_path: str, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        spec = json.loads(Path(spec_path).read_text())
        load: Load = load_fsdp
        reference, said = load_capturing(load, spec["reference"], {})
        known = {without_path(m, spec["reference"]) for m in said}
        mine = {c["id"]: judge(load, c["path"], {}, reference, known) for c in spec["cells"]}
        both: list[Any] = [None, None]
        dist.all_gather_object(both, mine)
        if rank == 0:
            verdicts = {"reference": "ok"}
            for cell in spec["cells"]:
                said_by = [f"rank {r}: {both[r][cell['id']]}" for r in (0, 1) if both[r][cell["id"]] != "ok"]
                verdicts[cell["id"]] = said_by[0].split(": ", 1)[1] if said_by else "ok"
            Path(spec["out"]).write_text(json.dumps(verdicts, indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def build_single(checkpoint: Path, _out: Path) -> dict[str, str]:
    """`dcp.load`'s verdict on each cell of a single-process DCP save of `sample_state_dict()`."""
    return loader_verdicts(__name__, checkpoint, mode="single")


def build_fsdp(checkpoint: Path, _out: Path) -> dict[str, str]:
    """`dcp.load` + `set_state_dict`'s verdict, on 2 FSDP2 ranks, on each cell of the demo's `dcp/step-N`."""
    return loader_verdicts(__name__, checkpoint, mode="fsdp")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec["options"]["mode"] == "single":
        from tests.faults.loaders.common import run

        run(load_single)
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Forked: this process has only imported modules and read the spec (no thread, no tensor op yet), so its
    # ranks start with torch imported rather than importing it again each.
    mp.start_processes(_rank, args=(sys.argv[1], port), nprocs=2, join=True, start_method="fork")


if __name__ == "__main__":
    main()
