"""Megatron dist-ckpt's slimmer (`SLIMMER`): the model items kept, rewritten into new data files and a
new `.metadata` (`layouts.parts.dcp_slim`)."""

from __future__ import annotations

from ckptctl.layouts.parts.dcp_slim import DcpSlimmer

__all__ = ["SLIMMER"]

SLIMMER = DcpSlimmer()
