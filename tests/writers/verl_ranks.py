"""A spawned process joining a gloo group of CPU ranks as verl's workers do, shared by the verl writers that
run verl's own code on several ranks (the critic save, the reshard proofs). Kept apart from those writers so
that each one's cache key (tests/writer_cache.py) covers only what it runs."""

from __future__ import annotations

import os
import warnings

from tests.writers.verl_writer import _import_verl


def join_verl_ranks(rank: int, world: int, port: int) -> None:
    """This spawned process joins a gloo group of `world` CPU ranks as verl's workers do (torchrun's variables),
    with verl imported."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TRANSFORMERS_VERBOSITY="error",
        VERL_LOGGING_LEVEL="WARNING",
    )
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _import_verl()
