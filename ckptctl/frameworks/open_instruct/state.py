"""open-instruct's training state (`TrainingStateSource`): its ZeRO 1-3 tag parameter by parameter, the fp32 masters and
Adam's moments named by the module's parameters (`families.zero_tag.state`), what `reshard --to dcp` reads."""

from __future__ import annotations

from ckptctl.families.zero_tag.state import zero_tag_state as SOURCE

__all__ = ["SOURCE"]
