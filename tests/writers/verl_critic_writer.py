"""A verl FSDP1 critic saved by verl 0.9.1's own checkpoint manager on 2 gloo CPU ranks.

verl's FSDP workers (`strategy=fsdp`) wrap the critic with FSDP1 (`FullyShardedDataParallel` on a device mesh,
`use_orig_params`), the model being what `load_valuehead_model` (verl/utils/model.py) loads for a
`value_model`: `AutoModelForTokenClassification.from_pretrained(path, num_labels=1)`. Each rank here does that
with the tiny local Qwen2 of `tests.writers.verl_writer`, then the save of `RayPPOTrainer._save_checkpoint`
for the critic: `FSDPCheckpointManager.save_checkpoint` into `global_step_1/critic/` (per-rank
`model_/optim_/extra_state_world_size_2_rank_R.pt` of FSDP1's sharded state dict, `huggingface/` with the
config the critic was loaded with, which names `Qwen2ForCausalLM`, and `fsdp_config.json` saying
`FSDP_version` 1). Before saving, the ranks run the wrapped critic on fixed token ids and rank 0 records its
values (`values.safetensors`), which a converted critic must reproduce. The modules verl imports that are not
installed are stood in for as in `tests.writers.verl_writer`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tests.writers.ranks import run_ranks
from tests.writers.verl_ranks import join_verl_ranks
from tests.writers.verl_writer import _base_model, _free_port

__all__ = ["TOKEN_IDS", "WORLD_SIZE", "WrittenVerlCritic", "write_verl_critic"]

WORLD_SIZE = 2
#: The token ids the critic's values are recorded on (inside the tiny vocabulary).
TOKEN_IDS = tuple(range(3, 19))


@dataclass(frozen=True)
class WrittenVerlCritic:
    """What verl wrote.

    Attributes:
        run: `trainer.default_local_dir`, holding `global_step_1/critic/`.
        values: `values.safetensors`: `values` [1, len(TOKEN_IDS), 1], the critic's outputs (float32).
    """

    run: Path
    values: Path

    @property
    def critic(self) -> Path:
        return self.run / "global_step_1" / "critic"


def _rank(rank: int, port: int, root: str, base: str) -> None:
    join_verl_ranks(rank, WORLD_SIZE, port)
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel
    from transformers import AutoModelForTokenClassification, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    tokenizer = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(0)  # the head transformers initialises is the same on both ranks
    critic = AutoModelForTokenClassification.from_pretrained(base, num_labels=1, torch_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("fsdp",))
    model = FullyShardedDataParallel(critic, device_mesh=mesh, use_orig_params=True, device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with torch.no_grad():
        values = model(input_ids=torch.tensor([TOKEN_IDS])).logits
    if rank == 0:
        save_file({"values": values.float().contiguous()}, os.path.join(root, "values.safetensors"))
    manager = FSDPCheckpointManager(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        processing_class=tokenizer,
        checkpoint_config={"save_contents": ["model", "optimizer", "extra"]},
    )
    manager.save_checkpoint(os.path.join(root, "run", "global_step_1", "critic"), None, 1, max_ckpt_to_keep=None)
    dist.barrier()
    dist.destroy_process_group()


def write_verl_critic(root: Path) -> WrittenVerlCritic:
    """Run verl's FSDP1 critic save on `WORLD_SIZE` spawned CPU ranks into `root` (see the module docstring)."""
    root.mkdir(parents=True, exist_ok=True)
    _base_model(root / "base")
    run_ranks(_rank, (_free_port(), str(root), str(root / "base")), WORLD_SIZE)
    return WrittenVerlCritic(run=root / "run", values=root / "values.safetensors")
