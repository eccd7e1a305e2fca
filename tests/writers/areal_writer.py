"""AReaL 1.0.4's own training engine, Saver and RecoverHandler on one gloo CPU rank.

Each spawned rank runs what AReaL's `SFTTrainer` runs (areal/trainer/sft_trainer.py), unmodified and on
AReaL's CPU platform (`areal.infra.platforms.CpuPlatform`: gloo): `FSDPLMEngine` (areal/engine/fsdp_engine.py)
built by `create_process_group` and `initialize` from a tiny local Qwen3 folder (config, weights and a
word-level tokenizer, no hub), the data loader of `create_dataloader` (areal/utils/dataloader.py), and per
step what `SFTTrainer.train` does: `train_lm` + `step_lr_scheduler` + `set_version`, then `_save_hf`
(`Saver.save` → `FSDPEngine.save(weight_format="hf")`: the export `default/epoch{E}epochstep{S}globalstep{G}/`),
then `_save_recover_checkpoint` (`RecoverHandler.dump({"default": actor}, StepInfo, saver, evaluator,
stats_logger, dataloader)` → `FSDPEngine._save_to_dcp`: `dcp.save({"dcp": DCPState(model, optimizer)})` into
`default/recover_checkpoint/`, overwritten in place, then `RecoverInfo.dump` into `recover_info/`), then
`StatsLogger.commit`. The trial lands where AReaL puts it: `{fileroot}/checkpoints/{getpass.getuser()}/
{experiment}/{trial}/` (`Saver.get_save_root`).

AReaL is installed without its dependencies (tests/writers/frameworks-nodeps.txt). The modules it imports
that are not installed here are stood in for inside the spawned ranks only, and only for imports made by
AReaL's own modules (`tests.writers.stand_ins`); none of them is on the save path:

- inert: GPU kernels (`triton`), cluster, serving and network stacks (`ray`, `uvloop`, `httpx`, `tenacity`,
  `aiofiles`, `orjson`, `pybase64`, `openai`), experiment trackers (`wandb`, `swanlab`, `trackio`,
  `tensorboardX`: `StatsLogger` calls them, they record nothing), config parsing (`hydra`, `omegaconf` with
  its `MISSING`, `lark`: the configs are built here as dataclasses and the parallel strategy given directly),
  images and data sets (`PIL`, `datasets`);
- working: `colorlog` (AReaL's log formatter subclasses its formatter), `tabulate` (the stats table),
  `numba` (`njit` leaves the function plain Python), and `torchdata`'s `StatefulDataLoader`: a
  `DataLoader` whose `state_dict()` holds the keys torchdata's single-process iterator reports
  (pytorch/data `torchdata/stateful_dataloader/stateful_dataloader.py`,
  `_StatefulSingleProcessDataLoaderIter.state_dict`, with its `BatchSampler.state_dict` as the index
  sampler's state), which is what `RecoverInfo.dump` all-gathers into `dataloader_info.pkl`.
"""

from __future__ import annotations

import getpass
import logging
import os
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.writers.ranks import freeze_imports, run_ranks
from tests.writers.stand_ins import InertModule, StandIns

__all__ = ["EXPERIMENT", "TRIAL", "WrittenAreal", "write_areal_run"]

#: One spawned rank: no test of this run needs a second one (what several ranks write, recover slots and their
#: `dataloader_info.pkl` of one state per rank, is tested on `tests.writers.rl_runs`' 2-rank FSDP2 trial), and a
#: rank costs seconds of imports.
WORLD_SIZE = 1
#: Training steps; AReaL numbers them from 0 and saves after each (Saver and recover `freq_steps=1`).
STEPS = 2
EXPERIMENT = "tiny-sft"
TRIAL = "trial0"
#: Samples per step over all ranks (`train_dataset.batch_size`) and in the data set (4 steps per epoch).
BATCH_SIZE = 2
DATASET_SIZE = 8
SEQ_LEN = 12
VOCAB = 128


