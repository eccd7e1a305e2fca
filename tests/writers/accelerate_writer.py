"""Real accelerate `save_state` folders for tests, written by accelerate 1.15 itself on CPU.

`write_accelerate_runs` runs one subprocess (accelerate's process-wide state and the seeds it sets stay
out of the test process; torch, transformers, accelerate and DeepSpeed are imported once for all three
runs) that trains the tiny Llama of `tests.writers.models` under `Accelerator.accumulate` and saves:

1. `plain/`: no plugin (`Accelerator(cpu=True)`), `ProjectConfiguration(automatic_checkpoint_naming=True)`,
   `save_state()` every 2 of 6 steps: `plain/checkpoints/checkpoint_{0,1,2}/` with `model.safetensors`,
   `optimizer.bin`, `scheduler.bin` and `random_states_0.pkl`. Then, with automatic naming switched off,
   `save_state("named/step_6", safe_serialization=False)`: a user-named folder with `pytorch_model.bin`.
   accelerate 1.15 writes `sampler.bin` only for an `IterableDatasetShard` data set (the guard of
   `accelerate/checkpointing.py:save_accelerator_state`, accelerate#3996), so the named folder also gets the
   one line that guard skips, run by accelerate's own `save(sampler, "sampler.bin")`.
2. `deepspeed/`: the DeepSpeed plugin, ZeRO-2, one gloo rank (`DS_ACCELERATOR=cpu`), automatic naming with
   `total_limit=2`, 3 saves: accelerate's own rotation deletes `checkpoint_0` before the third, leaving
   `checkpoint_{1,2}/`, each with the DeepSpeed tag `pytorch_model/` + `latest` (and DeepSpeed's
   `zero_to_fp32.py`), `scheduler.bin` and `random_states_0.pkl`.
3. `fsdp/step_2/`: accelerate's FSDP plugin needs a GPU device type for `Accelerator(...)`, so this run
   calls what `Accelerator.save_state` calls for `DistributedType.FSDP` (`accelerate/accelerator.py`
   `save_state`), accelerate's own functions on a real FSDP2 (`fully_shard`, CPU mesh) model:
   `accelerate/utils/fsdp_utils.py` `save_fsdp_model` and `save_fsdp_optimizer` with a
   `FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")` (DCP folders
   `pytorch_model_fsdp_0/` and `optimizer_0/`), then `accelerate/checkpointing.py` `save_accelerator_state`
   with no model weights and no optimizers, as `save_state` passes them under FSDP (`scheduler.bin`,
   `random_states_0.pkl`). The same save with `use_dcp=False` goes to `fsdp-no-dcp/step_2/`: per-process
   `pytorch_model_fsdp_0_rank0.bin` and `optimizer_0_rank0.bin` (save_state passes no `use_dcp`: these
   come from a loop that calls the two functions itself, as their docstrings suggest at scale).

Each run's final weights (the unwrapped model's, full) are written beside its folder as the reference
safetensors file.

Run directly: `python -m tests.writers.accelerate_writer OUT_DIR`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.writers.ranks import run_ranks

__all__ = ["WrittenAccelerate", "write_accelerate_runs"]

STEPS = 6
SAVE_EVERY = 2
#: accelerate's `total_limit` of the DeepSpeed run (3 saves: the first is rotated out).
DEEPSPEED_TOTAL_LIMIT = 2
#: Steps the resumed copy of the plain run trains before its one save.
RESUMED_STEPS = 2
FSDP_STEPS = 2


@dataclass(frozen=True)
class WrittenAccelerate:
    """What the accelerate runs wrote.

    Attributes:
        plain: the plain run's `project_dir` (`checkpoints/checkpoint_{0,1,2}/`).
        named: the user-named `save_state` folder of the plain run (`pytorch_model.bin`, `sampler.bin`).
        resumed: the resumed copy of the plain run's `project_dir` (its newest save is `checkpoint_0`).
        deepspeed: the DeepSpeed run's `project_dir` (`checkpoints/checkpoint_{1,2}/`).
        fsdp: the FSDP folder (`pytorch_model_fsdp_0/`, `optimizer_0/`).
        fsdp_no_dcp: the same FSDP save with `use_dcp=False` (per-process `.bin` files).
        model_parameters: elements of the model's parameters.
        config_dir: a folder holding the model's `config.json`.
    """

    plain: Path
    named: Path
    resumed: Path
    deepspeed: Path
    fsdp: Path
    fsdp_no_dcp: Path
    model_parameters: int
    config_dir: Path

    def plain_checkpoints(self) -> tuple[Path, ...]:
        return tuple(self.plain / "checkpoints" / f"checkpoint_{i}" for i in range(STEPS // SAVE_EVERY))

    def deepspeed_checkpoints(self) -> tuple[Path, ...]:
        saves = STEPS // SAVE_EVERY
        first = saves - DEEPSPEED_TOTAL_LIMIT
        return tuple(self.deepspeed / "checkpoints" / f"checkpoint_{i}" for i in range(first, saves))

    def reference(self, run: str) -> dict[str, Any]:
        """The final weights of the run `plain` (also those of `named`), `deepspeed` or `fsdp`."""
        from safetensors.torch import load_file

        return load_file(str(_reference_path(self.plain.parent, run)))


def _reference_path(root: Path, run: str) -> Path:
    # Beside the runs: a safetensors file inside one would make its folder look like a model.
    return root / f"{run}.reference.safetensors"


def _batches() -> list[Any]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (16,), generator=generator) for _ in range(16)]


def _train(accelerator: Any, steps: int, save: Any, resume: bool = False) -> Any:
    """Train the tiny Llama under `accelerator` for `steps` steps, calling `save(step, loader)` after each
    (with `resume`, after `accelerator.load_state()` of the newest automatic checkpoint)."""
    import torch

    from tests.writers.models import tiny_llama

    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = torch.utils.data.DataLoader(_batches(), batch_size=2, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if resume:
        accelerator.load_state()
    batches = iter(loader)
    for step in range(1, steps + 1):
        ids = next(batches)
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        save(step, loader)
    return model


def _write_reference(weights: Any, root: Path, run: str) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in weights.items()}, str(_reference_path(root, run)))


def _plain(root: Path) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, save, set_seed

    set_seed(0)
    project = ProjectConfiguration(project_dir=str(root / "plain"), automatic_checkpoint_naming=True)
    accelerator = Accelerator(
        cpu=True, project_config=project, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )

    def save_state(step: int, loader: Any) -> None:
        if step % SAVE_EVERY == 0:
            accelerator.save_state()
        if step == STEPS:
            named = root / "named" / f"step_{STEPS}"
            accelerator.project_configuration.automatic_checkpoint_naming = False
            accelerator.save_state(str(named), safe_serialization=False)
            save(loader.get_sampler(), named / "sampler.bin")

    model = _train(accelerator, STEPS, save_state)
    _write_reference(accelerator.unwrap_model(model).state_dict(), root, "plain")


def _resumed(root: Path) -> None:
    import shutil

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import ProjectConfiguration, set_seed

    shutil.copytree(root / "plain", root / "resumed")
    AcceleratorState._reset_state(reset_partial_state=True)
    set_seed(0)
    project = ProjectConfiguration(project_dir=str(root / "resumed"), automatic_checkpoint_naming=True, total_limit=3)
    accelerator = Accelerator(cpu=True, project_config=project)

    def save_state(step: int, loader: Any) -> None:
        if step == RESUMED_STEPS:
            accelerator.save_state()

    _train(accelerator, RESUMED_STEPS, save_state, resume=True)


def _deepspeed(root: Path) -> None:
    import deepspeed
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, ProjectConfiguration, set_seed

    set_seed(0)
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1)
    project = ProjectConfiguration(
        project_dir=str(root / "deepspeed"), automatic_checkpoint_naming=True, total_limit=DEEPSPEED_TOTAL_LIMIT
    )
    accelerator = Accelerator(project_config=project, deepspeed_plugin=plugin)

    def save_state(step: int, loader: Any) -> None:
        if step % SAVE_EVERY == 0:
            accelerator.save_state()

    model = _train(accelerator, STEPS, save_state)
    _write_reference(accelerator.unwrap_model(model).state_dict(), root, "deepspeed")
    deepspeed.comm.barrier()


def _fsdp(root: Path) -> None:
    import torch
    from accelerate import PartialState
    from accelerate.checkpointing import save_accelerator_state
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.writers.models import tiny_llama

    state = PartialState(cpu=True)
    model = tiny_llama()
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for ids in _batches()[:FSDP_STEPS]:
        ids = ids.unsqueeze(0)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    # What `Accelerator.save_state` does under DistributedType.FSDP, in its order: the model and the
    # optimizer (through DCP, or per process with use_dcp=False), then everything else with no weights and
    # no optimizers.
    for folder, use_dcp in ((root / "fsdp", True), (root / "fsdp-no-dcp", False)):
        where = str(folder / f"step_{FSDP_STEPS}")
        save_fsdp_model(plugin, state, model, where, 0, use_dcp=use_dcp)
        save_fsdp_optimizer(plugin, state, optimizer, model, where, 0, use_dcp=use_dcp)
        save_accelerator_state(where, [], [], [scheduler], [], state.process_index, FSDP_STEPS)
    _write_reference(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)), root, "fsdp")


def _main(root: Path) -> None:
    import importlib
    import logging
    import socket
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    _plain(root)
    _resumed(root)

    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
    )
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    # The CPU backend JIT-compiles a shared-memory allreduce on first use; gloo is all one rank needs (see
    # tests/writers/deepspeed_writer.py).
    setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)  # noqa: B010
    deepspeed.init_distributed(dist_backend="gloo")
    _deepspeed(root)
    AcceleratorState._reset_state(reset_partial_state=True)
    _fsdp(root)
    torch.distributed.destroy_process_group()


def _main_process(_rank: int, root: str) -> None:
    _main(Path(root))


def write_accelerate_runs(root: Path) -> WrittenAccelerate:
    """Run the accelerate runs in one process of their own (forked from the writers' pre-imported server,
    `tests.writers.ranks`: accelerate's process-wide state stays there) and describe what they wrote."""
    from tests.writers.models import tiny_llama

    root.mkdir(parents=True, exist_ok=True)
    run_ranks(_main_process, (str(root),), 1, environment={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    model = tiny_llama()
    config_dir = root / "config"
    model.config.save_pretrained(str(config_dir))
    return WrittenAccelerate(
        plain=root / "plain",
        named=root / "named" / f"step_{STEPS}",
        resumed=root / "resumed",
        deepspeed=root / "deepspeed",
        fsdp=root / "fsdp" / f"step_{FSDP_STEPS}",
        fsdp_no_dcp=root / "fsdp-no-dcp" / f"step_{FSDP_STEPS}",
        model_parameters=sum(p.numel() for p in model.parameters()),
        config_dir=config_dir,
    )


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
