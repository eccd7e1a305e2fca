"""An AReaL 1.0.4 PPO critic saved by AReaL's own engine, Saver and RecoverHandler on one gloo CPU rank.

The spawned rank builds what AReaL's `RLTrainer` builds for `config.critic` (areal/trainer/rl_trainer.py,
`_create_critic`): `FSDPPPOCritic` (areal/engine/fsdp_engine.py) with `is_critic=True`, which loads the model
`AutoModelForTokenClassification.from_pretrained(path, num_labels=1)` (`FSDPEngine._create_llm_actor_or_critic`),
from the same tiny local Qwen3 folder as `tests.writers.areal_writer`. It then saves as `RLTrainer` does:
`_save_hf`'s `Saver.save(critic, ..., name="critic")` (the export `critic/epoch0epochstep0globalstep0/`,
`FSDPEngine._save_model_to_hf`: the weights cast to the compute dtype, and the base model's config written over
the model's own) and `_save_recover_checkpoint`'s `RecoverHandler.dump({"critic": critic}, ...)` (`dcp.save({"dcp": DCPState(model,
optimizer)})` into `critic/recover_checkpoint/`, then `recover_info/`; the actor AReaL dumps beside it as
`default` is left out, and the data loader whose state it records is a stand-in: nothing is trained here).

Before saving, it records the values the critic computes on fixed token ids (`values.safetensors`: the model's
per-token outputs in float32, its own module called on `TOKEN_IDS`), which a converted critic must reproduce.
The modules AReaL imports that are not installed are stood in for as in `tests.writers.areal_writer`.
"""

from __future__ import annotations

import getpass
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from tests.writers.areal_writer import _STOOD_IN, _WORKING, EXPERIMENT, TRIAL, _base_model
from tests.writers.ranks import run_ranks
from tests.writers.stand_ins import InertModule, StandIns

__all__ = ["TOKEN_IDS", "WrittenArealCritic", "write_areal_critic"]

#: The token ids the critic's values are recorded on (inside the tiny vocabulary).
TOKEN_IDS = tuple(range(3, 19))


@dataclass(frozen=True)
class WrittenArealCritic:
    """What AReaL wrote for its critic.

    Attributes:
        trial: the trial folder (`critic/` inside).
        values: `values.safetensors`: `values` [1, len(TOKEN_IDS), 1], the critic's outputs in float32.
    """

    trial: Path
    values: Path

    @property
    def export(self) -> Path:
        return self.trial / "critic" / "epoch0epochstep0globalstep0"

    @property
    def slot(self) -> Path:
        return self.trial / "critic" / "recover_checkpoint"


class _NoLoader:
    """The data loader `RecoverHandler.dump` records the state of: this run has none (the critic is only saved)."""

    def state_dict(self) -> dict[str, int]:
        return {"_num_yielded": 0}


def _rank(rank: int, rendezvous: str, fileroot: str, base_model: str, values: str) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    with StandIns("areal", _STOOD_IN, lambda name: _WORKING.get(name, InertModule)(name)).serving():
        import areal.engine.fsdp_engine
        import areal.experimental.engine.archon_engine
        import areal.trainer.ppo.critic
        import areal.utils.evaluator
        import areal.utils.recover
        import areal.utils.saver
        import areal.utils.stats_logger  # noqa: F401
    from areal.api import FinetuneSpec, StepInfo
    from areal.api.alloc_mode import ParallelStrategy
    from areal.api.cli_args import (
        BaseExperimentConfig,
        EvaluatorConfig,
        OptimizerConfig,
        PPOCriticConfig,
        RecoverConfig,
        SaverConfig,
    )
    from areal.engine.fsdp_engine import FSDPPPOCritic
    from areal.utils.evaluator import Evaluator
    from areal.utils.recover import RecoverHandler
    from areal.utils.saver import Saver
    from areal.utils.stats_logger import StatsLogger

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    names = {"experiment_name": EXPERIMENT, "trial_name": TRIAL}
    timer = {**names, "fileroot": fileroot, "freq_steps": 1}
    config = PPOCriticConfig(
        **names,
        path=base_model,
        is_critic=True,
        attn_impl="sdpa",
        dtype="float32",  # bfloat16 by default (FSDP2's compute dtype): float32 makes the values exact
        optimizer=OptimizerConfig(lr=1e-3),
        backend="fsdp:d1",
    )
    ft_spec = FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2)
    torch.manual_seed(0)
    critic = FSDPPPOCritic(config)
    critic.create_process_group(parallel_strategy=ParallelStrategy(data_parallel_size=1))
    critic.initialize(addr=None, ft_spec=ft_spec, role="critic")
    with torch.no_grad():
        output = critic.model(input_ids=torch.tensor([TOKEN_IDS]))
    save_file({"values": output.logits.float().contiguous()}, values)
    saver = Saver(SaverConfig(**timer), ft_spec)
    saver.save(critic, 0, 0, 0, tokenizer=critic.tokenizer, name="critic")  # RLTrainer._save_hf
    experiment = BaseExperimentConfig(**names)
    experiment.stats_logger.experiment_name, experiment.stats_logger.trial_name = EXPERIMENT, TRIAL
    experiment.stats_logger.fileroot = fileroot
    RecoverHandler(RecoverConfig(**timer, mode="on"), ft_spec).dump(  # RLTrainer._save_recover_checkpoint
        {"critic": critic},
        StepInfo(global_step=0, epoch=0, epoch_step=0, steps_per_epoch=4),
        saver,
        Evaluator(EvaluatorConfig(**names, fileroot=fileroot), ft_spec),
        StatsLogger(experiment, ft_spec),
        _NoLoader(),
        tokenizer=critic.tokenizer,
    )
    critic.destroy()
    dist.destroy_process_group()


def write_areal_critic(root: Path) -> WrittenArealCritic:
    """Build and save AReaL's critic in one spawned CPU rank into `root` (see the module docstring)."""
    root.mkdir(parents=True, exist_ok=True)
    _base_model(root / "base")
    fileroot = root / "fileroot"
    written = WrittenArealCritic(
        trial=fileroot / "checkpoints" / getpass.getuser() / EXPERIMENT / TRIAL, values=root / "values.safetensors"
    )
    rendezvous = root / ".rendezvous"
    run_ranks(_rank, (str(rendezvous), str(fileroot), str(root / "base"), str(written.values)), 1)
    rendezvous.unlink(missing_ok=True)
    return written
