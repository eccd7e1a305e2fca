"""Slimming a torch DCP folder (`slim`): not done yet, and said so. The model and the optimizer state of a
DCP save share its data files (`__R_N.distcp`, one per rank, each item a record of them) and one `.metadata`
indexing them all: dropping the optimizer means writing the model items into new data files and a new
`.metadata`, streamed, which `slim` does not do yet. Until it does, DCP, torchtitan and Megatron dist-ckpt
checkpoints are kept whole with this reason, rather than cut by a half implementation."""

from __future__ import annotations

from ckptctl.checkpoint import Checkpoint, Problem
from ckptctl.errors import CkptctlError
from ckptctl.layouts.capabilities import SlimRecipe

__all__ = ["DCP_REFUSAL", "DcpSlimmer"]

DCP_REFUSAL = (
    "its model and optimizer state share the DCP data files and .metadata: slimming it means rewriting the "
    "model items into new data files and a new .metadata, which slim does not do yet"
)


class DcpSlimmer:
    """The `Slimmer` of the DCP-based layouts: it refuses every checkpoint, saying why (see the module)."""

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        return DCP_REFUSAL

    def recipe(self, checkpoint: Checkpoint) -> SlimRecipe:
        raise CkptctlError(f"{checkpoint.url} cannot be slimmed: {DCP_REFUSAL}")

    def expected(self, problem: Problem) -> bool:
        return False
