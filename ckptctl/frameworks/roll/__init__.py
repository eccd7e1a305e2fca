"""ROLL (Alibaba): timestamped `checkpoint-N/` folders of its pipelines (FSDP2 DCP or Megatron)."""
