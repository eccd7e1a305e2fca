"""Lightning 2.6.6's own restore of a checkpoint `tests.writers.lightning_writer` wrote.

- A `.ckpt` file (`build_file`): `Trainer.fit(module, ckpt_path=PATH)` on one CPU device, the module and data
  as the writer's, `max_steps` the run's (`lightning/pytorch/trainer/connectors/checkpoint_connector.py:
  _CheckpointConnector.resume_start` loads the file, `restore_model`, `restore_training_state`: optimizers,
  LR schedulers, loops and the global step; the fit loop is then done, so nothing trains). One Trainer per
  cell; the state compared is the module's, the optimizer's, the scheduler's and the loop's counters.
- The sharded `.ckpt/` folder (`build_sharded`): Lightning's own reading of a distributed checkpoint into a full
  one (`lightning/fabric/utilities/load.py: _load_distributed_checkpoint`, what `python -m lightning.fabric.
  utilities.consolidate_checkpoint` runs: `.metadata`, the `__R_0.distcp` shards, then `meta.pt` with the
  rest of the checkpoint, read only when it is there). `FSDPStrategy.load_checkpoint`, the resume path of
  such a folder, needs CUDA, which is not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.faults.cells import loader_verdicts
from tests.faults.loaders.common import run


def load_file(path: str, options: Mapping[str, Any]) -> Any:
    import lightning as L

    from tests.writers.lightning_module import TinyLlamaModule
    from tests.writers.lightning_writer import STEPS, _data, model_config

    module = TinyLlamaModule(model_config())
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=_data(), ckpt_path=path)
    return {
        "module": module.state_dict(),
        "optimizer": trainer.optimizers[0].state_dict(),
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "fit_loop": trainer.fit_loop.state_dict(),
    }


def load_sharded(path: str, options: Mapping[str, Any]) -> Any:
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    return _load_distributed_checkpoint(Path(path))


def load(path: str, options: Mapping[str, Any]) -> Any:
    return load_sharded(path, options) if options["sharded"] else load_file(path, options)


def build_file(checkpoint: Path, _out: Path) -> dict[str, str]:
    """Lightning's verdict on the cells of a `.ckpt` file of the ddp run."""
    return loader_verdicts(__name__, checkpoint, sharded=False, loggers=["lightning"])


def build_sharded(checkpoint: Path, _out: Path) -> dict[str, str]:
    """Lightning's verdict on each cell of the sharded `.ckpt/` folder."""
    return loader_verdicts(__name__, checkpoint, sharded=True, loggers=["lightning"])


if __name__ == "__main__":
    run(load)
