"""verl's slimmer (`SLIMMER`): a `global_step_N/` keeps each role's model shards (`model_world_size_W_rank_R.pt`),
`fsdp_config.json` and `huggingface/` (config, tokenizer); what only a resume reads goes: each role's optimizer
shards (`optim_world_size_W_rank_R.pt`), its `extra_state_world_size_W_rank_R.pt` (LR scheduler and RNG of each
rank) and the dataloader's `data.pt`."""

from __future__ import annotations

import re

from ckptctl.checkpoint import Checkpoint, Problem
from ckptctl.contract.capabilities import SlimRecipe

__all__ = ["SLIMMER", "VerlSlimmer"]

#: A role's rank file of training-only state -> what it holds.
_RANK_FILE = re.compile(r"^(?:[^/]+/)?(optim|extra_state)_world_size_\d+_rank_\d+\.pt$")
_HOLDS = {"optim": "optimizer", "extra_state": "scheduler and rng"}
_DATALOADER = "data.pt"


class VerlSlimmer:
    """See the module docstring."""

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        if not any(rel.rpartition("/")[2].startswith("model_world_size_") for rel in checkpoint.files):
            return "it holds no FSDP model shards (a Megatron or an LoRA-only save): slim cuts FSDP saves only yet"
        if not self.recipe(checkpoint).drop:
            return "it holds no training-only state"
        return None

    def recipe(self, checkpoint: Checkpoint) -> SlimRecipe:
        drop: list[str] = []
        dropped: set[str] = set()
        for rel in sorted(checkpoint.files):
            if m := _RANK_FILE.match(rel):
                drop.append(rel)
                dropped.add(_HOLDS[m.group(1)])
            elif rel == _DATALOADER:
                drop.append(rel)
                dropped.add("dataloader")
        return SlimRecipe(drop=tuple(drop), dropped=tuple(sorted(dropped)))

    def expected(self, problem: Problem) -> bool:
        return False


SLIMMER = VerlSlimmer()
