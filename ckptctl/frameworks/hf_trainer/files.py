"""The names of what the Hugging Face Trainer writes into `output_dir`, which its reader (`layout`) and its
resume profile (`resume`) both go by."""

from __future__ import annotations

import re

__all__ = ["CHECKPOINT_DIR", "RNG_FILE", "TRAINER_STATE_NAME"]

#: Written last: the completion marker.
TRAINER_STATE_NAME = "trainer_state.json"
#: The Trainer's checkpoint folders (`checkpoint-{global_step}`) and RNG files (one per process).
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
RNG_FILE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
