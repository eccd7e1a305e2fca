"""ByteCheckpoint 0.0.2's own `bcp.save` on 2 gloo CPU ranks (LAYOUTS.md, ByteCheckpoint).

A tiny transformers Llama (`tests.writers.models.tiny_llama`) sharded with FSDP2 `fully_shard` (each decoder
layer, then the whole model), AdamW, and per step what a training loop with ByteCheckpoint does: a step, then
`bcp.save(run, {"model": model, "optimizer": optimizer, "extra_state": {...}}, framework="fsdp2",
fast_saving=True, global_steps=N)`, which writes `run/global_step_N/{model,optimizer,extra_state}/` and, once
every rank's files are written (its gRPC coordinator gathers them), rank 0's `latest_checkpointed_iteration.txt`.
Steps 1 and 2. With `fast_saving` the files are written in the background: rank 0 waits for the tracker to
name the step before the ranks go on, as a trainer that saves again would.

Roles: the same model saved with `role="actor"` and `role="critic"` into `roles/global_step_1/{actor,critic}/`
(synchronously, without `global_steps`: a multi-role trainer names the step folder itself), the layout
verl-style trainers keep.

References: the full model and optimizer state rank 0 had at step 2 (`get_model_state_dict` with
`full_state_dict=True`), and ByteCheckpoint's own merge of step 2's model
(`bytecheckpoint.utilities.ckpt_format.merge_tool.bytecheckpoint_ckpt_to_pytorch_ckpt`, what its
`scripts/merge_bcp.py` runs), both as safetensors.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from tests.writers.ranks import join_gloo, run_ranks

__all__ = ["STEPS", "WORLD_SIZE", "WrittenBytecheckpoint", "write_bytecheckpoint_run"]

WORLD_SIZE = 2
STEPS = (1, 2)
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class WrittenBytecheckpoint:
    """What ByteCheckpoint wrote.

    Attributes:
        run: the save path: `global_step_1/`, `global_step_2/` and the tracker.
        roles: a folder holding `global_step_1/{actor,critic}/`.
        config: a folder with the model's `config.json` (what `convert --config` is given).
        reference: safetensors of the full state at step 2: the model's keys as stored, and the optimizer's
            under `optimizer.` (`state.<param>.exp_avg`, ...).
        merged: safetensors of ByteCheckpoint's own merge of step 2's model.
        model_parameters: elements of the model's parameters.
    """

    run: Path
    roles: Path
    config: Path
    reference: Path
    merged: Path
    model_parameters: int

    def step(self, n: int) -> Path:
        return self.run / f"global_step_{n}"


def _wait_for_tracker(run: str, step: int) -> None:
    tracker = Path(run) / TRACKER
    deadline = time.monotonic() + 300
    while not (tracker.exists() and tracker.read_text().strip() == str(step)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"ByteCheckpoint wrote no {TRACKER} for step {step}")
        time.sleep(0.05)


def _rank(rank: int, rendezvous: str, root: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1")
    # The merge reads the shard files in 16 worker processes by default (~40 s of CPU for a few KiB): one
    # worker takes its own in-process path, which merges the same shards with the same code.
    os.environ["BYTECHECKPOINT_MERGE_NUM_IO_WORKER"] = "1"
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.writers.dcp_writer import flatten
    from tests.writers.models import tiny_llama

    join_gloo(rank, WORLD_SIZE, rendezvous=rendezvous)
    import bytecheckpoint as bcp

    run = os.path.join(root, "run")
    model = tiny_llama()
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in STEPS:
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        extra = {"global_step": step, "rng": torch.get_rng_state()}
        state = {"model": model, "optimizer": optimizer, "extra_state": extra}
        bcp.save(run, state, framework="fsdp2", fast_saving=True, global_steps=step)
        if rank == 0:
            _wait_for_tracker(run, step)
        dist.barrier()

    for role in ("actor", "critic"):
        folder = os.path.join(root, "roles", "global_step_1", role)
        bcp.save(folder, {"model": model, "optimizer": optimizer}, framework="fsdp2", role=role)
    dist.barrier()

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_model = get_model_state_dict(model, options=options)
    full_optimizer = get_optimizer_state_dict(model, optimizer, options=options)
    if rank == 0:
        from bytecheckpoint.utilities.ckpt_format.merge_tool import bytecheckpoint_ckpt_to_pytorch_ckpt

        tensors = {k: v.contiguous() for k, v in full_model.items()}
        flat = flatten({"optimizer": full_optimizer})
        tensors.update({k: v.contiguous() for k, v in flat.items() if isinstance(v, torch.Tensor)})
        save_file(tensors, os.path.join(root, "reference.safetensors"))
        merged = bytecheckpoint_ckpt_to_pytorch_ckpt(
            os.path.join(run, f"global_step_{STEPS[-1]}"),
            os.path.join(root, "merge_bcp"),
            framework="fsdp2",
            model_only=True,
            return_dict=True,
        )["model"]
        save_file({k: v.contiguous() for k, v in merged.items()}, os.path.join(root, "merged.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


def write_bytecheckpoint_run(root: Path) -> WrittenBytecheckpoint:
    """Run ByteCheckpoint's saves on `WORLD_SIZE` spawned CPU ranks into `root` (see the module docstring)."""
    from tests.writers.models import tiny_llama

    root.mkdir(parents=True, exist_ok=True)
    model = tiny_llama()
    model.config.architectures = ["LlamaForCausalLM"]  # what save_pretrained records
    model.config.save_pretrained(root / "config")
    rendezvous = root / ".rendezvous"
    run_ranks(_rank, (str(rendezvous), str(root)), WORLD_SIZE)
    rendezvous.unlink(missing_ok=True)
    parameters = sum(p.numel() for p in model.parameters())
    (root / "written.json").write_text(json.dumps({"parameters": parameters}))
    return WrittenBytecheckpoint(
        run=root / "run",
        roles=root / "roles",
        config=root / "config",
        reference=root / "reference.safetensors",
        merged=root / "merged.safetensors",
        model_parameters=parameters,
    )
