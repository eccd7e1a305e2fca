"""verl FSDP1 saves (`strategy=fsdp`, verl's default) written by verl 0.9.1's own `FSDPCheckpointManager`, and
the same manager's `load_checkpoint` taking what ckptctl's verl training-state writer
(`ckptctl.frameworks.verl.reshard.WRITER`) made of them for another world size, on gloo CPU ranks.

The actor (the tiny Qwen2 of `tests.writers.verl_writer` as a causal LM) and the critic (the same as
`...ForTokenClassification` with one label) are wrapped as verl's `_build_fsdp_module` (verl/workers/engine/fsdp/
transformer_impl.py) wraps them for `strategy=fsdp`: `FullyShardedDataParallel` with verl's own
`get_fsdp_wrap_policy` (one unit per decoder layer, the root holding the embeddings, the final norm and the head),
`FULL_SHARD` on a 1-D `("fsdp",)` mesh (`get_sharding_strategy`), `use_orig_params=False` (verl's default). Not
as verl: no `sync_module_states` (it needs a GPU; every rank loads the same weights) and no mixed precision
(FSDP1 keeps and saves the fp32 FlatParameters either way).

`prove_verl_fsdp1_reshard` runs, in this order:

1. two ranks that train both roles for `STEPS` and save the last step with verl's `save_checkpoint` (a real 2-rank
   FSDP1 save: DTensor model files, FlatParameter optimizer files), the data loader's state and the tracker as
   `RayPPOTrainer._save_checkpoint` does, and record the full state they hold (`source_2`);
2. the writer on that step, for 1 rank;
3. one rank that trains and saves the same way (a real 1-rank save: FSDP1's `NO_SHARD`, every entry whole) and
   records `source_1`, then builds the roles afresh and loads (2), and records `loaded_1`;
4. the writer on the 1-rank step, for 3 ranks (FlatParameters of lengths 3 does not divide: FSDP1's padding);
5. three ranks that load (4) and record `loaded_3`.

A load finds its step as `RayPPOTrainer._load_checkpoint` does for `trainer.resume_mode=auto`: verl's own
`find_latest_ckpt_path` on the run folder (its tracker). A "full state" is what FSDP1's own `FULL_STATE_DICT`
gathers (`model.state_dict()` by name, `FSDP.optim_state_dict` by parameter name: torch's `get_model_state_dict`
fails on FSDP1 over CPU ranks, unsharding a freed FlatParameter), the LR scheduler's `state_dict()`, and each
rank's CPU RNG state after the load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.writers.ranks import run_ranks
from tests.writers.verl_ranks import join_verl_ranks
from tests.writers.verl_reshard_proof import ROLES, _free_port, _reshard
from tests.writers.verl_writer import STEPS, TRACKER, _base_model, _dataloader_state

__all__ = ["ROLES", "VerlFsdp1Proof", "prove_verl_fsdp1_reshard"]


@dataclass(frozen=True)
class VerlFsdp1Proof:
    """What the proof wrote.

    Attributes:
        runs: world size -> the real verl FSDP1 run folder saved on it (2 and 1).
        resharded: world size -> the writer's output for it (1: from the 2-rank run; 3: from the 1-rank run).
        written: world size -> what the writer returned.
        states: label -> the recorded full-state file (`source_2`, `source_1`, `loaded_1`, `loaded_3`);
            `{label}_rng_rank{r}.pt` beside each holds rank r's CPU RNG state after the load.
        found: label of each load -> the step folder verl's `find_latest_ckpt_path` gave it.
    """

    runs: dict[int, Path]
    resharded: dict[int, Path]
    written: dict[int, Any]
    states: dict[str, Path]
    found: dict[str, str]


def _models(base: str, world: int) -> dict[str, tuple[Any, Any, Any, Any]]:
    """The actor and critic wrapped as verl's FSDP1 workers wrap them (the module docstring), with verl's
    checkpoint manager each."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import get_fsdp_wrap_policy

    tokenizer = AutoTokenizer.from_pretrained(base)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    built = {}
    for role in ROLES:
        torch.manual_seed(0)  # the critic's head: the same on every rank
        if role == "actor":
            module = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        else:
            module = AutoModelForTokenClassification.from_pretrained(base, num_labels=1, torch_dtype=torch.float32)
        model = FullyShardedDataParallel(
            module,
            auto_wrap_policy=get_fsdp_wrap_policy(module, config=None),
            device_id=torch.device("cpu"),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            device_mesh=mesh,
            use_orig_params=False,
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        manager = FSDPCheckpointManager(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            processing_class=tokenizer,
            checkpoint_config={"save_contents": ["model", "optimizer", "extra"]},
        )
        built[role] = (model, optimizer, scheduler, manager)
    return built


def _record(models: dict[str, tuple[Any, Any, Any, Any]], out: Path, label: str, rank: int) -> None:
    """The full state of each role (the module docstring) on rank 0, and this rank's RNG state, into `out`."""
    import torch
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    states = {}
    for role, (model, optimizer, scheduler, _) in models.items():
        model_config = FullStateDictConfig(rank0_only=False)
        optim_config = FullOptimStateDictConfig(rank0_only=False)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, model_config, optim_config):
            states[role] = {
                "model": model.state_dict(),
                "optim": FSDP.optim_state_dict(model, optimizer),
                "lr_scheduler": scheduler.state_dict(),
            }
    if rank == 0:
        torch.save(states, out / f"{label}.pt")
    torch.save(torch.get_rng_state(), out / f"{label}_rng_rank{rank}.pt")


