"""The proof of `reshard --to deepspeed-universal` from a Hugging Face Trainer `checkpoint-N`
(`ckptctl.frameworks.hf_trainer.state` read by `ckptctl.frameworks.deepspeed.universal_from_state`), on gloo CPU
ranks: a Trainer run moved onto DeepSpeed.

The sources are `tests.writers.trainer_resume_writer`'s (the tiny Llama, untied and tied embeddings), whose records
hold the state the Trainer's own resume from `checkpoint-2` holds and the batches and losses of its steps 3 and 4.

1. This process reshards each `checkpoint-2` (`ckptctl.ops.reshard`, `--to deepspeed-universal`): `<case>-out/`.
2. On 1 and on 2 gloo ranks, DeepSpeed 0.19.8 engines (the transformers class the checkpoint's config.json names,
   built from it with other initial weights; torch AdamW as the client optimizer in the Trainer's two groups,
   transformers' own `get_decay_parameter_names`; fp32, as the Trainer trained; `"gradient_clipping": 1.0`, the
   Trainer's `max_grad_norm`; `"load_universal": true`) load each output under ZeRO-1 and ZeRO-2, gather every
   parameter's fp32 master and moments (`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`), the groups'
   steps and settings and `global_steps`, then take the Trainer's step 3 on its recorded batch (each rank the same
   batch) and compute step 4's loss on its batch: `<case>-results-{W}.pt`. No LR scheduler: step 3 uses the learning
   rate the loaded groups hold, which is the Trainer's for that step; step 4's update is not taken, so the
   schedule's next value is never needed.
3. On 1 rank, a ZeRO-2 engine over the same class with untied embeddings loads the tied output: what it raises is
   `untied-model-load.txt` (the resume hint says such a load fails).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptctl.frameworks.deepspeed import universal_from_state
from tests.writers.deepspeed_ranks import join_deepspeed_ranks
from tests.writers.deepspeed_writer import _free_port
from tests.writers.ranks import run_ranks
from tests.writers.trainer_resume_writer import WEIGHT_DECAY

__all__ = ["STAGES", "TrainerToUniversalProof", "prove_trainer_to_universal"]

STAGES = (1, 2)
#: The Trainer's `max_grad_norm` (TrainingArguments' default, which the writer keeps).
MAX_GRAD_NORM = 1.0


@dataclass(frozen=True)
class TrainerToUniversalProof:
    """Per case (`untied`, `tied`), what the reshard reported (`files`, `not_carried` as (what, why) pairs,
    `resume_hint`), and what the DeepSpeed engines loaded and computed."""

    root: Path
    written: dict[str, dict[str, Any]]

    def results(self, case: str, world_size: int) -> dict[int, Any]:
        """ZeRO stage -> what the engines on `world_size` ranks loaded from `case`'s output and their losses."""
        return torch.load(self.root / f"{case}-results-{world_size}.pt", weights_only=True)  # written by the proof


def _engine(checkpoint: str, stage: int, **config_overrides: Any) -> Any:
    """A DeepSpeed engine over the model class config.json names (with `config_overrides`), with torch AdamW in the
    Trainer's groups."""
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer

    torch.manual_seed(1)  # other initial weights than the Trainer's: what is loaded must replace them all
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint, **config_overrides))
    decay = Trainer.__new__(Trainer).get_decay_parameter_names(model)
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": WEIGHT_DECAY},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": MAX_GRAD_NORM,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
        "checkpoint": {"load_universal": True},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups), config=config)
    return engine


def _load_and_step(checkpoint: str, folder: str, record: str, stage: int) -> dict[str, Any]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine = _engine(checkpoint, stage)
    path, _ = engine.load_checkpoint(folder, load_lr_scheduler_states=False)
    assert path is not None, f"nothing loaded from {folder}"
    state: dict[str, Any] = {}
    for name, param in engine.module.named_parameters():  # a tied parameter once, under its first name
        state[name] = {
            "fp32": safe_get_full_fp32_param(param).clone(),
            **{key: safe_get_full_optimizer_state(param, key).clone() for key in ("exp_avg", "exp_avg_sq")},
        }
    module = engine.module
    inner = engine.optimizer.optimizer  # the client AdamW, stepping ZeRO's flat fp32 partitions
    groups = [
        {
            "settings": {k: v for k, v in group.items() if k != "params"},
            "step": inner.state[group["params"][0]]["step"].clone(),
        }
        for group in inner.param_groups
    ]
    steps = torch.load(record, weights_only=True)["steps"]
    engine.train()
    losses = []
    for k, step in enumerate(steps):
        loss = engine(**step["inputs"], num_items_in_batch=step["num_items_in_batch"]).loss
        losses.append(float(loss))
        if k + 1 < len(steps):
            engine.backward(loss)
            engine.step()
    return {
        "state": state,
        "groups": groups,
        "global_steps": engine.global_steps,
        "tied": module.lm_head.weight is module.model.embed_tokens.weight,
        "losses": losses,
    }


def _rank(rank: int, world: int, port: int, root: str, *cases: str) -> None:
    join_deepspeed_ranks(rank, world, port)
    import deepspeed  # after joining, which picks DeepSpeed's CPU accelerator

    for name, checkpoint, record in zip(cases[::3], cases[1::3], cases[2::3], strict=True):
        results = {stage: _load_and_step(checkpoint, f"{root}/{name}-out", record, stage) for stage in STAGES}
        if rank == 0:
            torch.save(results, f"{root}/{name}-results-{world}.pt")
        if name == "tied" and world == 1:
            untied = _engine(checkpoint, 2, tie_word_embeddings=False)
            try:
                untied.load_checkpoint(f"{root}/{name}-out", load_lr_scheduler_states=False)
                raised = "nothing"
            except Exception as exc:  # what DeepSpeed raises is the finding
                raised = f"{type(exc).__name__}: {exc}"
            Path(f"{root}/untied-model-load.txt").write_text(raised)
    deepspeed.comm.barrier()


def prove_trainer_to_universal(root: Path, runs: dict[str, tuple[Path, Path]]) -> TrainerToUniversalProof:
    """Reshard each case's Trainer checkpoint (`runs`: name -> its checkpoint and the Trainer's resume record) into
    `root/<name>-out` and load them with DeepSpeed (the module)."""
    from ckptctl.ops.reshard import ReshardOptions, reshard

    assert universal_from_state.DS_VERSION == "0.19.8"  # named so that the writer cache's key covers the writer
    written: dict[str, dict[str, Any]] = {}
    for name, (checkpoint, _) in runs.items():
        result = reshard(str(checkpoint), str(root / f"{name}-out"), ReshardOptions(to="deepspeed-universal"))
        written[name] = {
            "files": result.files,
            "not_carried": [(n.what, n.why) for n in result.not_carried],
            "resume_hint": result.resume_hint,
        }
    cases = [str(value) for name, (checkpoint, record) in runs.items() for value in (name, checkpoint, record)]
    for world in (1, 2):
        run_ranks(_rank, (world, _free_port(), str(root), *cases), world)
    return TrainerToUniversalProof(root, written)
