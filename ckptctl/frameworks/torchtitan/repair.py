"""torchtitan keeps no pointer: `CheckpointManager.load` resumes from `_find_load_step` (torchtitan/
components/checkpointer/dcp.py), the highest `step-N` (its pattern searched, not anchored) holding `.metadata`
or `model.safetensors.index.json`."""

from __future__ import annotations

import re

from ckptctl.families.pointers import PicksNewestByName

POINTER_WRITER = PicksNewestByName(re.compile(r"step-(\d+)"), (".metadata", "model.safetensors.index.json"))
