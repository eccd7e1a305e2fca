"""verl (and SkyRL) FSDP checkpoints: `global_step_N/{actor,critic}/` per-rank DTensor shards."""
