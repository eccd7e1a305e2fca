"""torchtitan checkpoints: `step-N/` DCP folders of its CheckpointManager, with its own model names."""
