"""AReaL 1.0.4's own recover of a trial (`recover.mode=on`), and transformers' load of the step's HF export.

The checkpoint is the trial folder of `tests.writers.areal_writer` (`<trial>/recover_info/`,
`<trial>/default/recover_checkpoint/` and the step's export `<trial>/default/epoch0epochstep1globalstep1/`). What
AReaL's `SFTTrainer.__init__` (areal/trainer/sft_trainer.py) does on a resume runs here unmodified, on AReaL's
CPU platform as the writer runs it (the same stand-ins for the modules AReaL imports that are not installed):
a fresh `FSDPLMEngine` (areal/engine/fsdp_engine.py) built from the base model, then
`areal/utils/recover.py: RecoverHandler.load`: `RecoverInfo.load` reads every `recover_info/` file (`json.load` of
the five JSON files, `pickle.load` of `dataloader_info.pkl`; any failure is an `InValidRecoverInfo` that `load`
catches, logs "This should not be a resumed experiment!" and returns None: a fresh start), hands them to the
Saver, the RecoverHandler's own frequency control, the Evaluator, the StatsLogger and the data loader, then
`RecoverHandler._load_checkpoint` → `FSDPEngine.load` → `FSDPEngine._load_from_dcp`: `dcp.load({"dcp":
DCPState(model, optimizer)})` of the slot (areal/engine/fsdp_utils/checkpoint.py: `DCPState.load_state_dict`,
`set_state_dict` of model and optimizer).

The trial is found where AReaL looks for it (`Saver.get_save_root`: `{fileroot}/checkpoints/{user}/{experiment}/
{trial}`) through a link from a fresh fileroot to the damaged copy's folder. The data loader is torchdata's
`StatefulDataLoader` as far as a recover goes: `load_state_dict` keeps the state for its next iterator
(pytorch/data `torchdata/stateful_dataloader/stateful_dataloader.py: StatefulDataLoader.load_state_dict`).

AReaL itself never loads the export (its rollout servers and users do): it is judged by `tests.faults.loaders.
hf_model`'s load (`from_pretrained` of the model, its generation config and tokenizer). The state compared: the
engine's model and optimizer, what `RecoverHandler.load` returned, the state of every object it restored, and
the export's.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.faults.cells import loader_verdicts
from tests.faults.loaders import hf_model
from tests.faults.loaders.common import local_shards, run

#: The recover slot, and the export of its step (the last of the writer's `STEPS`), in the trial.
SLOT = "default/recover_checkpoint"
EXPORT = "default/epoch0epochstep1globalstep1"


class _DataLoader:
    """`StatefulDataLoader.load_state_dict`: the state is kept and applied when the next iterator starts."""

    next_iter_state: Any = None

    def load_state_dict(self, state_dict: Any) -> None:
        self.next_iter_state = state_dict


def _recover(trial: Path, base_model: str) -> dict[str, Any]:
    """`SFTTrainer.__init__`'s engine and helpers, built as the writer built them, then `RecoverHandler.load`
    of `trial`; what they hold."""
    from areal.api import FinetuneSpec
    from areal.api.alloc_mode import ParallelStrategy
    from areal.engine.fsdp_engine import FSDPLMEngine
    from areal.utils.evaluator import Evaluator
    from areal.utils.recover import RecoverHandler
    from areal.utils.saver import Saver
    from areal.utils.stats_logger import StatsLogger

    from tests.writers.areal_writer import BATCH_SIZE, DATASET_SIZE, EXPERIMENT, sft_config

    with tempfile.TemporaryDirectory(prefix="areal-fileroot-") as fileroot:
        user = Path(fileroot, "checkpoints", getpass.getuser())
        user.mkdir(parents=True)
        (user / EXPERIMENT).symlink_to(trial.parent)  # Saver.get_save_root of (EXPERIMENT, trial.name)
        config = sft_config(trial.name, fileroot, base_model, 1)
        ft_spec = FinetuneSpec(
            total_train_epochs=config.total_train_epochs, dataset_size=DATASET_SIZE, train_batch_size=BATCH_SIZE
        )
        actor = FSDPLMEngine(config=config.actor)
        actor.create_process_group(parallel_strategy=ParallelStrategy(data_parallel_size=1))
        actor.initialize(addr=None, ft_spec=ft_spec, role="actor")
        saver, evaluator = Saver(config.saver, ft_spec), Evaluator(config.evaluator, ft_spec)
        recover_handler = RecoverHandler(config.recover, ft_spec)
        stats_logger = StatsLogger(config, ft_spec)
        dataloader = _DataLoader()
        try:
            info = recover_handler.load(actor, saver, evaluator, stats_logger, dataloader)
            return {
                "model": local_shards(actor.model.state_dict()),
                "optimizer": local_shards(actor.optimizer.state_dict()),
                "recover_info": None if info is None else dataclasses.asdict(info),
                "saver": saver.state_dict(),
                "evaluator": evaluator.state_dict(),
                "recover_handler": recover_handler.freq_ctl.state_dict(),
                "stats_logger": stats_logger.state_dict(),
                "dataloader": dataloader.next_iter_state,
            }
        finally:
            actor.destroy()


def load(path: str, options: Mapping[str, Any]) -> Any:
    trial = Path(path)
    return {
        "recover": _recover(trial, options["base"]),
        "export": hf_model.load(str(trial / EXPORT), {"tokenizer": True}),
    }


def main() -> None:
    """One rank as the writer's: AReaL imported with its stand-ins, a one-rank gloo group, then `run(load)`."""
    import torch.distributed as dist

    from tests.writers.areal_writer import _import_areal

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    _import_areal()
    with tempfile.TemporaryDirectory(prefix="areal-rendezvous-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            run(load)
        finally:
            dist.destroy_process_group()


def step_view(trial: Path, out: Path) -> Path:
    """`out/<trial>`: a copy of the trial as one step's checkpoint, `recover_info/`, the recover slot and the
    slot's step's export (`EXPORT`), without the older steps' exports (checkpoints of their own). File times
    are kept: the AReaL layout orders the slot's files and its info files by them."""
    older = {p.name for p in (trial / "default").iterdir() if p.name != Path(EXPORT).name and "globalstep" in p.name}
    return Path(shutil.copytree(trial, out / trial.name, ignore=lambda _, names: [n for n in names if n in older]))


def build(checkpoint: Path, _out: Path, base: Path) -> dict[str, str]:
    """AReaL's verdict (and transformers' on the export) on each cell of a `step_view` of the trial."""
    return loader_verdicts(__name__, checkpoint, base=str(base), loggers=["transformers", "Recover"])


if __name__ == "__main__":
    main()
