"""open-instruct's slimmer (`SLIMMER`): its ZeRO tag loses its optimizer partitions and keeps its fp32 master weights
as a model file beside the model states (`layouts.parts.zero_tag.slim`)."""

from __future__ import annotations

from ckptctl.layouts.parts.zero_tag.slim import TagSlimmer

__all__ = ["SLIMMER"]

SLIMMER = TagSlimmer()