def _rank(rank: int, world: int, port: int, base: str, out: str, jobs: list[tuple[str, str, str]]) -> None:
    """Each job: (label, what, run folder): `train` trains and saves a real verl FSDP1 run there; `load` loads the
    step verl's `find_latest_ckpt_path` names in it; either records the full state under label."""
    import torch
    import torch.distributed as dist

    join_verl_ranks(rank, world, port)
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    for label, what, folder in jobs:
        models = _models(base, world)
        if what == "train":
            ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(rank))
            for _ in STEPS:
                for model, optimizer, scheduler, _ in models.values():
                    model(input_ids=ids).logits.float().pow(2).mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    scheduler.step()
            step = os.path.join(folder, f"global_step_{STEPS[-1]}")
            for role, (_, _, _, manager) in models.items():
                manager.save_checkpoint(os.path.join(step, role), None, STEPS[-1], max_ckpt_to_keep=None)
            if rank == 0:  # RayPPOTrainer._save_checkpoint, after the workers' saves
                torch.save(_dataloader_state(STEPS[-1]), os.path.join(step, "data.pt"))
                Path(folder, TRACKER).write_text(str(STEPS[-1]))
        else:
            step = find_latest_ckpt_path(folder)  # RayPPOTrainer._load_checkpoint, resume_mode=auto
            if rank == 0:
                Path(out, f"{label}_found.txt").write_text(str(step))
            for role, (_, _, _, manager) in models.items():
                manager.load_checkpoint(os.path.join(step, role))
        _record(models, Path(out), label, rank)
        dist.barrier()
    dist.destroy_process_group()


def _spawn(world: int, base: Path, out: Path, jobs: list[tuple[str, str, str]]) -> None:
    run_ranks(_rank, (world, _free_port(), str(base), str(out), jobs), world)


def prove_verl_fsdp1_reshard(root: Path) -> VerlFsdp1Proof:
    """Run the proof (the module docstring) into `root`."""
    root.mkdir(parents=True, exist_ok=True)
    base = root / "base"
    _base_model(base)
    states = root / "states"
    states.mkdir()
    last = f"global_step_{STEPS[-1]}"
    runs = {2: root / "run-2", 1: root / "run-1"}
    resharded = {1: root / "to-1", 3: root / "to-3"}
    _spawn(2, base, states, [("source_2", "train", str(runs[2]))])
    written = {1: _reshard(runs[2] / last, resharded[1], 1)}
    _spawn(1, base, states, [("source_1", "train", str(runs[1])), ("loaded_1", "load", str(resharded[1]))])
    written[3] = _reshard(runs[1] / last, resharded[3], 3)
    _spawn(3, base, states, [("loaded_3", "load", str(resharded[3]))])
    labels = ("source_2", "source_1", "loaded_1", "loaded_3")
    found = {label: (states / f"{label}_found.txt").read_text() for label in ("loaded_1", "loaded_3")}
    return VerlFsdp1Proof(runs, resharded, written, {label: states / f"{label}.pt" for label in labels}, found)
