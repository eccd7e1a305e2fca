"""The proof of `reshard --to dcp` (`ckptctl.frameworks.dcp.reshard.WRITER`), on gloo CPU ranks.

1. 2 ranks train an FSDP2 model with AdamW (two parameter groups: decay and no decay, as trainers build them)
   for two steps and save, each by its own framework's code: `dcp.save` of `get_state_dict` (`dcp/`, with a
   `trainer_state` beside it) and ckptctl's `CheckpointManager` (`native/step-2`, with an LR scheduler).
2. This process reshards both into DCP folders (`out-dcp/`, `out-native/`) with the writer.
3. On 1 and on 2 ranks, fresh models load each source by its own resume (`dcp.load` + `set_state_dict`;
   `CheckpointManager.restore`) and each output by `dcp.load` + `set_state_dict`, gather their full state
   (`full_state_dict=True`) and take one training step on the same batch: `results-{W}.pt` holds, per case,
   the state and the step's losses (before and after the step).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.writers.dcp_writer import sharded_tiny_net
from tests.writers.trainer_resume_writer import STEPS, WEIGHT_DECAY

__all__ = [
    "CASES",
    "NEXT_STEP_SEED",
    "DcpReshardProof",
    "TrainerToDcpProof",
    "VerlToDcpProof",
    "adamw",
    "batch",
    "prove_dcp_reshard",
    "prove_trainer_to_dcp",
    "prove_verl_to_dcp",
]

#: The batch of the step each resumed case takes.
NEXT_STEP_SEED = 3
#: Each loaded case: (its name, the folder it loads from, how).
CASES = (
    ("source-dcp", "dcp", "dcp"),
    ("resharded-dcp", "out-dcp", "dcp"),
    ("source-native", "native", "native"),
    ("resharded-native", "out-native", "dcp"),
)


@dataclass(frozen=True)
class DcpReshardProof:
    root: Path
    written: dict[str, Any]

    def results(self, world_size: int) -> dict[str, Any]:
        return torch.load(self.root / f"results-{world_size}.pt", weights_only=True)  # written by the proof


def _model_and_optimizer(world_size: int) -> tuple[Any, Any]:
    model = sharded_tiny_net(world_size)
    return model, adamw(model)


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """The run's AdamW over `model` (sharded or not): two groups, decay (weights but norms') and no decay."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, betas=(0.8, 0.95)
    )


def batch(seed: int) -> torch.Tensor:
    """The batch of a training step, fixed by `seed` (the same on every rank)."""
    return torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(seed))


def _step(model: Any, optimizer: Any, seed: int) -> tuple[float, float]:
    """One training step on a batch fixed by `seed` (the same on every rank): the loss before and after it."""
    ids = batch(seed)
    loss = model(ids).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after = model(ids).square().mean()
    return float(loss), float(after)