@dataclass(frozen=True)
class WrittenAreal:
    """What AReaL wrote.

    Attributes:
        fileroot: AReaL's `cluster.fileroot` (`saver.fileroot`, `recover.fileroot`).
        trial: the trial folder (`default/`, `recover_info/`).
        base_model: the local model folder AReaL trained from (config, weights, tokenizer).
        model_parameters: elements of the model's parameters.
        world_size: ranks.
        steps: training steps, each saved (global steps 0..steps-1).
    """

    fileroot: Path
    trial: Path
    base_model: Path
    model_parameters: int
    world_size: int = WORLD_SIZE
    steps: int = STEPS

    @property
    def slot(self) -> Path:
        """`default/recover_checkpoint`: the recover dump of the last step."""
        return self.trial / "default" / "recover_checkpoint"

    def export(self, global_step: int) -> Path:
        """The Saver's HF export of a step (one epoch: epoch 0, epoch step = global step)."""
        return self.trial / "default" / f"epoch0epochstep{global_step}globalstep{global_step}"


# --------------------------------------------------------------------------------------------------
# Stand-ins for the modules AReaL imports that are not installed (see the module docstring).
# --------------------------------------------------------------------------------------------------


_INERT = frozenset(
    {
        "triton",
        "ray",
        "uvloop",
        "httpx",
        "tenacity",
        "aiofiles",
        "orjson",
        "pybase64",
        "openai",
        "wandb",
        "swanlab",
        "trackio",
        "tensorboardX",
        "hydra",
        "lark",
        "PIL",
        "datasets",
    }
)


def _colorlog(name: str) -> types.ModuleType:
    class ColoredFormatter(logging.Formatter):
        def __init__(self, fmt: str | None = None, datefmt: str | None = None, style: Any = "%", **_: Any) -> None:
            super().__init__(fmt, datefmt, style)

        def _escape_code_map(self, levelname: str) -> dict[str, str]:
            return {"log_color": "", "reset": ""}

        def _append_reset(self, message: str, escapes: dict[str, str]) -> str:
            return message

    return _module(name, ColoredFormatter=ColoredFormatter)


class _ColoredRecord:
    def __init__(self, record: logging.LogRecord, escapes: dict[str, str]) -> None:
        self.__dict__.update(record.__dict__)
        self.__dict__.update(escapes)


def _numba_njit(*args: Any, **kwargs: Any) -> Any:
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda function: function


def _torchdata(name: str) -> types.ModuleType:
    from torch.utils.data import DataLoader

    class StatefulDataLoader(DataLoader):  # type: ignore[type-arg]
        """Batches as `DataLoader`; `state_dict()` as torchdata's for `num_workers=0` and a sampler that
        keeps no state (AReaL's `DistributedSampler`)."""

        _yielded = 0

        def __iter__(self) -> Iterator[Any]:
            for batch in super().__iter__():
                self._yielded += 1
                yield batch

        def state_dict(self) -> dict[str, Any]:
            return {
                "_index_sampler_state": {"samples_yielded": self._yielded * (self.batch_size or 1)},
                "_sampler_iter_state": None,
                "_sampler_iter_yielded": self._yielded,
                "_num_yielded": self._yielded,
                "_IterableDataset_len_called": None,
                "_shared_seed": None,
                "fetcher_state": None,
                "dataset_state": None,
                "_iterator_finished": False,
            }

    return _module(name, StatefulDataLoader=StatefulDataLoader)


def _module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


#: Stand-ins that work (full module names), for what AReaL runs on the way.
_WORKING: dict[str, Callable[[str], types.ModuleType]] = {
    "colorlog": _colorlog,
    "colorlog.escape_codes": lambda name: _module(name, parse_colors=lambda sequence: ""),
    "colorlog.formatter": lambda name: _module(name, ColoredRecord=_ColoredRecord),
    "tabulate": lambda name: _module(
        name, tabulate=lambda rows, **_: "\n".join("  ".join(map(str, row)) for row in rows)
    ),
    "numba": lambda name: _module(name, njit=_numba_njit),
    "torchdata": _module,
    "torchdata.stateful_dataloader": _torchdata,
    "omegaconf": lambda name: InertModule(name, MISSING="???"),  # the dataclass default AReaL's configs use
}
_STOOD_IN = _INERT | {name.partition(".")[0] for name in _WORKING}


