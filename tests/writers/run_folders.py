"""Run folders that are a checkpoint AND hold checkpoints: a model exported beside the steps of a run.

- the HF Trainer's `output_dir` after `trainer.save_model()` (`tests.writers.trainer_writer`, `saved_run`);
- `write_dcp_run`: a DCP run of the tiny Llama (`step-2/`, `step-4/`, each a real `dcp.save` of
  `{"model": ..., "optim": ...}` after that many AdamW steps, as torchtitan saves) with the final model
  exported by transformers' `save_pretrained` into the run folder itself;
- `arrange_deepspeed_run`: a copy of a DeepSpeed save folder (`latest`, `global_step2/`, `global_step4/`)
  with DeepSpeed's own fp32 reconstruction of its latest tag as `model.safetensors` and the model's
  `config.json` beside the tags (what `zero_to_fp32.py` and an export leave there).

`NestedRun` says what each holds, for the tests that run every command on them.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.trainer_writer import WrittenTrainerRun

__all__ = ["NestedRun", "arrange_deepspeed_run", "trainer_nested_run", "write_dcp_run"]


@dataclass(frozen=True)
class NestedRun:
    """A run folder holding a model at its top and checkpoints below it.

    Attributes:
        path: the run folder (itself an HF model folder).
        checkpoints: the checkpoint folders inside it, oldest first.
        layout: the layout of those checkpoints.
        model_files: the files of the model at the top (what no command may touch but `convert` reads).
    """

    path: Path
    checkpoints: tuple[str, ...]
    layout: str
    model_files: tuple[str, ...]

    @property
    def newest(self) -> str:
        return self.checkpoints[-1]


def _model_files(path: Path) -> tuple[str, ...]:
    return tuple(sorted(p.name for p in path.iterdir() if p.is_file()))


def trainer_nested_run(run: WrittenTrainerRun) -> NestedRun:
    """The Trainer's run folder after `trainer.save_model()`."""
    return NestedRun(run.saved_run, ("checkpoint-2", "checkpoint-4"), "hf_trainer", _model_files(run.saved_run))


def write_dcp_run(path: Path) -> NestedRun:
    """A torchtitan-style DCP run of the tiny Llama with the final model exported into the run folder."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tests.writers.models import tiny_llama

    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for step in range(1, 5):
        ids = torch.randint(0, 128, (2, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 2 == 0:
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "no process group: saving in non-distributed mode"
                dcp.save(state, checkpoint_id=str(path / f"step-{step}"))
    model.save_pretrained(path)
    return NestedRun(path, ("step-2", "step-4"), "dcp", _model_files(path))


def arrange_deepspeed_run(written: WrittenDeepSpeed, path: Path) -> NestedRun:
    """A copy of a DeepSpeed save folder with its exported fp32 model and config beside the tags."""
    from tests.writers.models import tiny_llama

    shutil.copytree(written.save_dir, path, symlinks=True)
    shutil.copyfile(written.reference, path / "model.safetensors")
    tiny_llama().config.to_json_file(str(path / "config.json"))
    return NestedRun(path, written.tags, "deepspeed", _model_files(path))
