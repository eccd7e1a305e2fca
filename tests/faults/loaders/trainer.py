"""The HF Trainer's own resume path (transformers/trainer.py), on one Trainer reused for every cell:
`Trainer.train` with `resume_from_checkpoint` runs, in this order, `_load_from_checkpoint` (the model, or for a
PEFT model its adapter through `load_adapter`), `TrainerState.load_from_json` (only when trainer_state.json is
there: `_init_training_state`, else a fresh state without a word), `_load_optimizer_and_scheduler`,
`_load_scaler` and `_load_rng_state` (a missing rng file is only logged at info level). Before each cell the
model gets its initial weights back, the optimizer and scheduler are created afresh and the generators are
reseeded, so that whatever a load skips shows as different from the undamaged copy's load.

`build_plain` judges `checkpoint-4` of the tiny Llama run, `build_peft` `checkpoint-2` of the PEFT (LoRA) run
(`tests.writers.trainer_writer`).
"""

from __future__ import annotations

import dataclasses
import os
import random
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.faults.cells import loader_verdicts
from tests.faults.loaders.common import run

_trainer: Any = None
_initial: dict[str, Any] = {}


def _make_trainer(options: Mapping[str, Any]) -> Any:
    import torch
    import transformers
    from transformers import Trainer, TrainingArguments

    from tests.writers.trainer_writer import token_dataset

    transformers.utils.logging.set_verbosity_warning()
    torch.manual_seed(0)
    if options["peft_base"]:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(options["peft_base"]), config)
    else:
        from tests.writers.models import tiny_llama

        model = tiny_llama()
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="ckptctl-faults-trainer-"),
        max_steps=options["max_steps"],
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset())
    _initial.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    return trainer


def load(path: str, options: Mapping[str, Any]) -> Any:
    import numpy as np
    import torch
    from transformers.trainer_callback import TrainerState

    global _trainer
    if _trainer is None:
        _trainer = _make_trainer(options)
    trainer = _trainer
    trainer.model.load_state_dict(_initial)
    trainer.optimizer = trainer.lr_scheduler = None
    trainer.create_optimizer_and_scheduler(num_training_steps=options["max_steps"])
    trainer.state = TrainerState()
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)

    trainer._load_from_checkpoint(path)
    state_file = os.path.join(path, "trainer_state.json")
    if os.path.isfile(state_file):
        trainer.state = TrainerState.load_from_json(state_file)
    trainer._load_optimizer_and_scheduler(path)
    trainer._load_scaler(path)
    trainer._load_rng_state(path)
    return {
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.lr_scheduler.state_dict(),
        "trainer_state": {k: v for k, v in dataclasses.asdict(trainer.state).items() if k != "stateful_callbacks"},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }


def build_plain(checkpoint: Path, _out: Path) -> dict[str, str]:
    """The Trainer's verdict on each cell of a `checkpoint-N` of the tiny Llama run (4 steps)."""
    return loader_verdicts(__name__, checkpoint, peft_base=None, max_steps=4, loggers=["transformers"])


def build_peft(checkpoint: Path, _out: Path) -> dict[str, str]:
    """The Trainer's verdict on each cell of a `checkpoint-N` of the PEFT run (2 steps, base `peft-base/`)."""
    base = str(checkpoint.parent.parent / "peft-base")
    return loader_verdicts(__name__, checkpoint, peft_base=base, max_steps=2, loggers=["transformers"])


if __name__ == "__main__":
    run(load)
