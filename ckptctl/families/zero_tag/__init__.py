"""A ZeRO tag folder (DeepSpeed's `save_checkpoint` output), read without DeepSpeed or torch: its rank files and
`latest`, the rank-0 facts, the tensor index, zero_to_fp32's master weights, verify, and the resume rules the
frameworks that save ZeRO tags share."""
