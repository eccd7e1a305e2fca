"""The HF Trainer's slimmer (`SLIMMER`): a `checkpoint-N` keeps its model (`model.safetensors` or the
adapter, `config.json`), `trainer_state.json` (step, metrics, the best checkpoint) and `training_args.bin`;
the files only `Trainer.train(resume_from_checkpoint=...)` reads go: `optimizer.pt`, `scheduler.pt`,
`scaler.pt` and the `rng_state*.pth` of each process."""

from __future__ import annotations

from ckptctl.checkpoint import Checkpoint, Problem
from ckptctl.contract.capabilities import SlimRecipe
from ckptctl.frameworks.hf_trainer.files import RNG_FILE

__all__ = ["SLIMMER", "HfTrainerSlimmer"]

#: What each training-only file holds.
_TRAINING_ONLY = {"optimizer.pt": "optimizer", "scheduler.pt": "scheduler", "scaler.pt": "grad scaler"}


class HfTrainerSlimmer:
    """See the module docstring."""

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        folders = sorted({rel.split("/", 1)[0] for rel in checkpoint.files if "/" in rel})
        if folders:
            return (
                f"it holds {', '.join(folders)} (a DeepSpeed tag or FSDP folders): slim cuts plain Trainer "
                "checkpoints only yet"
            )
        if not self.recipe(checkpoint).drop:
            return "it holds no training-only state"
        return None

    def recipe(self, checkpoint: Checkpoint) -> SlimRecipe:
        drop = sorted(rel for rel in checkpoint.files if rel in _TRAINING_ONLY or RNG_FILE.match(rel))
        dropped = sorted({_TRAINING_ONLY.get(rel, "rng") for rel in drop})
        return SlimRecipe(drop=tuple(drop), dropped=tuple(dropped))

    def expected(self, problem: Problem) -> bool:
        return False


SLIMMER = HfTrainerSlimmer()
