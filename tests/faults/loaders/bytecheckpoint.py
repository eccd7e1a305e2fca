"""ByteCheckpoint 0.0.2's own `bcp.load` of a `global_step_N/` folder, on the 2 gloo CPU ranks it was saved on.

What a training loop with ByteCheckpoint does on resume (`bytecheckpoint/api/load.py: load` ->
`bytecheckpoint/checkpointer/fsdp2_checkpointer.py: FSDP2Checkpointer.load`): the tiny Llama under FSDP2 as
`tests.writers.bytecheckpoint_writer` builds it, AdamW, and `bcp.load(path, {"model": model, "optimizer":
optimizer, "extra_state": {}}, framework="fsdp2")`: `model/` and `optimizer/` (DCP folders) into the model and
optimizer, `extra_state/extra_state_rank_R.pt` into the dict (rank 0's file when the rank's own is missing:
`FSDP2Checkpointer.load`, "does not guarantee extra_state reshard correctness"). Each rank compares its own
shards, its optimizer state and its extra state.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.faults.cells import loader_verdicts
from tests.faults.loaders.common import local_shards
from tests.faults.loaders.ranks import TIMEOUT, run_ranks
from tests.writers.ranks import join_gloo, torchrun_variables

WORLD = 2


def join(rank: int, world: int, port: int) -> None:
    torchrun_variables(rank, world, port)
    # ByteCheckpoint 0.0.2 reads extra_state files with a bare `torch.load(file_path)`
    # (bytecheckpoint/engine/load_engine.py: load_loader_extra_state), which torch >= 2.6 runs with
    # weights_only=True and which then refuses the file its own save wrote (pickle protocol 4's FRAME opcode):
    # torch's documented switch back to the old default is what a ByteCheckpoint user sets.
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    join_gloo(rank, world, port=port, timeout=TIMEOUT)
    import bytecheckpoint  # noqa: F401


def load(path: str, options: Mapping[str, Any]) -> Any:
    import bytecheckpoint as bcp
    import torch
    from bytecheckpoint.engine import _load_engine
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.writers.models import tiny_llama

    # A training process loads once; this one loads every cell with the same ByteCheckpoint load engine, which
    # would re-raise the failed read of the previous cell in its next load (bytecheckpoint/engine/
    # base_engine.py: `sync_io_futures` waits for "the last load event"): each load starts without one.
    _load_engine._io_futures = dict.fromkeys(_load_engine._io_futures)
    mesh = init_device_mesh("cpu", (WORLD,))  # per load: the group may be new (tests.faults.loaders.ranks)
    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "extra_state": {}}
    bcp.load(path, state, framework="fsdp2")
    return {
        "model": local_shards(model.state_dict()),
        "optimizer": local_shards(optimizer.state_dict()),
        "extra_state": state["extra_state"],
    }


def build(checkpoint: Path, _out: Path) -> dict[str, str]:
    """ByteCheckpoint's verdict on each cell of a `global_step_N/` of the 2-rank run."""
    return loader_verdicts(__name__, checkpoint, loggers=["bytecheckpoint"])


if __name__ == "__main__":
    run_ranks("tests.faults.loaders.bytecheckpoint", WORLD, sys.argv[1])
