"""How a torch DCP checkpoint resumes (`dcp.load`): it reshards onto any number of ranks, and a folder
overwritten in place can hold new data under its old `.metadata` (`families.dcp_resume`, which the
plugins that keep DCP folders inside their checkpoints share).
"""

from __future__ import annotations

from ckptctl.contract.resume import PlanContext, ResumeProfile
from ckptctl.families.dcp_resume import overwrite_warnings, reshards
from ckptctl.quoting import Code, python_call

__all__ = ["PROFILE"]


def _hint(ctx: PlanContext) -> str:
    return python_call("dcp.load", Code("state"), checkpoint_id=ctx.url)


PROFILE = ResumeProfile(
    framework="torch.distributed.checkpoint", hint=_hint, world_size=reshards, traps=overwrite_warnings
)
