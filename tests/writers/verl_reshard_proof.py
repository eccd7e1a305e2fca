"""verl 0.9.1's own `FSDPCheckpointManager.load_checkpoint` loading what ckptctl's verl training-state writer
(`ckptctl.frameworks.verl.reshard.WRITER`) wrote for another world size, on 1 and on 2 gloo CPU ranks.

`prove_verl_reshard` runs, in this order:

1. the writer on `global_step_2` of the 2-rank verl run (`tests.writers.verl_writer`), for 1 rank;
2. one spawned rank that trains the same actor and critic as the 2-rank run for its steps and saves them with
   verl's own `save_checkpoint` (a real 1-rank save), records their full state, then builds them afresh from
   the base model and loads (1) with verl's `load_checkpoint`, and records the full state it holds;
3. the writer on that 1-rank `global_step_2`, for 2 ranks;
4. two spawned ranks that load the original 2-rank `global_step_2` with verl's `load_checkpoint` and record
   the full state (the reference for (2)), then build the models afresh and load (3), and record it.

A "full state" is what torch's own `get_model_state_dict`/`get_optimizer_state_dict(full_state_dict=True)`
gather on rank 0 (model by name, optimizer by parameter name), the LR scheduler's `state_dict()`, and each
rank's CPU RNG state after the load. The meshes are verl's `create_device_mesh(world, fsdp_size)`'s with the
fsdp_size of each role that the writer's `resume_hint` names.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptctl.contract.capabilities import ReshardRequest, WrittenState
from ckptctl.frameworks.verl.reshard import WRITER
from ckptctl.layouts import open_checkpoint
from tests.writers.verl_ranks import join_verl_ranks
from tests.writers.verl_writer import STEPS, WrittenVerl

__all__ = ["FSDP_SIZES", "VerlReshardProof", "join_verl_ranks", "prove_verl_reshard"]

ROLES = ("actor", "critic")
#: The fsdp_size of each role on the loading side, by its world size and where its files come from: the
#: 2-rank run's (critic fsdp_size 1: an HSDP (2, 1) mesh); for files the writer cut from the 1-rank save's 1-D
#: meshes, the fsdp_size the writer's hint names (-1: the whole world).
FSDP_SIZES = {"verl": {"actor": -1, "critic": 1}, "resharded": {"actor": -1, "critic": -1}}


@dataclass(frozen=True)
class VerlReshardProof:
    """What the proof wrote.

    Attributes:
        to_one: the writer's output for 1 rank (from the 2-rank save) and what it returned.
        to_two: the writer's output for 2 ranks (from the 1-rank save) and what it returned.
        one_rank_run: the real 1-rank verl run folder.
        states: label -> the recorded full-state file (`source_1`, `loaded_1`, `source_2`, `loaded_2`);
            `{label}_rng_rank{r}.pt` beside each holds rank r's CPU RNG state after the load.
    """

    to_one: tuple[Path, WrittenState]
    to_two: tuple[Path, WrittenState]
    one_rank_run: Path
    states: dict[str, Path]


def _mesh(world: int, fsdp_size: int) -> Any:
    """verl's `create_device_mesh` (verl/workers/engine/fsdp/utils.py), on CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    if fsdp_size < 0 or fsdp_size >= world:
        return init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    return init_device_mesh("cpu", (world // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp"))


def _models(base: str, world: int, fsdp_sizes: dict[str, int]) -> dict[str, tuple[Any, Any, Any, Any]]:
    """The actor and critic as `tests.writers.verl_writer` builds them, with verl's checkpoint manager each."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    tokenizer = AutoTokenizer.from_pretrained(base)
    built = {}
    for role in ROLES:
        if role == "actor":
            model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        else:
            model = AutoModelForTokenClassification.from_pretrained(base, num_labels=1, torch_dtype=torch.float32)
        mesh = _mesh(world, fsdp_sizes[role])
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        manager = FSDPCheckpointManager(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, processing_class=tokenizer, checkpoint_config={}
        )
        built[role] = (model, optimizer, scheduler, manager)
    return built


def _record(models: dict[str, tuple[Any, Any, Any, Any]], out: Path, label: str, rank: int) -> None:
    """The full state of each role (gathered on rank 0) and this rank's RNG state, into `out`."""
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    states = {
        role: {
            "model": get_model_state_dict(model, options=options),
            "optim": get_optimizer_state_dict(model, optimizer, options=options),
            "lr_scheduler": scheduler.state_dict(),
        }
        for role, (model, optimizer, scheduler, _) in models.items()
    }
    if rank == 0:
        torch.save(states, out / f"{label}.pt")
    torch.save(torch.get_rng_state(), out / f"{label}_rng_rank{rank}.pt")


def _rank(rank: int, world: int, port: int, base: str, out: str, jobs: list[tuple[str, str, str]]) -> None:
    """Each job: (label, what, folder): `train` trains and saves a real verl run into folder; `load` loads the
    step folder's roles with verl; either records the full state under label."""
    import torch
    import torch.distributed as dist

    join_verl_ranks(rank, world, port)
    for label, what, folder in jobs:
        torch.manual_seed(0)
        if what == "train":  # tests.writers.verl_writer's steps, saved by verl at the last one
            models = _models(base, world, FSDP_SIZES["verl"])
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
            if rank == 0:
                torch.save({"_num_yielded": STEPS[-1]}, os.path.join(step, "data.pt"))
        else:
            models = _models(base, world, FSDP_SIZES["resharded" if what == "load-resharded" else "verl"])
            for role, (_, _, _, manager) in models.items():
                manager.load_checkpoint(os.path.join(folder, role))
        _record(models, Path(out), label, rank)
        dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(world: int, base: Path, out: Path, jobs: list[tuple[str, str, str]]) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(world, _free_port(), str(base), str(out), jobs), nprocs=world)


def _reshard(step: Path, staging: Path, world: int) -> WrittenState:
    staging.mkdir(parents=True)
    return WRITER.write(ReshardRequest(open_checkpoint(str(step)), str(staging), world), lambda _: None)


def prove_verl_reshard(root: Path, verl: WrittenVerl) -> VerlReshardProof:
    """Run the proof (the module docstring) into `root`."""
    root.mkdir(parents=True, exist_ok=True)
    states = root / "states"
    states.mkdir()
    last = f"global_step_{STEPS[-1]}"
    to_one = root / "to-1"
    written_one = _reshard(verl.step(STEPS[-1]), to_one, 1)
    one_rank_run = root / "run-1"
    _spawn(
        1, verl.base_model, states, [("source_1", "train", str(one_rank_run)), ("loaded_1", "load", str(to_one / last))]
    )
    to_two = root / "to-2"
    written_two = _reshard(one_rank_run / last, to_two, 2)
    _spawn(
        2,
        verl.base_model,
        states,
        [("source_2", "load", str(verl.step(STEPS[-1]))), ("loaded_2", "load-resharded", str(to_two / last))],
    )
    labels = ("source_1", "loaded_1", "source_2", "loaded_2")
    return VerlReshardProof(
        (to_one, written_one), (to_two, written_two), one_rank_run, {label: states / f"{label}.pt" for label in labels}
    )
