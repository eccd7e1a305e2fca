"""The LightningModule and callback of `tests.writers.lightning_writer`, importable by name in both of its ranks
(not `__main__` classes), and imported only by the writer's subprocesses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy


class TinyLlamaModule(L.LightningModule):
    """The tiny Llama, built from the config dict it keeps as a hyperparameter, under the attribute `model`."""

    def __init__(self, config: dict[str, Any], lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(1234)
        self.model = LlamaForCausalLM(LlamaConfig(**config))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)]


class CpuDeepSpeed(DeepSpeedStrategy):
    """lightning 2.6.6 `DeepSpeedStrategy` on one CPU process (DeepSpeed's CPU accelerator, gloo): the strategy
    refuses any accelerator but CUDA in `setup_environment`, checks device indices against local ranks in
    `setup_distributed`, and hands `root_device.index` (None on CPU) to `deepspeed.initialize` as the device
    rank; these three are what changes. Its saving (`save_checkpoint`) is Lightning's own."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", 0)


class ShardedSave(L.Callback):
    """At the end of training, what lightning 2.6.6 `FSDPStrategy.save_checkpoint` does with
    `state_dict_type="sharded"` (`lightning/pytorch/strategies/fsdp.py`), to `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save
        from lightning.fabric.utilities.load import _METADATA_FILENAME

        checkpoint = trainer._checkpoint_connector.dump_checkpoint()
        self.path.mkdir(parents=True, exist_ok=True)
        converted_state = {"model": checkpoint.pop("state_dict")}
        converted_state.update(
            {f"optimizer_{idx}": state for idx, state in enumerate(checkpoint.pop("optimizer_states", []))}
        )
        _distributed_checkpoint_save(converted_state, self.path)
        if trainer.global_rank == 0:
            torch.save(checkpoint, self.path / _METADATA_FILENAME)
