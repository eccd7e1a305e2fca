"""A DCP folder loaded by torch's own multi-rank load: `dcp.load` into the suite's tiny Llama sharded with FSDP2
over 2 gloo CPU ranks (forked from the pre-imported server of `tests.writers.ranks`, one process group), as a
training job resuming from it would.

`dcp_load_on_ranks` returns the full tensors the ranks hold after the load (DTensors gathered with
`full_tensor`), written by rank 0 to a safetensors file: what the test compares with its reference.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["dcp_load_on_ranks"]


def _load_worker(rank: int, world_size: int, rendezvous: str, folder: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from tests.writers.models import fully_sharded, tiny_llama
    from tests.writers.ranks import join_gloo

    join_gloo(rank, world_size, rendezvous=rendezvous)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        model = fully_sharded(tiny_llama(), mesh)
        with torch.no_grad():  # zeros: a tensor the load leaves alone shows up as zeros, not as the seed's values
            for tensor in model.state_dict().values():
                tensor.zero_()
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=folder)  # strict: every key of the state dict must be in the folder
        full = {
            name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone().contiguous()
            for name, tensor in model.state_dict().items()
        }
        if rank == 0:
            save_file(full, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def dcp_load_on_ranks(folder: Path, work: Path, world_size: int = 2) -> dict[str, torch.Tensor]:
    """The full tensors of the tiny Llama after `dcp.load` of `folder` on `world_size` FSDP2 ranks."""
    from safetensors.torch import load_file

    from tests.writers.ranks import run_ranks

    work.mkdir(parents=True, exist_ok=True)
    rendezvous, out = work / ".rendezvous-dcp-load", work / "loaded.safetensors"
    rendezvous.unlink(missing_ok=True)
    run_ranks(_load_worker, (world_size, str(rendezvous), str(folder), str(out)), world_size)
    rendezvous.unlink(missing_ok=True)
    return load_file(str(out))
