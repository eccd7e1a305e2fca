"""A spawned process joining a gloo group of CPU ranks as DeepSpeed's launcher sets one up (`DS_ACCELERATOR=cpu`),
shared by the proofs that run DeepSpeed engines on several ranks (the universal resumes). Kept apart from them
so that each one's cache key (tests/writer_cache.py) covers only what it runs."""

from __future__ import annotations

import importlib
import logging
import os
import warnings

from tests.writers.ranks import freeze_imports, torchrun_variables


def join_deepspeed_ranks(rank: int, world: int, port: int) -> None:
    """This spawned process joins a gloo group of `world` CPU ranks through `deepspeed.init_distributed`, with
    DeepSpeed's CPU accelerator and its logging quiet."""
    import torch

    torchrun_variables(rank, world, port)
    os.environ["DS_ACCELERATOR"] = "cpu"
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    # The CPU backend JIT-compiles a shared-memory allreduce on first use (a minute on a fresh machine); plain
    # gloo collectives are all these tiny runs need. (`deepspeed.comm.torch` as an attribute is the torch
    # package itself, hence the lookup by module name.)
    setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)  # noqa: B010
    deepspeed.init_distributed(dist_backend="gloo")
    freeze_imports()  # DeepSpeed's modules too: it collects at each engine's set-up and save
