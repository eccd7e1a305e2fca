"""The training state of a DCP folder saved as `get_state_dict` gives it (`{"model": ..., "optim": ...}`),
parameter by parameter (`TrainingStateSource`): what `reshard --to dcp` re-chunks."""

from __future__ import annotations

from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import ParamState
from ckptctl.families.dcp_state import dcp_param_state

__all__ = ["SOURCE"]


def SOURCE(checkpoint: Checkpoint) -> ParamState:
    return dcp_param_state(checkpoint, "", model_keys=("model",), optimizer_keys=("optim", "optimizer"))
