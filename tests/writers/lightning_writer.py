"""Lightning checkpoints written by lightning 2.6.6 itself: `ModelCheckpoint` files of a 2-rank CPU run.

`Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4)` trains a tiny LightningModule
wrapping the tiny Llama of `tests.writers.models` (built from a config dict it saves as its hyperparameters, as
`AutoConfig.from_pretrained(...).to_dict()` gives one) with AdamW and a StepLR scheduler, logging `train_loss`.
Two `ModelCheckpoint` callbacks watch it:

- `checkpoints/`: `every_n_train_steps=2, save_top_k=2, monitor="train_loss", save_last=True`: the files
  `epoch=0-step=2.ckpt`, `epoch=0-step=4.ckpt` and the copy `last.ckpt`;
- `linked/`: `every_n_train_steps=2, save_top_k=-1` (no monitor: every file kept) with `save_last="link"`:
  `last.ckpt` is a symbolic link to the newest file.

A sharded FSDP checkpoint (a `.ckpt` folder) needs `FSDPStrategy`, which needs CUDA. The writer arranges one
from the same run the way Lightning's own code writes it (lightning 2.6.6
`lightning/pytorch/strategies/fsdp.py` `FSDPStrategy.save_checkpoint`, `state_dict_type="sharded"`):
a callback (`tests.writers.lightning_module.ShardedSave`) takes the checkpoint dict Lightning builds at the end of training
(`trainer._checkpoint_connector.dump_checkpoint()`), moves `state_dict` to `"model"` and each of
`optimizer_states` to `"optimizer_{i}"`, saves those with Lightning's `_distributed_checkpoint_save`
(`lightning/fabric/strategies/fsdp.py`: `torch.distributed.checkpoint.save`, on both gloo ranks), and rank 0
then writes the rest with `torch.save` to `meta.pt`: `sharded/epoch=0-step=4.ckpt/`.

`ddp` runs rank 0 in the writer's process and starts rank 1 as `python -m tests.writers.lightning_writer OUT_DIR`
again (Lightning's subprocess launcher): two processes import Lightning, where `ddp_spawn` took three. Rank 0's
final weights (the model's `state_dict()`) are saved beside the run as `reference.pt`.

Then rank 0, once the ddp ranks' process group is gone, runs a second Trainer that trains a fresh module for 2 steps with
`DeepSpeedStrategy(stage=2)` on one CPU process (`tests.writers.lightning_module.CpuDeepSpeed`: DeepSpeed's
CPU accelerator and gloo; only the strategy's CUDA checks are bypassed) and
`ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)`: `deepspeed/epoch=0-step={1,2}.ckpt/` beside the
run, DeepSpeed save folders written by Lightning's own `DeepSpeedStrategy.save_checkpoint` (tag
`checkpoint/`, `latest`, zero_to_fp32.py); its final weights are `deepspeed-reference.pt` beside the run.
Run directly: `python -m tests.writers.lightning_writer OUT_DIR`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["WrittenLightning", "write_lightning_run"]

STEPS = 4
EVERY = 2


@dataclass(frozen=True)
class WrittenLightning:
    """A Lightning run folder and what it must contain.

    Attributes:
        root: the run's `default_root_dir`.
        checkpoints: `ModelCheckpoint`'s `dirpath` with `save_last=True` (a copy).
        linked: the `dirpath` with `save_last="link"` (a symbolic link).
        sharded: the sharded FSDP checkpoint folder.
        reference: the final weights (LightningModule `state_dict()` names, `model.` prefixed).
        model_parameters: elements of the model's parameters.
    """

    root: Path
    checkpoints: Path
    linked: Path
    sharded: Path
    reference: Path
    model_parameters: int

    def step(self, n: int) -> Path:
        return self.checkpoints / f"epoch=0-step={n}.ckpt"

    @property
    def deepspeed(self) -> Path:
        """The DeepSpeed run's ModelCheckpoint `dirpath`: `epoch=0-step=1.ckpt/` and `epoch=0-step=2.ckpt/`."""
        return self.root.parent / "deepspeed"

    @property
    def deepspeed_reference(self) -> Path:
        """The DeepSpeed run's final weights (LightningModule `state_dict()` names)."""
        return self.root.parent / "deepspeed-reference.pt"


