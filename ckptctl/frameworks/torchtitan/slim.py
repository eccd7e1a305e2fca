"""torchtitan's slimmer (`SLIMMER`): not yet; it says why (`layouts.parts.dcp_slim`)."""

from __future__ import annotations

from ckptctl.layouts.parts.dcp_slim import DcpSlimmer

__all__ = ["SLIMMER"]

SLIMMER = DcpSlimmer()
