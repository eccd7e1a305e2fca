"""A Hugging Face Trainer checkpoint with both optimizer groups in use, and the Trainer's own resume from it: what
the `reshard --to dcp` proof of Trainer checkpoints compares with (`tests.writers.reshard_dcp_proof`).

`transformers.Trainer` trains the tiny Llama of `tests.writers.models` on CPU with its default torch AdamW and
`weight_decay=0.1`, so that its decay and no-decay groups (`Trainer.create_optimizer`) differ in more than their
members, for 4 steps saving `checkpoint-2/` and `checkpoint-4/`. Then a fresh Trainer resumes from `checkpoint-2`
(`train(resume_from_checkpoint=...)`, into another output folder) and records in `resume-record.pt`:

- `model`, `optim`: the state it resumed, taken at its first step before anything changed it: `model.state_dict()`
  and its optimizer's state by parameter name, as torch's `get_optimizer_state_dict` names it (by parameter identity,
  not by any rule about groups);
- `names_by_index`: the name of each parameter of its optimizer in torch's numbering (`optimizer.state_dict()`'s);
- `steps`: for steps 3 and 4, the batch it trained on, `num_items_in_batch`, the loss it computed and each group's
  learning rate.

The same runs again with tied input and output embeddings (`tie_word_embeddings=True`), into `tied/` beside
`untied/`. It runs in a subprocess (accelerate's process-wide state and the Trainer's seeds stay out of the test process).
Run directly: `python -m tests.writers.trainer_resume_writer OUT_DIR`.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.writers.ranks import run_ranks

__all__ = ["STEPS", "WEIGHT_DECAY", "WrittenTrainerResume", "WrittenTrainerResumes", "write_trainer_resume"]

WEIGHT_DECAY = 0.1
STEPS = 4
_SAVE_STEPS = 2


@dataclass(frozen=True)
class WrittenTrainerResume:
    """A Trainer run and the Trainer's own resume from its `checkpoint-2`.

    Attributes:
        output_dir: the Trainer's `output_dir` (`checkpoint-2/`, `checkpoint-4/`).
        record: `resume-record.pt` (module docstring), read with `torch.load(weights_only=True)`.
    """

    output_dir: Path
    record: Path

    @property
    def checkpoint(self) -> Path:
        """The checkpoint the resume starts from."""
        return self.output_dir / f"checkpoint-{_SAVE_STEPS}"


def _arguments(output_dir: Path, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        save_steps=_SAVE_STEPS,
        per_device_train_batch_size=2,
        weight_decay=WEIGHT_DECAY,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        **overrides,
    )


def _train(root: Path, tied: bool) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from transformers import Trainer

    from tests.writers.models import tiny_llama

    generator = torch.Generator().manual_seed(0)
    dataset = []
    for _ in range(16):
        ids = torch.randint(0, 128, (16,), generator=generator)
        dataset.append({"input_ids": ids, "labels": ids})
    Trainer(
        model=tiny_llama(tie_word_embeddings=tied),
        args=_arguments(root / "out", save_strategy="steps"),
        train_dataset=dataset,
    ).train()

    record: dict[str, Any] = {"steps": []}

    class RecordingTrainer(Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):  # type: ignore[no-untyped-def]
            if not record["steps"]:  # the first step after the resume: the state as the Trainer loaded it
                optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
                names = {id(p): name for name, p in model.named_parameters()}
                record["model"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
                # Copied: the state dict holds the optimizer's live tensors, which the next steps change.
                record["optim"] = copy.deepcopy(get_optimizer_state_dict(model, optimizer))
                record["names_by_index"] = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            record["steps"].append(
                {
                    "step": self.state.global_step + 1,
                    "inputs": {k: v.detach().clone() for k, v in inputs.items()},
                    "num_items_in_batch": num_items_in_batch,
                    "loss": loss.detach().clone(),
                    "lr": [group["lr"] for group in self.optimizer.param_groups],
                }
            )
            return loss

    resumed = RecordingTrainer(
        model=tiny_llama(tie_word_embeddings=tied),
        args=_arguments(root / "resumed", save_strategy="no"),
        train_dataset=dataset,
    )
    resumed.train(resume_from_checkpoint=str(root / "out" / f"checkpoint-{_SAVE_STEPS}"))
    torch.save(record, root / "resume-record.pt")


@dataclass(frozen=True)
class WrittenTrainerResumes:
    """The run of the tiny Llama (`untied`) and of the same with tied input and output embeddings (`tied`,
    `tie_word_embeddings=True`: save_pretrained leaves `lm_head.weight` out, and the optimizer numbers the shared
    parameter once)."""

    untied: WrittenTrainerResume
    tied: WrittenTrainerResume


def _train_both(_rank: int, root: str) -> None:
    _train(Path(root) / "untied", tied=False)
    _train(Path(root) / "tied", tied=True)


def write_trainer_resume(root: Path) -> WrittenTrainerResumes:
    """Run the Trainer and its resume, untied and tied, in a process of its own (forked from the writers'
    pre-imported server, `tests.writers.ranks`) and describe what they wrote."""
    run_ranks(_train_both, (str(root),), 1, environment={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    return WrittenTrainerResumes(
        *(WrittenTrainerResume(root / name / "out", root / name / "resume-record.pt") for name in ("untied", "tied"))
    )


if __name__ == "__main__":
    _train_both(0, sys.argv[1])