def model_config() -> dict[str, Any]:
    """The tiny Llama's config as a dict (what the module saves as a hyperparameter)."""
    from tests.writers.models import tiny_llama

    config: dict[str, Any] = tiny_llama().config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    return config


def _data() -> Any:
    """The seeded batches both runs train on."""
    import lightning as L
    import torch

    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(
        [torch.randint(0, 128, (16,), generator=generator) for _ in range(32)], batch_size=2
    )


def _train(root: Path) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = _data()
    from tests.writers.lightning_module import ShardedSave, TinyLlamaModule
    from tests.writers.ranks import freeze_imports

    freeze_imports()  # as in the forked ranks of the other writers: collections walk only what the run makes
    module = TinyLlamaModule(model_config())
    callbacks = [
        ModelCheckpoint(
            dirpath=root / "checkpoints",
            every_n_train_steps=EVERY,
            save_top_k=2,
            monitor="train_loss",
            save_last=True,
        ),
        ModelCheckpoint(dirpath=root / "linked", every_n_train_steps=EVERY, save_top_k=-1, save_last="link"),
        ShardedSave(root / "sharded" / f"epoch=0-step={STEPS}.ckpt"),
    ]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=STEPS,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(module, data)
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, root.parent / "reference.pt")
        # The DeepSpeed run in this process (its imports are paid already): on a process group of its own, not
        # the ddp ranks' (rank 1 has left), and as a single process, not as rank 0 of the launcher's two.
        torch.distributed.destroy_process_group()
        for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "RANK", "MASTER_PORT"):
            os.environ.pop(name, None)
        _train_deepspeed(root)


def _train_deepspeed(root: Path) -> None:
    import importlib
    import logging

    import lightning as L
    import torch
    from deepspeed.utils import logger
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.writers.lightning_module import CpuDeepSpeed, TinyLlamaModule
    from tests.writers.ranks import freeze_imports

    freeze_imports()  # DeepSpeed's modules: its engine collects at set-up and at each save
    logger.setLevel(logging.ERROR)
    # as tests.writers.deepspeed_writer: no JIT-compiled shared-memory allreduce, plain gloo
    setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)  # noqa: B010
    data = _data()
    module = TinyLlamaModule(model_config())
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=CpuDeepSpeed(stage=2, process_group_backend="gloo"),
        max_steps=2,
        callbacks=[ModelCheckpoint(dirpath=root.parent / "deepspeed", every_n_train_steps=1, save_top_k=-1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root.parent / "deepspeed",
    )
    trainer.fit(module, data)
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    torch.save(weights, root.parent / "deepspeed-reference.pt")


def write_lightning_run(root: Path) -> WrittenLightning:
    """Run the 2-rank training and the DeepSpeed one in a subprocess; describe what they wrote."""
    from tests.writers.models import tiny_llama

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    command = [sys.executable, "-m", "tests.writers.lightning_writer", str(root)]
    _run_retrying(command, repo, {**env, "DS_ACCELERATOR": "cpu"}, lambda: _clean(root))
    return WrittenLightning(
        root=root,
        checkpoints=root / "checkpoints",
        linked=root / "linked",
        sharded=root / "sharded" / f"epoch=0-step={STEPS}.ckpt",
        reference=root.parent / "reference.pt",
        model_parameters=sum(p.numel() for p in tiny_llama().parameters()),
    )


def _clean(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(root.parent / "deepspeed", ignore_errors=True)


def _run_retrying(command: list[str], repo: Path, env: dict[str, str], clean: Callable[[], None]) -> None:
    """`command` to success, once more after `clean()` when a process was killed by a signal (gloo on a loaded
    machine now and then aborts a rank, see tests.conftest._build_retrying)."""
    for attempt in range(2):
        done = subprocess.run(command, cwd=repo, env=env, capture_output=True)
        killed = done.returncode < 0 or (b"ProcessExitedException" in done.stderr and b"signal" in done.stderr)
        if done.returncode == 0 or not killed or attempt:
            break
        clean()
    if done.returncode != 0:
        raise RuntimeError(f"the Lightning writer failed:\n{done.stderr.decode(errors='replace')[-4000:]}")


if __name__ == "__main__":
    _train(Path(sys.argv[1]))