def _train_worker(rank: int, world_size: int, rendezvous: str, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckptctl import CheckpointManager

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        model, optimizer = _model_and_optimizer(world_size)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for seed in (1, 2):
            _step(model, optimizer, seed)
            scheduler.step()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd, "trainer_state": {"step": 2}}, checkpoint_id=f"{root}/dcp")
        manager = CheckpointManager(f"{root}/native")
        manager.save(2, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
        manager.close()
    finally:
        dist.destroy_process_group()


def _load_worker(
    rank: int,
    world_size: int,
    rendezvous: str,
    root: str,
    cases: tuple[tuple[str, str, str], ...] = CASES,
    results_name: str = "results",
) -> None:
    """Loads each of `cases` (as `CASES`) on its own fresh model; rank 0 saves `results_name-{W}.pt`."""
    import torch.distributed as dist

    from ckptctl import CheckpointManager

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        results: dict[str, Any] = {}
        for name, folder, how in cases:
            model, optimizer = _model_and_optimizer(world_size)
            if how == "native":
                CheckpointManager(f"{root}/{folder}").restore({"model": model, "optimizer": optimizer}, step=2)
            else:
                _dcp_resume(model, optimizer, f"{root}/{folder}")
            model_sd, optim_sd = _full_state(model, optimizer)
            losses = _step(model, optimizer, NEXT_STEP_SEED)
            results[name] = {"model": model_sd, "optim": optim_sd, "losses": losses}
        if rank == 0:
            torch.save(results, f"{root}/{results_name}-{world_size}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _dcp_resume(model: Any, optimizer: Any, folder: str) -> None:
    """What an FSDP2 trainer resumes from a DCP folder with: `dcp.load` into `get_state_dict`, `set_state_dict`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _full_state(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full (gathered) model and optimizer state, copied."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=full)
    return _copy(model_sd), _copy(optim_sd)


def _copy(tree: Any) -> Any:
    """A full state dict with its tensors copied: on 1 rank `get_state_dict(full_state_dict=True)` hands out the
    live tensors, which the next step changes."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: _copy(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_copy(value) for value in tree]
    return tree


def _spawn(worker: Any, root: Path, world_size: int, *args: Any) -> None:
    import torch.multiprocessing as mp

    rendezvous = root / f".rendezvous-{worker.__name__}-{world_size}"
    rendezvous.unlink(missing_ok=True)
    mp.spawn(worker, args=(world_size, str(rendezvous), str(root), *args), nprocs=world_size)


def _write_dcp(source: Path, out: Path) -> dict[str, Any]:
    """Reshard `source` into the new folder `out` with the writer (which must not refuse it): what it reports."""
    from ckptctl.contract.capabilities import ReshardRequest
    from ckptctl.frameworks.dcp.reshard import WRITER
    from ckptctl.layouts import open_checkpoint

    checkpoint = open_checkpoint(str(source))
    assert WRITER.refusal(checkpoint, None) is None
    os.makedirs(out)
    state = WRITER.write(ReshardRequest(checkpoint, str(out), None), lambda _n: None)
    return {"files": state.files, "tensors": state.tensors, "not_carried": [(n.what, n.why) for n in state.not_carried]}


def prove_dcp_reshard(root: Path) -> DcpReshardProof:
    _spawn(_train_worker, root, 2)
    written = {
        source: _write_dcp(root / source, root / out)
        for source, out in (("dcp", "out-dcp"), ("native/step-2", "out-native"))
    }
    for world_size in (1, 2):
        _spawn(_load_worker, root, world_size)
    return DcpReshardProof(root, written)


# --------------------------------------------------------------------------------------------------
# verl -> DCP: verl 0.9.1's 2-rank FSDP2 save of the actor, resumed by verl on 2 ranks and, resharded, by
# dcp.load + set_state_dict on 1 and 2 ranks.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerlToDcpProof:
    root: Path
    written: dict[str, Any]

    def results(self, world_size: int) -> dict[str, Any]:
        return torch.load(self.root / f"verl-results-{world_size}.pt", weights_only=True)  # written by the proof


def _actor(base: str, world_size: int) -> tuple[Any, Any, Any]:
    """The actor as `tests.writers.verl_reshard_proof` builds it, with verl's checkpoint manager."""
    from tests.writers.verl_reshard_proof import _models

    model, optimizer, _, manager = _models(base, world_size, {"actor": -1, "critic": -1})["actor"]
    return model, optimizer, manager


def _verl_step(model: Any, optimizer: Any) -> tuple[float, float]:
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(99))
    loss = model(input_ids=ids).logits.float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after = model(input_ids=ids).logits.float().pow(2).mean()
    return float(loss), float(after)


def _verl_worker(rank: int, world_size: int, port: int, base: str, source: str, root: str) -> None:
    import torch.distributed as dist

    from tests.writers.verl_ranks import join_verl_ranks

    join_verl_ranks(rank, world_size, port)
    try:
        results: dict[str, Any] = {}
        for name in ("verl", "dcp") if world_size == 2 else ("dcp",):
            torch.manual_seed(0)
            model, optimizer, manager = _actor(base, world_size)
            if name == "verl":
                manager.load_checkpoint(source)
            else:
                _dcp_resume(model, optimizer, f"{root}/verl-out")
            model_sd, optim_sd = _full_state(model, optimizer)
            results[name] = {"model": model_sd, "optim": optim_sd, "losses": _verl_step(model, optimizer)}
        if rank == 0:
            torch.save(results, f"{root}/verl-results-{world_size}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def prove_verl_to_dcp(root: Path, base_model: Path, actor: Path) -> VerlToDcpProof:
    """Reshard verl's actor folder `actor` into `root/verl-out`, then resume it (the section comment)."""
    import torch.multiprocessing as mp

    from tests.writers.verl_reshard_proof import _free_port

    written = _write_dcp(actor, root / "verl-out")
    for world_size in (2, 1):
        args = (world_size, _free_port(), str(base_model), str(actor), str(root))
        mp.spawn(_verl_worker, args=args, nprocs=world_size)
    return VerlToDcpProof(root, written)


# --------------------------------------------------------------------------------------------------
# HF Trainer -> DCP: a Trainer `checkpoint-N` resharded, then loaded on 1 and 2 ranks by an FSDP2 model of the same
# transformers class with torch AdamW in the Trainer's groups (dcp.load + set_state_dict), which takes the steps the
# Trainer's own resume took (`tests.writers.trainer_resume_writer`): the same batches, loss as the Trainer computes
# it, gradients clipped to the Trainer's max_grad_norm (1.0), the learning rate the loaded groups hold, the LR
# scheduler (not carried) loaded from the checkpoint's scheduler.pt as the output's not_carried says.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerToDcpProof:
    """Per case (`untied`, `tied`), what the writer reported and what the FSDP2 ranks loaded and computed."""

    root: Path
    written: dict[str, dict[str, Any]]

    def results(self, case: str, world_size: int) -> dict[str, Any]:
        return torch.load(self.root / f"{case}-results-{world_size}.pt", weights_only=True)  # written by the proof


def _trainer_model_and_optimizer(checkpoint: str, world_size: int) -> tuple[Any, Any, Any]:
    """The model class the checkpoint's config.json names, sharded with FSDP2 (each decoder layer a unit), torch AdamW
    over the groups `Trainer.create_optimizer` makes (transformers' own decay names; the settings are the
    checkpoint's once loaded) and the Trainer's linear LR schedule. The scheduler is built before the load, as a
    trainer builds its objects and then loads: it sets each group's `initial_lr`, which the load then fills (DCP
    loads the settings the optimizer has, and `initial_lr` is the scheduler's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, get_linear_schedule_with_warmup

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = Trainer.__new__(Trainer).get_decay_parameter_names(model)
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": WEIGHT_DECAY},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups)
    return model, optimizer, get_linear_schedule_with_warmup(optimizer, 0, STEPS)


def _trainer_steps(model: Any, optimizer: Any, scheduler: Any, steps: list[dict[str, Any]]) -> list[Any]:
    """The loss and the groups' learning rates of each recorded step, taking each as the Trainer does (the last
    step's update is not needed)."""
    taken = []
    model.train()
    for k, step in enumerate(steps):
        loss = model(**step["inputs"], num_items_in_batch=step["num_items_in_batch"]).loss
        taken.append((float(loss), [group["lr"] for group in optimizer.param_groups]))
        if k + 1 < len(steps):
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return taken


def _trainer_worker(rank: int, world_size: int, rendezvous: str, root: str, *cases: str) -> None:
    """For each case (`name`, `checkpoint`, `record` in turn): resume the output, gather, take the recorded steps."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        for name, checkpoint, record in zip(cases[::3], cases[1::3], cases[2::3], strict=True):
            model, optimizer, scheduler = _trainer_model_and_optimizer(checkpoint, world_size)
            _dcp_resume(model, optimizer, f"{root}/{name}-out")
            scheduler.load_state_dict(torch.load(f"{checkpoint}/scheduler.pt", weights_only=True))
            model_sd, optim_sd = _full_state(model, optimizer)
            taken = _trainer_steps(model, optimizer, scheduler, torch.load(record, weights_only=True)["steps"])
            if rank == 0:
                results = {"model": model_sd, "optim": optim_sd, "steps": taken}
                torch.save(results, f"{root}/{name}-results-{world_size}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def prove_trainer_to_dcp(root: Path, runs: dict[str, tuple[Path, Path]]) -> TrainerToDcpProof:
    """Reshard each case's Trainer checkpoint (`runs`: name -> its checkpoint and the Trainer's resume record) into
    `root/<name>-out`, then resume them (the section comment)."""
    written = {name: _write_dcp(checkpoint, root / f"{name}-out") for name, (checkpoint, _) in runs.items()}
    cases = [str(value) for name, (checkpoint, record) in runs.items() for value in (name, checkpoint, record)]
    for world_size in (1, 2):
        _spawn(_trainer_worker, root, world_size, *cases)
    return TrainerToDcpProof(root, written)
