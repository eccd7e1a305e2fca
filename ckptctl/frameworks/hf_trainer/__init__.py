"""Hugging Face `Trainer` checkpoints: `checkpoint-N/` with `trainer_state.json`, optimizer and RNG files."""
