"""A real verl FSDP run folder, written by verl's own checkpoint manager (verl 0.9.1) on 2 gloo CPU ranks.

`write_verl_run` spawns 2 ranks (torch.multiprocessing, gloo) that do per global step what verl's PPO trainer
does around its saves (`verl/trainer/ppo/ray_trainer.py`, `RayPPOTrainer._save_checkpoint`):

- the actor (a tiny local Qwen2 causal LM) sharded by FSDP2 (`fully_shard` per decoder layer, then the whole
  model, on a 1-D `("fsdp",)` mesh: every parameter a DTensor `Shard(0)`), and the critic (the same Qwen2 as
  `Qwen2ForTokenClassification` with one label, what verl's critic loads) on verl's HSDP mesh
  `("ddp", "fsdp")` of shape (2, 1) (`fsdp_size=1`): every parameter `(Replicate(), Shard(0))`, whole on
  each rank;
- one optimizer step each (AdamW, a LambdaLR schedule) so that weights and optimizer states moved;
- `verl.utils.checkpoint.fsdp_checkpoint_manager.FSDPCheckpointManager.save_checkpoint` into
  `global_step_{N}/actor` and `global_step_{N}/critic` (per-rank `model_/optim_/extra_state_world_size_2_rank_R.pt`,
  `huggingface/` config + tokenizer, `fsdp_config.json` last), unmodified;
- then, on rank 0, what `_save_checkpoint` does after the workers: `torch.save` of the data loader's state to
  `global_step_{N}/data.pt` and the tracker `latest_checkpointed_iteration.txt` written with a plain `write`.

Two steps are saved (1 and 2). Rank 0 then runs verl's own merger (`verl.model_merger.fsdp_model_merger.
FSDPModelMerger.merge_and_save`, what `python -m verl.model_merger merge --backend fsdp` runs) on the last
actor and critic saves: its output folders are the references conversions are compared with.

What is not verl's own, and why:
- Stand-in modules for imports verl's modules make that are not installed here and that these save paths never
  call (`ray`, `tensordict`, `codetiming`, `omegaconf`, ...: cluster, data-protocol and config libraries),
  served only to imports made by verl's own modules (`tests.writers.verl_ranks`, with verl's rank setup).
- The data loader state: verl saves `StatefulDataLoader.state_dict()` (torchdata, not installed); it is
  written here in that method's shape for a single-process loader (pytorch/data
  `torchdata/stateful_dataloader/stateful_dataloader.py`, `_StatefulSingleProcessDataLoaderIter.state_dict`).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.writers.ranks import run_ranks
from tests.writers.verl_ranks import join_verl_ranks

__all__ = ["STEPS", "WORLD_SIZE", "WrittenVerl", "write_verl_run"]

WORLD_SIZE = 2
#: Global steps saved (verl numbers them from 1).
STEPS = (1, 2)
VOCAB = 128
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class WrittenVerl:
    """What verl wrote.

    Attributes:
        run: `trainer.default_local_dir` (the `global_step_N/` folders and the tracker).
        base_model: the local model folder the actor and critic were built from.
        merged_actor: verl's own merger's HF folder of the last step's actor.
        merged_critic: verl's own merger's HF folder of the last step's critic.
        actor_parameters: elements of the actor's parameters.
        world_size: ranks.
        steps: the saved global steps.
    """

    run: Path
    base_model: Path
    merged_actor: Path
    merged_critic: Path
    actor_parameters: int
    world_size: int = WORLD_SIZE
    steps: tuple[int, ...] = STEPS

    def step(self, n: int) -> Path:
        return self.run / f"global_step_{n}"


# --------------------------------------------------------------------------------------------------
# One rank.
# --------------------------------------------------------------------------------------------------


def _dataloader_state(step: int) -> dict[str, Any]:
    """`StatefulDataLoader.state_dict()` of a single-process loader after `step` batches of 2."""
    return {
        "_index_sampler_state": {"samples_yielded": 2 * step},
        "_sampler_iter_state": None,
        "_sampler_iter_yielded": step,
        "_num_yielded": step,
        "_IterableDataset_len_called": None,
        "_shared_seed": None,
        "fetcher_state": None,
        "dataset_state": None,
        "_iterator_finished": False,
    }


def _rank(rank: int, port: int, root: str, base: str) -> None:
    join_verl_ranks(rank, WORLD_SIZE, port)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    tokenizer = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    critic = AutoModelForTokenClassification.from_pretrained(base, num_labels=1, torch_dtype=torch.float32)
    # verl's create_device_mesh (verl/workers/fsdp_workers.py): ("fsdp",) when fsdp_size covers the world,
    # else ("ddp", "fsdp") of shape (world // fsdp_size, fsdp_size).
    fsdp_mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("fsdp",))
    hsdp_mesh = init_device_mesh("cpu", (WORLD_SIZE, 1), mesh_dim_names=("ddp", "fsdp"))
    models = {}
    for role, model, mesh in (("actor", actor, fsdp_mesh), ("critic", critic, hsdp_mesh)):
        # verl's apply_fsdp2 (verl/utils/fsdp_utils.py): each decoder layer, then the root module.
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        manager = FSDPCheckpointManager(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            processing_class=tokenizer,
            checkpoint_config={"save_contents": ["model", "optimizer", "extra"]},
        )
        models[role] = (model, optimizer, scheduler, manager)

    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    for step in STEPS:
        for model, optimizer, scheduler, _ in models.values():
            model(input_ids=ids).logits.float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        folder = os.path.join(root, "run", f"global_step_{step}")
        for role, (_, _, _, manager) in models.items():
            manager.save_checkpoint(os.path.join(folder, role), None, step, max_ckpt_to_keep=None)
        if rank == 0:  # RayPPOTrainer._save_checkpoint, after the workers' saves
            torch.save(_dataloader_state(step), os.path.join(folder, "data.pt"))
            with open(os.path.join(root, "run", TRACKER), "w") as f:
                f.write(str(step))
        dist.barrier()

    if rank == 0:
        from verl.model_merger.base_model_merger import ModelMergerConfig
        from verl.model_merger.fsdp_model_merger import FSDPModelMerger

        last = os.path.join(root, "run", f"global_step_{STEPS[-1]}")
        for role in ("actor", "critic"):
            config = ModelMergerConfig(
                operation="merge",
                backend="fsdp",
                local_dir=os.path.join(last, role),
                target_dir=os.path.join(root, f"merged_{role}"),
                hf_model_config_path=os.path.join(last, role, "huggingface"),
            )
            FSDPModelMerger(config).merge_and_save()
    dist.barrier()
    dist.destroy_process_group()


def _base_model(folder: Path) -> int:
    """A tiny Qwen2 (the family verl's examples train) and a word-level tokenizer, built locally."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1234)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", eos_token="w1", pad_token="w2").save_pretrained(
        folder
    )
    return sum(p.numel() for p in model.parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_verl_run(root: Path) -> WrittenVerl:
    """Run verl's saves for `STEPS` on `WORLD_SIZE` spawned CPU ranks into `root` (see the module docstring)."""
    root.mkdir(parents=True, exist_ok=True)
    parameters = _base_model(root / "base")
    run_ranks(_rank, (_free_port(), str(root), str(root / "base")), WORLD_SIZE)
    written = WrittenVerl(
        run=root / "run",
        base_model=root / "base",
        merged_actor=root / "merged_actor",
        merged_critic=root / "merged_critic",
        actor_parameters=parameters,
    )
    (root / "written.json").write_text(json.dumps({"steps": list(STEPS)}))
    return written
