"""torch.distributed.checkpoint (DCP) folders: `.metadata` + `__R_N.distcp`."""
