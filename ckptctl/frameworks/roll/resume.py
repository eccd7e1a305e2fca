"""How ROLL resumes (`resume_from_checkpoint: <path>`): an explicit path, across the launch folders of
one run. The FSDP2 strategy reloads the torch DCP folder `dcp/` with `dcp.load`, which reshards onto the
resumed run's ranks (alibaba/ROLL `roll/distributed/strategy/fsdp2_strategy.py`, `load_checkpoint` →
`_load_checkpoint_with_dcp`: `dcp.load(state_dict={**model.state_dict(), "optimizer", "scheduler",
"rng_state"}, checkpoint_id=<checkpoint>/dcp)`, the state dict of the new run's sharded model)."""

from __future__ import annotations

import re

from ckptctl import io
from ckptctl.contract.resume import PlanContext, ResumeProfile, WorldSizeCheck, target_ranks, unchecked_world_size
from ckptctl.errors import CkptctlError
from ckptctl.families.dcp_resume import overwrite_warnings
from ckptctl.formats.dcp_folder_metadata import load_dcp_metadata
from ckptctl.formats.dcp_metadata import METADATA_NAME
from ckptctl.frameworks.roll.files import DCP_FOLDER
from ckptctl.quoting import yaml_value

__all__ = ["PROFILE"]

_DCP_PREFIX = f"{DCP_FOLDER}/"


def _run(url: str) -> str:
    """ROLL writes each launch into a new `YYYYmmdd-HHMMSS` folder: the run is the folder above them."""
    parent = io.parent_of(url)
    return io.parent_of(parent) if re.fullmatch(r"\d{8}-\d{6}", io.name_of(parent)) else parent


def _hint(ctx: PlanContext) -> str:
    return f"resume_from_checkpoint: {yaml_value(ctx.url)}"


def _world_size(ctx: PlanContext) -> WorldSizeCheck:
    """The actor's `dcp/` reshards onto any number of ranks (each reads its part of the tensors stored
    there); without one (the Megatron strategy) the rules are not checked."""
    checkpoint = ctx.checkpoint
    if _DCP_PREFIX + METADATA_NAME not in checkpoint.files:
        return unchecked_world_size(ctx)
    saved = checkpoint.world_size
    target = target_ranks(ctx, saved) or 1
    # The actor's workers read the actor's dcp/ (the critic's workers read critic/dcp/ on their own ranks);
    # from its metadata, since the tensor index names the HF weights beside it for the model.
    try:
        stored: int | None = sum(t.nbytes for _, t in load_dcp_metadata(io.join(ctx.url, DCP_FOLDER)).tensors())
    except CkptctlError:
        stored = None
    return WorldSizeCheck(
        saved,
        target,
        True,
        f"ROLL's FSDP2 strategy reloads {DCP_FOLDER}/ with torch DCP, which reshards at load: {target} rank(s) "
        "each read their part",
        bytes_per_rank=None if stored is None else stored // target,
    )


PROFILE = ResumeProfile(framework="ROLL", hint=_hint, world_size=_world_size, run_of=_run, traps=overwrite_warnings)
