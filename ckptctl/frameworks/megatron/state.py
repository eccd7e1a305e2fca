"""Why a Megatron dist-ckpt's training state is not read parameter by parameter (`TrainingStateSource`), so that
`reshard --to dcp` refuses it saying so rather than "not supported".

What megatron-core 0.16 saves (`MegatronOptimizer.sharded_state_dict`, `dist_checkpointing.optimizer.
optim_state_to_sharding_state`): the Adam moments by parameter name (`optimizer.state.exp_avg.<name>`), one step
count for all (`common_step` in common.pt), and each group's settings with its parameters left out (`params`
becomes a `LocalNonpersistentObject`: at load megatron-core rebuilds the groups from its own code and the run's
arguments, `_get_param_groups`, with weight-decay and learning-rate multipliers per group). So:

- which parameter is in which group is not in the checkpoint; a one-group save would be plain, but nothing marks a
  save as one (the groups' count is, their members are not);
- the tensors are megatron-core's own (layers stacked on a leading axis, fused `linear_qkv` and SwiGLU
  `linear_fc1`): a transformers model, what an FSDP2 trainer builds, needs the q/k/v and gate/up rows of each
  weight and of each moment (exact, AdamW's state being elementwise, with the row layout `convert --to hf` uses),
  which no load has proved yet.

Until a load proves the mapping, the state is refused; the model alone converts (`convert --to dcp`).
"""

from __future__ import annotations

from ckptctl.checkpoint import Checkpoint, Component
from ckptctl.contract.capabilities import ParamState
from ckptctl.errors import CkptctlError
from ckptctl.quoting import shell

__all__ = ["SOURCE"]


def SOURCE(checkpoint: Checkpoint) -> ParamState:
    # The refusal reaches the user as the writer's reason alone (no hint), so the way out is in the message.
    instead = f"convert the model alone ({shell('ckptctl', 'convert', checkpoint.url, 'DST', '--to', 'dcp')})"
    if Component.OPTIMIZER not in checkpoint.components:
        raise CkptctlError(f"{checkpoint.url}: a Megatron save without optimizer state (--no-save-optim): {instead}")
    raise CkptctlError(
        f"{checkpoint.url}: megatron-core saves its optimizer's param_groups without their parameters (it rebuilds "
        "them from its own code and the run's arguments at load), so which parameter has which weight decay and "
        "learning-rate multiplier is not in the checkpoint; and its fused linear_qkv / linear_fc1 tensors and their "
        "Adam moments are not proved to map onto the parameters of a model another framework builds (an FSDP2 "
        f"trainer's transformers model): {instead}, or resume with Megatron"
    )
