"""The names of what ROLL writes into a `checkpoint-N/`, which its reader (`layout`) and its resume profile
(`resume`) both go by."""

from __future__ import annotations

__all__ = ["CRITIC", "DCP_FOLDER", "MCA_CONFIG", "PIPELINE_RNG", "PIPELINE_STATE", "RNG_DIR", "TRACKER"]

PIPELINE_STATE = "pipeline/worker_state_pipeline.json"
PIPELINE_RNG = "pipeline/rng_state_pipeline.pth"
CRITIC = "critic"
DCP_FOLDER = "dcp"
MCA_CONFIG = "mca_config.json"
TRACKER = "latest_checkpointed_iteration.txt"
RNG_DIR = "rng_state"