def _import_areal() -> None:
    """Import the AReaL modules the run uses (and those they import lazily at save time) with the stand-ins
    in place, then take the stand-ins out of `sys.modules` again: AReaL's modules keep their references. They
    are then left out of garbage collections (`freeze_imports`): `FSDPEngine.destroy` runs two."""
    with StandIns("areal", _STOOD_IN, lambda name: _WORKING.get(name, InertModule)(name)).serving():
        import areal.engine.fsdp_engine
        import areal.experimental.engine.archon_engine  # Saver._should_use_async imports it at each save
        import areal.trainer.sft.lm_engine
        import areal.utils.evaluator
        import areal.utils.recover
        import areal.utils.saver
        import areal.utils.stats_logger  # noqa: F401
    freeze_imports()


# --------------------------------------------------------------------------------------------------
# One rank: AReaL's SFT trainer loop, step by step.
# --------------------------------------------------------------------------------------------------


def _dataset() -> list[dict[str, list[int]]]:
    """What an SFT data set yields per sample (`input_ids`, `loss_mask`), token ids of the tiny vocabulary."""
    import torch

    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (DATASET_SIZE, SEQ_LEN), generator=generator)
    return [{"input_ids": row.tolist(), "loss_mask": [0] * 4 + [1] * (SEQ_LEN - 4)} for row in ids]


def sft_config(trial: str, fileroot: str, base_model: str, data_parallel: int) -> Any:
    """The `SFTConfig` of this writer's trial (`EXPERIMENT`/`trial` under `fileroot`, `base_model`'s weights
    and tokenizer, FSDP over `data_parallel` ranks, a save and a recover checkpoint every step): the writer's,
    and the fault matrix's loader builds the same to resume it."""
    from areal.api.cli_args import (
        EvaluatorConfig,
        OptimizerConfig,
        RecoverConfig,
        SaverConfig,
        SFTConfig,
        TrainDatasetConfig,
        TrainEngineConfig,
    )

    names = {"experiment_name": EXPERIMENT, "trial_name": trial}
    timer = {**names, "fileroot": fileroot, "freq_steps": 1}
    config = SFTConfig(
        **names,
        tokenizer_path=base_model,
        train_dataset=TrainDatasetConfig(path="local", type="sft", batch_size=BATCH_SIZE, shuffle=True),
        saver=SaverConfig(**timer),
        recover=RecoverConfig(**timer, mode="on"),
        evaluator=EvaluatorConfig(**names, fileroot=fileroot),
        actor=TrainEngineConfig(
            **names,
            path=base_model,
            attn_impl="sdpa",  # flash_attention_2 by default: no GPU here
            optimizer=OptimizerConfig(lr=1e-3),
            backend=f"fsdp:d{data_parallel}",
        ),
    )
    config.stats_logger.experiment_name, config.stats_logger.trial_name = EXPERIMENT, trial
    config.stats_logger.fileroot = fileroot
    return config


