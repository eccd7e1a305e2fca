"""The names of what accelerate's `save_state` writes, which its reader (`layout`) and its resume profile
(`resume`) both go by."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

__all__ = [
    "AUTO_FOLDER",
    "AUTO_PARENT",
    "FSDP_RANK_FILE",
    "RNG_FILE",
    "numbered",
    "per_process_files",
    "rng_ranks",
    "without_dcp",
]

#: `ProjectConfiguration(automatic_checkpoint_naming=True)` saves into `{project_dir}/checkpoints/checkpoint_{N}`.
AUTO_PARENT = "checkpoints"
AUTO_FOLDER = re.compile(r"^checkpoint_(\d+)$")
RNG_FILE = re.compile(r"^random_states_(\d+)\.pkl$")
#: Per-process FSDP files: LOCAL_STATE_DICT (`pytorch_model_fsdp[_{i}]_rank{R}.bin`) and SHARDED_STATE_DICT
#: with `use_dcp=False` (`pytorch_model_fsdp_{i}_rank{R}.bin`, `optimizer_{i}_rank{R}.bin`).
FSDP_RANK_FILE = re.compile(r"^(?P<kind>pytorch_model_fsdp|optimizer)(?:_\d+)?_rank(?P<rank>\d+)\.bin$")
_WITHOUT_DCP = re.compile(r"^(?:pytorch_model_fsdp_0|optimizer_\d+)_rank\d+\.bin$")


def numbered(stem: str, ext: str) -> re.Pattern[str]:
    """The names `save_accelerator_state` gives the objects of one kind, numbered in the order they were
    prepared: `{stem}{ext}` for the first, `{stem}_{i}{ext}` after (`i` as group 1, None for the first)."""
    return re.compile(rf"^{re.escape(stem)}(?:_(\d+))?{re.escape(ext)}$")


def rng_ranks(names: Sequence[str]) -> list[int]:
    """The process indices of the `random_states_{i}.pkl` files among `names`, sorted."""
    return sorted(int(m.group(1)) for n in names if (m := RNG_FILE.match(n)))


def per_process_files(names: Iterable[str]) -> list[str]:
    """The per-process FSDP files (`*_rank{R}.bin`) among `names` (top-level file names)."""
    return sorted(n for n in names if FSDP_RANK_FILE.match(n))


def without_dcp(names: Iterable[str]) -> bool:
    """Whether the per-process files come from `save_fsdp_model`/`save_fsdp_optimizer(..., use_dcp=False)`
    (`pytorch_model_fsdp_0_rank{R}.bin`, `optimizer_{i}_rank{R}.bin`) rather than LOCAL_STATE_DICT
    (`pytorch_model_fsdp_rank{R}.bin`)."""
    return any(_WITHOUT_DCP.match(n) for n in names)
