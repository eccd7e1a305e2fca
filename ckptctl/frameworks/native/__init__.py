"""ckptctl's own checkpoints (what `CheckpointManager` writes): `step-N/` with `ckptctl-manifest.json` last."""
