"""A spawned process joining a gloo group of CPU ranks for DeepSpeed, shared by the writers that run DeepSpeed
(or a framework wrapping it) on several ranks. Kept apart from those writers so that each one's cache key
(tests/writer_cache.py) covers only what it runs."""

from __future__ import annotations

import importlib
import logging
import os
import warnings


def join_deepspeed_ranks(rank: int, world: int, port: int) -> None:
    """This spawned process joins a gloo group of `world` CPU ranks through `deepspeed.init_distributed`
    (`DS_ACCELERATOR=cpu`, torchrun's variables), DeepSpeed's logging quiet."""
    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    warnings.filterwarnings("ignore")
    import deepspeed
    import torch
    from deepspeed.utils import logger

    torch.set_num_threads(1)
    logger.setLevel(logging.ERROR)
    # The CPU backend JIT-compiles a shared-memory allreduce on first use (a minute on a fresh machine);
    # plain gloo collectives are all these tiny runs need. (`deepspeed.comm.torch` as an attribute is the
    # torch package itself, hence the lookup by module name.)
    setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)  # noqa: B010
    deepspeed.init_distributed(dist_backend="gloo")
