"""Real DeepSpeed ZeRO-2 checkpoints of the frameworks that wrap DeepSpeed, written by their own code on 2 CPU
ranks, and DeepSpeed's own `ds_to_universal` of each one's latest tag.

`write_wrapper_runs` spawns 2 ranks (torch.multiprocessing, gloo through `deepspeed.init_distributed`,
`DS_ACCELERATOR=cpu`, as `deepspeed_writer` does) that train the tiny Llama of `tests.writers.models` for 4
steps, twice:

1. `trainer/`: `transformers.Trainer` with `TrainingArguments(deepspeed=ZERO2)` (a ZeRO-2 config dict with the
   batch sizes left "auto"), `save_steps=2`: `checkpoint-2/` and `checkpoint-4/`, each with `global_stepN/`
   and `latest` beside the Trainer's files (`model.safetensors`, `scheduler.pt`, `rng_state_{0,1}.pth`,
   `training_args.bin`, `trainer_state.json`), on `trainer_writer`'s data set. The model trains in fp32: transformers 5.24 refuses
   `bf16=True` without a GPU unless `use_cpu=True`, and `use_cpu=True` turns DeepSpeed off.
2. `accelerate/`: `Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))` with automatic checkpoint
   naming, `save_state()` every 2 steps: `checkpoints/checkpoint_{0,1}/`, each with the DeepSpeed tag
   `pytorch_model/` + `latest`, `scheduler.bin` and `random_states_{0,1}.pkl` (the training loop of
   `accelerate_writer`).

Both go through accelerate's `PartialState`, which (accelerate 1.15, `accelerate/state.py`,
`PartialState._prepare_backend`) picks a distributed backend for a run that is not `cpu=True` only among
accelerator devices (nccl on CUDA, ...): without one it records `DistributedType.NO` and one process, while
DeepSpeed's process group has 2 ranks (the Trainer's "auto" batch sizes then disagree with DeepSpeed's, and
accelerate would not shard the data). `cpu=True` is no way out: `AcceleratorState` turns DeepSpeed on only
when not `cpu`. So the ranks replace that one method by what it answers for CPU ranks (`gloo`,
`DistributedType.MULTI_CPU`), in place of the GPU's `nccl`; everything else, the saves included, is the
frameworks' own code.

Then rank 0 runs DeepSpeed 0.19.8's `ds_to_universal` (`main` and its argument parser, with
`--inject_missing_state`, as `universal_writer` does) on the latest tag of each: `universal/trainer/global_step4/`
and `universal/accelerate/pytorch_model/` (each beside its `latest_universal`).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.writers.ranks import run_ranks

__all__ = ["WrittenWrapperRuns", "write_wrapper_runs"]

WORLD_SIZE = 2
STEPS = 4
SAVE_EVERY = 2
#: The DeepSpeed config the Trainer is given (`TrainingArguments(deepspeed=...)`); the Trainer fills "auto".
ZERO2: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "zero_optimization": {"stage": 2},
    # The Trainer's torch AdamW rather than DeepSpeed's FusedAdam, which would compile an op first.
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10_000,
}


@dataclass(frozen=True)
class WrittenWrapperRuns:
    """What the two runs wrote.

    Attributes:
        trainer: the Trainer's `output_dir` (`checkpoint-2/`, `checkpoint-4/`).
        accelerate: accelerate's `project_dir` (`checkpoints/checkpoint_0/`, `checkpoints/checkpoint_1/`).
        universal: `ds_to_universal`'s output folders: `trainer/global_step4/`, `accelerate/pytorch_model/`.
    """

    trainer: Path
    accelerate: Path
    universal: Path

    @property
    def trainer_checkpoint(self) -> Path:
        """The Trainer's last checkpoint (`global_step4/` inside)."""
        return self.trainer / f"checkpoint-{STEPS}"

    @property
    def accelerate_checkpoint(self) -> Path:
        """accelerate's last `save_state` folder (`pytorch_model/` inside)."""
        return self.accelerate / "checkpoints" / f"checkpoint_{STEPS // SAVE_EVERY - 1}"


def _train_with_trainer(out: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from tests.writers.models import tiny_llama
    from tests.writers.trainer_writer import token_dataset

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        save_steps=SAVE_EVERY,
        save_strategy="steps",
        per_device_train_batch_size=2,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        deepspeed=ZERO2,
        ddp_backend="gloo",
    )
    Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset()).train()


def _train_with_accelerate(out: Path) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, ProjectConfiguration, set_seed

    from tests.writers.accelerate_writer import _train

    AcceleratorState._reset_state(reset_partial_state=True)  # the Trainer's
    set_seed(0)
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1)
    project = ProjectConfiguration(project_dir=str(out), automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=project, deepspeed_plugin=plugin)

    def save_state(step: int, loader: Any) -> None:
        if step % SAVE_EVERY == 0:
            accelerator.save_state()

    _train(accelerator, STEPS, save_state)


def _ds_to_universal(tag: Path, output: Path) -> None:
    from deepspeed.checkpoint.ds_to_universal import main, parse_arguments

    sys.argv = [
        "ds_to_universal",
        "--input_folder",
        str(tag),
        "--output_folder",
        str(output),
        "--inject_missing_state",
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
        main(parse_arguments())


def _cpu_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
    """`PartialState._prepare_backend`'s answer for CPU ranks, in place of a GPU's (see the module's docstring)."""
    from accelerate.utils import DistributedType

    return "gloo", DistributedType.MULTI_CPU


def _worker(rank: int, port: int, root: str) -> None:
    import deepspeed
    from accelerate.state import PartialState

    from tests.writers.deepspeed_ranks import join_deepspeed_ranks

    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    join_deepspeed_ranks(rank, WORLD_SIZE, port)
    PartialState._prepare_backend = _cpu_backend  # type: ignore[method-assign]
    base = Path(root)
    _train_with_trainer(base / "trainer")
    _train_with_accelerate(base / "accelerate")
    deepspeed.comm.barrier()
    if rank == 0:
        written = _written(base)
        _ds_to_universal(
            written.trainer_checkpoint / f"global_step{STEPS}", written.universal / "trainer" / f"global_step{STEPS}"
        )
        _ds_to_universal(
            written.accelerate_checkpoint / "pytorch_model", written.universal / "accelerate" / "pytorch_model"
        )
    deepspeed.comm.barrier()


def _written(root: Path) -> WrittenWrapperRuns:
    return WrittenWrapperRuns(root / "trainer", root / "accelerate", root / "universal")


def write_wrapper_runs(root: Path) -> WrittenWrapperRuns:
    """Train and save both runs in 2 spawned ranks and convert their latest tags (about 20 s on 2 cores); use it
    from a session-scoped fixture."""
    from tests.writers.deepspeed_writer import _free_port

    root.mkdir(parents=True, exist_ok=True)
    run_ranks(_worker, (_free_port(), str(root)), WORLD_SIZE)
    return _written(root)
