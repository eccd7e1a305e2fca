"""How ROLL resumes (`resume_from_checkpoint: <path>`): an explicit path, across the launch folders of
one run."""

from __future__ import annotations

import re

from ckptctl import io
from ckptctl.frameworks.dcp.resume import overwrite_warnings
from ckptctl.layouts.resume import PlanContext, ResumeProfile, unchecked_world_size

__all__ = ["PROFILE"]


def _run(url: str) -> str:
    """ROLL writes each launch into a new `YYYYmmdd-HHMMSS` folder: the run is the folder above them."""
    parent = io.parent_of(url)
    return io.parent_of(parent) if re.fullmatch(r"\d{8}-\d{6}", io.name_of(parent)) else parent


def _hint(ctx: PlanContext) -> str:
    return f"resume_from_checkpoint: {ctx.url}"


PROFILE = ResumeProfile(
    framework="ROLL", hint=_hint, world_size=unchecked_world_size, run_of=_run, traps=overwrite_warnings
)
