"""Real Hugging Face Trainer checkpoints for tests, written by `transformers.Trainer` itself on CPU.

`write_trainer_run` trains the tiny Llama of `tests.writers.models` for 4 steps on a hand-made tokenized
dataset (no hub access) with `save_steps=2`, so that `checkpoint-2/` and `checkpoint-4/` exist with every
file the Trainer writes: model.safetensors + config, optimizer.pt, scheduler.pt, rng_state.pth,
training_args.bin and trainer_state.json. It runs in a subprocess, so that accelerate's process-wide
state and the seeds the Trainer sets stay out of the test process; the final weights are written as the
reference safetensors file (beside the output folder).

Then it copies the output folder and has `trainer.save_model()` write the final model into the copy: the
run folder that `run_clm.py` and most fine-tuning scripts leave behind (model.safetensors, config.json,
generation_config.json and training_args.bin beside `checkpoint-N/`), at the cost of one save.

Last, in the same process, the Trainer trains a PEFT model (`get_peft_model` of the tiny Llama loaded from
its `save_pretrained` folder `peft-base/`, LoRA r=4 on q_proj/v_proj, `init_lora_weights=False` so that the
adapter changes the model) for 2 steps with `save_steps=1`, beside the output folder in `peft-out/`: its
`checkpoint-N/` hold the adapter (adapter_model.safetensors + adapter_config.json, no model) with the
Trainer's files; PEFT's own `merge_and_unload()` of the final model is the reference
`peft-out.merged.safetensors`.

Run directly: `python -m tests.writers.trainer_writer OUT_DIR`.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.writers.ranks import run_ranks

__all__ = ["WrittenTrainerRun", "token_dataset", "write_trainer_run"]

STEPS = 4
SAVE_STEPS = 2


@dataclass(frozen=True)
class WrittenTrainerRun:
    """An HF Trainer output folder and what it must contain.

    Attributes:
        output_dir: the Trainer's `output_dir`, holding `checkpoint-2/` and `checkpoint-4/`.
        reference: safetensors of the model's final weights (those of `checkpoint-4`).
        model_parameters: elements of the model's parameters.
        saved_run: a copy of `output_dir` into which `trainer.save_model()` then wrote the final model.
    """

    output_dir: Path
    reference: Path
    model_parameters: int
    saved_run: Path

    @property
    def checkpoints(self) -> tuple[Path, ...]:
        return tuple(self.output_dir / f"checkpoint-{s}" for s in range(SAVE_STEPS, STEPS + 1, SAVE_STEPS))

    @property
    def peft_base(self) -> Path:
        """The base model folder the PEFT run loaded (its adapter_config.json names it)."""
        return self.output_dir.parent / "peft-base"

    @property
    def peft_run(self) -> Path:
        """The PEFT run's `output_dir`: `checkpoint-1/` and `checkpoint-2/`, adapters with the Trainer's files."""
        return self.output_dir.parent / "peft-out"

    @property
    def peft_merged(self) -> Path:
        """PEFT's `merge_and_unload().state_dict()` of the final model (`checkpoint-2`'s adapter), safetensors."""
        return self.output_dir.parent / "peft-out.merged.safetensors"


def token_dataset() -> list[dict[str, Any]]:
    """What the Trainer runs train on: 16 samples of 16 token ids from a fixed seed, each its own labels."""
    import torch

    generator = torch.Generator().manual_seed(0)
    dataset = []
    for _ in range(16):
        ids = torch.randint(0, 128, (16,), generator=generator)
        dataset.append({"input_ids": ids, "labels": ids})
    return dataset


def _train(output_dir: Path) -> None:
    from safetensors.torch import save_file
    from transformers import Trainer, TrainingArguments

    from tests.writers.models import tiny_llama

    model = tiny_llama()
    dataset = token_dataset()
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        save_steps=SAVE_STEPS,
        save_strategy="steps",
        per_device_train_batch_size=2,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(_reference_path(output_dir)))
    # What `trainer.save_model()` writes into `output_dir` (its default), written into a copy of the run so
    # that `output_dir` stays as `train()` left it.
    shutil.copytree(output_dir, _saved_run_path(output_dir))
    trainer.save_model(str(_saved_run_path(output_dir)))
    _train_peft(output_dir.parent, dataset)


def _train_peft(root: Path, dataset: list[dict[str, Any]]) -> None:
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from tests.writers.models import tiny_llama

    tiny_llama().save_pretrained(root / "peft-base")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "peft-base"), config)
    args = TrainingArguments(
        output_dir=str(root / "peft-out"),
        max_steps=2,
        save_steps=1,
        save_strategy="steps",
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    Trainer(model=model, args=args, train_dataset=dataset).train()
    merged = model.merge_and_unload().state_dict()
    save_file({k: v.detach().contiguous() for k, v in merged.items()}, str(root / "peft-out.merged.safetensors"))


def _reference_path(output_dir: Path) -> Path:
    # Beside the output folder: a safetensors file inside it would make the run folder look like a model.
    return output_dir.parent / f"{output_dir.name}.reference.safetensors"


def _saved_run_path(output_dir: Path) -> Path:
    return output_dir.parent / f"{output_dir.name}-saved"


def _train_process(_rank: int, output_dir: str) -> None:
    _train(Path(output_dir))


def write_trainer_run(output_dir: Path) -> WrittenTrainerRun:
    """Run the Trainer in a process of its own (forked from the writers' pre-imported server,
    `tests.writers.ranks`: the Trainer's and accelerate's process-wide state stays there) and describe what it
    wrote."""
    from tests.writers.models import tiny_llama

    run_ranks(
        _train_process, (str(output_dir),), 1, environment={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    )
    parameters = sum(p.numel() for p in tiny_llama().parameters())
    return WrittenTrainerRun(output_dir, _reference_path(output_dir), parameters, _saved_run_path(output_dir))


if __name__ == "__main__":
    _train(Path(sys.argv[1]))
