"""Megatron-LM and megatron-core distributed checkpoints (`torch_dist`): `iter_NNNNNNN/` folders and their tracker."""
