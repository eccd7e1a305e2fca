"""ByteCheckpoint (ByteDance's unified checkpointing library, `bytecheckpoint` on PyPI): `global_step_N/` folders."""
