"""torch DCP's slimmer (`SLIMMER`): the model items kept, rewritten into new data files and a
new `.metadata` (`families.dcp_slim`)."""

from __future__ import annotations

from ckptctl.families.dcp_slim import DcpSlimmer

__all__ = ["SLIMMER"]

SLIMMER = DcpSlimmer()
