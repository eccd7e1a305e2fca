"""ROLL's slimmer (`SLIMMER`): each role of a `checkpoint-N/` (the actor at the top, `critic/`) keeps its model,
and what only `resume_from_checkpoint` reads goes.

- FSDP2: the role's HF weights stay; its `dcp/` save (`{**model.state_dict(), "optimizer": ..., "scheduler": ...,
  "rng_state": ...}`, roll `distributed/strategy/fsdp2_strategy.py`) keeps its model items and loses the
  others (`families.dcp_slim`).
- Megatron (mcore_adapter): the iteration's `dist_optimizer/` Megatron dist-ckpt folder, `scheduler.pt` and the
  per-rank `rng_state/` files go; `dist_model/` stays. A legacy save (`mp_rank_*/model_optim_rng.pt`) keeps
  its optimizer inside the model file and is kept whole.
- The pipeline's RNG state (`pipeline/rng_state_pipeline.pth`) goes; its counters and log
  (`pipeline/worker_state_pipeline.json`, what tells a finished upload) stay.
"""

from __future__ import annotations

import re

from ckptctl import io
from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import SlimRecipe, SlimRewrite
from ckptctl.contract.rewrites import OneLookSlimmer
from ckptctl.families.dcp_slim import slim_dcp_folder
from ckptctl.frameworks.roll.files import CRITIC, DCP_FOLDER, PIPELINE_RNG, RNG_DIR

__all__ = ["SLIMMER", "RollSlimmer"]

_ITER_FILE = re.compile(r"^(?:iter_\d{7}|release)/(dist_optimizer|mp_rank_[^/]+)/")


class RollSlimmer(OneLookSlimmer):
    """See the module docstring."""

    def decide(self, checkpoint: Checkpoint) -> SlimRecipe | str:
        return _recipe(checkpoint)


def _recipe(checkpoint: Checkpoint) -> SlimRecipe | str:
    files = checkpoint.files
    drop: list[str] = []
    dropped: set[str] = set()
    rewrites: list[SlimRewrite] = []
    shed = 0
    for role in ("", f"{CRITIC}/"):
        own = {
            rel[len(role) :]
            for rel in files
            if rel.startswith(role) and not (role == "" and rel.startswith(f"{CRITIC}/"))
        }
        if not own:
            continue
        where = role or "the actor"
        if any(m and m.group(1).startswith("mp_rank_") for m in map(_ITER_FILE.match, own)):
            return f"{where}: a legacy Megatron save keeps the optimizer inside mp_rank_*/model_optim_rng.pt"
        if f"{DCP_FOLDER}/.metadata" in own:
            found = slim_dcp_folder(io.join(checkpoint.url, role + DCP_FOLDER), files, prefix=f"{role}{DCP_FOLDER}/")
            if isinstance(found, str):
                return f"{where}'s {DCP_FOLDER}/: {found}"
            drop += found.drop
            dropped |= set(found.dropped)
            rewrites += found.rewrites
            shed += found.shed_bytes
        optimizer = sorted(role + rel for rel in own if (m := _ITER_FILE.match(rel)) and m.group(1) == "dist_optimizer")
        if optimizer:
            drop += optimizer
            dropped.add("optimizer")
        if "scheduler.pt" in own:
            drop.append(f"{role}scheduler.pt")
            dropped.add("scheduler")
        rng = sorted(role + rel for rel in own if rel.startswith(f"{RNG_DIR}/"))
        if rng:
            drop += rng
            dropped.add("rng")
    if PIPELINE_RNG in files:
        drop.append(PIPELINE_RNG)
        dropped.add("rng")
    if not rewrites and not any(not rel.endswith(".pth") for rel in drop):
        return "it holds no optimizer state (a model-only save): nothing to slim"
    return SlimRecipe(tuple(sorted(drop)), tuple(sorted(dropped)), tuple(rewrites), shed)


SLIMMER = RollSlimmer()