def _rank(rank: int, rendezvous: str, fileroot: str, base_model: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _import_areal()
    from areal.api import FinetuneSpec, StepInfo
    from areal.api.alloc_mode import ParallelStrategy
    from areal.engine.fsdp_engine import FSDPLMEngine
    from areal.infra.platforms import current_platform
    from areal.utils import seeding
    from areal.utils.data import (
        broadcast_tensor_container,
        collate_samples_to_list,
        cycle_dataloader,
        tensor_container_to,
    )
    from areal.utils.dataloader import create_dataloader
    from areal.utils.evaluator import Evaluator
    from areal.utils.recover import RecoverHandler
    from areal.utils.saver import Saver
    from areal.utils.stats_logger import StatsLogger

    # The launcher's part (torchrun's env:// rendezvous), over a file so that no port is needed.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD_SIZE)
    config = sft_config(TRIAL, fileroot, base_model, WORLD_SIZE)

    # SFTTrainer.__init__ (the allocation string's parser, lark, is not installed: its result is given).
    seeding.set_random_seed(config.seed, key=f"trainer{rank}")
    actor = FSDPLMEngine(config=config.actor)
    actor.create_process_group(parallel_strategy=ParallelStrategy(data_parallel_size=WORLD_SIZE))
    dataloader = create_dataloader(
        _dataset(),
        rank=actor.data_parallel_rank,
        world_size=actor.data_parallel_world_size,
        dataset_config=config.train_dataset,
        collate_fn=collate_samples_to_list,
    )
    ft_spec = FinetuneSpec(
        total_train_epochs=config.total_train_epochs,
        dataset_size=len(dataloader) * config.train_dataset.batch_size,
        train_batch_size=config.train_dataset.batch_size,
    )
    actor.initialize(addr=None, ft_spec=ft_spec, role="actor")
    evaluator = Evaluator(config.evaluator, ft_spec)
    saver = Saver(config.saver, ft_spec)
    recover_handler = RecoverHandler(config.recover, ft_spec)
    stats_logger = StatsLogger(config, ft_spec)

    # SFTTrainer.train, its first STEPS steps (no validation set: `_evaluate` returns at once).
    data = cycle_dataloader(dataloader)
    steps_per_epoch = len(dataloader)
    for global_step in range(STEPS):
        epoch, step = divmod(global_step, steps_per_epoch)
        batch = tensor_container_to(next(data), current_platform.current_device())
        batch = broadcast_tensor_container(
            batch, src_rank=actor.current_data_parallel_head(), group=actor.context_and_model_parallel_group
        )
        actor.train_lm(batch)
        actor.step_lr_scheduler()
        actor.set_version(global_step + 1)
        saver.save(actor, epoch, step, global_step, tokenizer=actor.tokenizer)  # _save_hf
        dist.barrier(group=actor.cpu_group)
        step_info = StepInfo(
            global_step=global_step, epoch=epoch, epoch_step=step, steps_per_epoch=steps_per_epoch
        )  # _save_recover_checkpoint
        recover_handler.dump(
            {"default": actor}, step_info, saver, evaluator, stats_logger, dataloader, tokenizer=actor.tokenizer
        )
        dist.barrier(group=actor.cpu_group)
        stats_logger.commit(epoch, step, global_step, actor.export_stats())  # _export_and_commit_stats
        dist.barrier(group=actor.cpu_group)
    saver.finalize()  # SFTTrainer.close
    actor.destroy()
    dist.destroy_process_group()


def _base_model(folder: Path) -> int:
    """A tiny Qwen3 (the family AReaL's examples train; AReaL's packed inputs need a model that takes a
    per-layer-type attention mask) and a word-level tokenizer of its vocabulary, built locally."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1234)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", eos_token="w1", pad_token="w2").save_pretrained(
        folder
    )
    return sum(p.numel() for p in model.parameters())


def write_areal_run(root: Path) -> WrittenAreal:
    """Run AReaL's SFT loop for `STEPS` steps on `WORLD_SIZE` spawned CPU ranks, saving every step.

    Takes tens of seconds (each rank imports AReaL, torch and transformers); use it from a session fixture.
    """
    written = WrittenAreal(
        fileroot=root / "fileroot",
        trial=root / "fileroot" / "checkpoints" / getpass.getuser() / EXPERIMENT / TRIAL,  # Saver.get_save_root
        base_model=root / "base",
        model_parameters=_base_model(root / "base"),
    )
    rendezvous = root / ".rendezvous"
    run_ranks(_rank, (str(rendezvous), str(written.fileroot), str(written.base_model)), WORLD_SIZE)
    rendezvous.unlink(missing_ok=True)
    return written
