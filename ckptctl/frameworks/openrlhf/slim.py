"""OpenRLHF's slimmer (`SLIMMER`): an actor's or critic's ZeRO tag loses its optimizer partitions and keeps its fp32 master weights
as a model file beside the model states (`families.zero_tag.slim`)."""

from __future__ import annotations

from ckptctl.families.zero_tag.slim import TagSlimmer

__all__ = ["SLIMMER"]

SLIMMER = TagSlimmer()
