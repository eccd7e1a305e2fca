"""A real FSDP2 DCP checkpoint of a tiny transformers Llama, written by torch itself on 2 gloo ranks.

Each rank builds the model with `tests.writers.models.tiny_llama()` (same seed, same weights), shards every
decoder layer and the root with `fully_shard`, takes one AdamW step, and saves `{"model": ..., "optim":
...}` from `get_state_dict` with `dcp.save`, as torchtitan-style trainers do. Rank 0 also gathers the full
model state dict (`full_state_dict=True, cpu_offload=True`) into a safetensors reference (written by the
safetensors package), and saves `config.json` + `generation_config.json` in the run folder, where
trainers usually keep them.

The same ranks also save `tp-1`: tensor-parallel style DTensors sharded along dim 1 and dim 2 (column
shards, whose rows are scattered through the full tensor), with their full values as a second reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.writers.ranks import run_ranks

__all__ = ["WrittenLlamaDcp", "write_llama_fsdp_dcp"]


@dataclass(frozen=True)
class WrittenLlamaDcp:
    """The checkpoint, its run folder and the full model state dict it must convert to."""

    run: Path
    path: Path
    reference: Path
    tp_path: Path
    tp_reference: Path

    def reference_tensors(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.reference))


def _tp_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {
        "col": torch.randn(16, 256, generator=generator),  # Shard(1): 16 runs of 512 bytes per rank
        "mid": torch.randn(4, 6, 64, generator=generator),  # Shard(1) of a 3-d tensor
        "last": torch.randn(4, 6, 10, generator=generator),  # Shard(2): 20-byte runs
    }


def _worker(
    rank: int, world_size: int, rendezvous: str, run: str, path: str, reference: str, tp_path: str, tp_reference: str
) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.writers.models import fully_sharded, tiny_llama
    from tests.writers.ranks import join_gloo

    join_gloo(rank, world_size, rendezvous=rendezvous)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        model = fully_sharded(tiny_llama(), mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(100 + rank)
        tokens = torch.randint(0, model.config.vocab_size, (2, 16))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        tp_full = _tp_tensors()
        dims = {"col": 1, "mid": 1, "last": 2}
        tp = {name: distribute_tensor(t, mesh, [Shard(dims[name])]) for name, t in tp_full.items()}
        dcp.save({"model": tp}, checkpoint_id=tp_path)
        if rank == 0:
            from safetensors.torch import save_file

            save_file({k: v.detach().clone().contiguous() for k, v in full.items()}, reference)
            model.config.save_pretrained(run)
            model.generation_config.save_pretrained(run)
            save_file(tp_full, tp_reference)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write_llama_fsdp_dcp(root: Path, world_size: int = 2) -> WrittenLlamaDcp:
    """Write `root/run/step-1` (the DCP checkpoint), `root/run/config.json`, `root/tp-1` and the references.

    Takes a few seconds (each rank imports torch and transformers); use it from a session-scoped fixture.
    """
    run = root / "run"
    run.mkdir(parents=True, exist_ok=True)
    path = run / "step-1"
    reference = root / "reference.safetensors"
    tp_path = root / "tp-1"
    tp_reference = root / "tp-reference.safetensors"
    rendezvous = root / ".rendezvous"
    args = (world_size, str(rendezvous), str(run), str(path), str(reference), str(tp_path), str(tp_reference))
    run_ranks(_worker, args, world_size)
    rendezvous.unlink(missing_ok=True)
    return WrittenLlamaDcp(run, path, reference, tp_path, tp_reference)
