"""A spawned process joining a gloo group of CPU ranks as verl's workers do, with verl's modules imported, shared
by every writer that runs verl's own code on several ranks (the run writer, the critic save, the reshard proofs).
Kept apart from those writers so that each one's cache key (tests/writer_cache.py) covers only what it runs."""

from __future__ import annotations

import os

from tests.writers.ranks import freeze_imports, join_gloo, torchrun_variables
from tests.writers.stand_ins import StandIns

#: Top-level modules verl's checkpoint manager and merger import on the way (module level) without using them
#: on a save: cluster (`ray`), data protocol (`tensordict`, `pandas`, `datasets`, `PIL`), timing and profiling
#: (`codetiming`, `nvtx`), config (`omegaconf`: its `DictConfig` only appears in annotations and isinstance
#: checks here), serialization (`orjson`) and the optional engines' packages.
_STOOD_IN = frozenset(
    {
        "ray",
        "tensordict",
        "codetiming",
        "omegaconf",
        "orjson",
        "pandas",
        "datasets",
        "PIL",
        "nvtx",
        "transfer_queue",
        "hdfs_io",
        "veomni",
        "nemo_automodel",
    }
)


def join_verl_ranks(rank: int, world: int, port: int) -> None:
    """This spawned process joins a gloo group of `world` CPU ranks as verl's workers do (torchrun's variables),
    with verl's checkpoint manager and merger imported (modules they import that are not installed here and
    that their save paths never call are stood in for, `tests.writers.stand_ins`)."""
    torchrun_variables(rank, world, port)
    os.environ.update(TRANSFORMERS_VERBOSITY="error", VERL_LOGGING_LEVEL="WARNING")
    join_gloo(rank, world, port=port)
    with StandIns("verl", _STOOD_IN).serving():
        import verl.model_merger.fsdp_model_merger
        import verl.utils.checkpoint.fsdp_checkpoint_manager  # noqa: F401
    freeze_imports()
