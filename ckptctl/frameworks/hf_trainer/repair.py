"""The Trainer keeps no pointer: `resume_from_checkpoint=True` loads `get_last_checkpoint(output_dir)`
(transformers/trainer_utils.py), the folder named `checkpoint-N` with the highest N, complete or not."""

from __future__ import annotations

import re

from ckptctl.families.pointers import PicksNewestByName

#: transformers' `_re_checkpoint` (`PREFIX_CHECKPOINT_DIR` is "checkpoint").
POINTER_WRITER = PicksNewestByName(re.compile(r"^checkpoint\-(\d+)$"))
