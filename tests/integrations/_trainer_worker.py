"""Train the tiny Llama with `transformers.Trainer` for 5 steps, saving and evaluating every step, with a
`CkptctlCallback(RetentionPolicy(keep_last=2))`. The best checkpoint is the one with the *highest*
eval loss (`greater_is_better=True`), so that it is an old one that only its protection keeps.

`write_run` runs it in a process of its own (keeping accelerate's process-wide state and the Trainer's seeding
out of the test process), or `python -m tests.integrations._trainer_worker OUT_DIR`; the last retention
report's JSON goes beside OUT_DIR (`last-prune.json`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.writers.ranks import run_ranks

STEPS = 5
KEEP_LAST = 2


def main(output_dir: str) -> None:
    import torch
    from transformers import Trainer, TrainingArguments

    from ckptctl.core import RetentionPolicy
    from ckptctl.integrations.transformers import CkptctlCallback
    from tests.writers.models import tiny_llama

    generator = torch.Generator().manual_seed(0)
    dataset = []
    for _ in range(16):
        ids = torch.randint(0, 128, (16,), generator=generator)
        dataset.append({"input_ids": ids, "labels": ids})
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=STEPS,
        save_steps=1,
        save_strategy="steps",
        eval_strategy="steps",
        eval_steps=1,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    callback = CkptctlCallback(RetentionPolicy(keep_last=KEEP_LAST))
    Trainer(
        model=tiny_llama(), args=args, train_dataset=dataset, eval_dataset=dataset[:8], callbacks=[callback]
    ).train()
    assert callback.last_prune is not None
    Path(output_dir).with_name("last-prune.json").write_text(json.dumps(callback.last_prune.to_json()))


def _main_process(_rank: int, output_dir: str) -> None:
    main(output_dir)


def write_run(root: Path) -> tuple[Path, dict[str, Any]]:
    """Run `main` into `root/out` in a process of its own (forked from the writers' pre-imported server,
    `tests.writers.ranks`: the Trainer's process-wide state stays there): the output folder and the last
    retention report."""
    output_dir = root / "out"
    run_ranks(
        _main_process, (str(output_dir),), 1, environment={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    )
    return output_dir, json.loads((root / "last-prune.json").read_text())


if __name__ == "__main__":
    main(sys.argv[1])
