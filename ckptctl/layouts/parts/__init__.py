"""Parts that several framework plugins share (DCP folder, HF model folder, ZeRO tag, LoRA, in-progress rule)."""
