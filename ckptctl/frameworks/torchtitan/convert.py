"""What `convert` reads from torchtitan's checkpoints beyond their tensor index (`ConvertSource`): its model's
names and q/k row order as transformers' (`frameworks.torchtitan.names`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptctl.contract.capabilities import ConvertSource, NameMap
from ckptctl.frameworks.torchtitan import names

__all__ = ["SOURCE"]


def _hf_name_map(
    tensors: Mapping[str, tuple[int, ...]],
    config: Mapping[str, Any] | None,
    requested: str | None,
    notes: list[str],
) -> NameMap | None:
    """torchtitan's names to transformers' (`frameworks.torchtitan.names`), with Llama's q/k rows."""
    found = names.hf_name_map(tensors, config, requested)
    if found is not None:
        reordered = f"; q/k rows of {len(found.rows)} tensors reordered for transformers' RoPE" if found.rows else ""
        notes.append(
            f"tensor names mapped from torchtitan's to transformers' ({found.mapping}, as torchtitan's "
            f"StateDictAdapter.to_hf){reordered}"
        )
    return found


SOURCE = ConvertSource(hf_name_map=_hf_name_map)
