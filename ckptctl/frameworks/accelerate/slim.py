"""accelerate's slimmer (`SLIMMER`): a `save_state` folder keeps its model (the model file, or the DeepSpeed
tag's model states with its fp32 master weights kept as a model file: `families.zero_tag.slim`), its
`random_states_{i}.pkl` (the files written last, which tell a finished save: tiny) and its sampler state;
the optimizer's and schedulers' files go (`optimizer[_i].bin`, `scheduler[_i].bin`, the tag's partitions).
FSDP saves (DCP folders, per-process files) are kept whole, saying why."""

from __future__ import annotations

import re

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, Problem
from ckptctl.contract.capabilities import OneLookSlimmer, SlimRecipe
from ckptctl.families.zero_tag.slim import expected_tag_problem, tag_slim
from ckptctl.frameworks.accelerate.files import FSDP_RANK_FILE
from ckptctl.frameworks.accelerate.layout import SaveStateParts

__all__ = ["SLIMMER", "AccelerateSlimmer"]

_TRAINING_ONLY = re.compile(r"^(optimizer|scheduler)(?:_\d+)?\.bin$")


class AccelerateSlimmer(OneLookSlimmer):
    """See the module docstring."""

    def expected(self, problem: Problem) -> bool:
        return expected_tag_problem(problem)

    def decide(self, checkpoint: Checkpoint) -> SlimRecipe | str:
        names = {rel for rel in checkpoint.files if "/" not in rel}
        tag = SaveStateParts.of(io.list_dir(checkpoint.url)).ds_tags.get(0)
        folders = sorted({rel.split("/", 1)[0] for rel in checkpoint.files if "/" in rel} - {tag})
        if folders or any(FSDP_RANK_FILE.match(name) for name in names):
            return "an FSDP save (DCP folders or per-process files): slim cuts plain and DeepSpeed saves only yet"
        drop = sorted(name for name in names if _TRAINING_ONLY.match(name))
        dropped = {_TRAINING_ONLY.match(name).group(1) for name in drop}  # type: ignore[union-attr]
        rewrites: tuple = ()
        if tag is not None:
            in_tag = tag_slim(checkpoint, f"{tag}/")
            if isinstance(in_tag, str):
                return in_tag
            drop += in_tag.drop
            dropped |= set(in_tag.dropped)
            rewrites = in_tag.rewrites
        if not drop:
            return "it holds no training-only state"
        return SlimRecipe(drop=tuple(sorted(drop)), dropped=tuple(sorted(dropped)), rewrites=rewrites)


SLIMMER = AccelerateSlimmer()
