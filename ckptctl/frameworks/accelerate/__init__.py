"""accelerate `Accelerator.save_state()` folders (plain, DeepSpeed plugin, FSDP plugin)."""
