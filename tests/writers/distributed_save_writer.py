"""Per-rank saves without a global index, written by transformers 5.24 and torch 2.13 themselves on 2 CPU ranks.

`write_distributed_saves` saves the tiny Llama of `tests.writers.models` (`src/`, whose `model.safetensors` is the
reference), then spawns 2 ranks (torch.multiprocessing, gloo) that load it with
`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))` (transformers' own FSDP2 sharding,
on a CPU mesh) and save it twice:

- `hf-distributed/`: `model.save_pretrained(dir, distributed_checkpoint=True)`: `config.json`,
  `generation_config.json`, and per rank `shard-{rank+1:05d}-model-00001-of-00001.safetensors` written by
  torch's `HuggingFaceStorageWriter(save_distributed=True)`, each tensor's place in the full tensor in the
  `DCP_SHARDING_INFO` header metadata; no index, no global shapes.
- `dcp-no-collectives/`: `dcp.save({"model": get_model_state_dict(model)}, use_collectives=False)`: every
  rank writes its data and its own `__{rank}.metadata`, and nobody writes `.metadata`.

(`dcp.save(..., no_dist=True)` is not such a variant: it writes the usual `.metadata`.)
"""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.writers.ranks import run_ranks

__all__ = ["WORLD_SIZE", "WrittenDistributedSaves", "write_distributed_saves"]

WORLD_SIZE = 2


@dataclass(frozen=True)
class WrittenDistributedSaves:
    """The two per-rank saves of the same model.

    Attributes:
        hf: the `save_pretrained(distributed_checkpoint=True)` folder.
        dcp: the `dcp.save(..., use_collectives=False)` folder.
        source: the model folder both were loaded from (`model.safetensors` holds the reference weights).
        model_parameters: elements of the model's parameters.
    """

    hf: Path
    dcp: Path
    source: Path
    model_parameters: int

    def reference(self) -> dict[str, Any]:
        from safetensors.torch import load_file

        return load_file(str(self.source / "model.safetensors"))


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_WORLD_SIZE=str(WORLD_SIZE),
    )
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.utils import logging

    logging.disable_progress_bar()
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(
        os.path.join(root, "src"), distributed_config=DistributedConfig(fsdp_size=WORLD_SIZE), device_map="cpu"
    )
    model.save_pretrained(os.path.join(root, "hf-distributed"), distributed_checkpoint=True)
    dcp.save(
        {"model": get_model_state_dict(model)},
        checkpoint_id=os.path.join(root, "dcp-no-collectives"),
        use_collectives=False,
    )
    dist.barrier()
    dist.destroy_process_group()


def write_distributed_saves(root: Path) -> WrittenDistributedSaves:
    """Save the tiny Llama, then spawn the 2 ranks that save it per rank (several seconds: each rank imports
    torch and transformers); use it from a session fixture."""
    from tests.writers.models import tiny_llama

    model = tiny_llama()
    model.save_pretrained(root / "src")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_ranks(_worker, (port, str(root)), WORLD_SIZE)
    return WrittenDistributedSaves(
        root / "hf-distributed",
        root / "dcp-no-collectives",
        root / "src",
        sum(p.numel() for p in model.parameters()),
    )
