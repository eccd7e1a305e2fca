"""Random number generator states: captured on every save, restored on every restore, never asked for.

A resumed run only continues the same random stream (dropout masks, data shuffles, sampling) if every
generator it draws from is restored: Python's `random`, numpy's global generator, torch's CPU generator
and the generator of every CUDA device. They are stored as an encoded tree (`rng.json` +
`rng.safetensors`), so nothing needs pickle to load.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ckptctl.core.entries import CheckpointWarning
from ckptctl.errors import CorruptCheckpoint

__all__ = ["RNG_KEYS", "capture", "restore"]

#: Every generator a checkpoint should hold; `cuda` only where CUDA is available at save time.
RNG_KEYS = ("python", "numpy", "torch", "cuda")


def capture() -> dict[str, Any]:
    """The current state of every generator, as plain values and tensors (nothing shared with the live state)."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore(states: Mapping[str, Any], *, source: str) -> None:
    """Set every generator the checkpoint holds; warn about the ones it lacks and go on.

    Args:
        states: what `capture` returned, after a round trip through the encoded tree.
        source: where the states came from, for messages.

    Raises:
        CorruptCheckpoint: a state is present but the generator rejects it.
    """
    expected = ["python", "numpy", "torch"] + (["cuda"] if torch.cuda.is_available() else [])
    missing = [key for key in expected if key not in states]
    try:
        if "python" in states:
            random.setstate(_as_tuple(states["python"]))
        if "numpy" in states:
            np.random.set_state(states["numpy"])
        if "torch" in states:
            torch.set_rng_state(states["torch"])
        if "cuda" in states and torch.cuda.is_available():
            saved = list(states["cuda"])
            # A checkpoint from a machine with more or fewer devices: restore the ones both have.
            for device in range(min(len(saved), torch.cuda.device_count())):
                torch.cuda.set_rng_state(saved[device], device)
            if len(saved) < torch.cuda.device_count():
                missing.append(f"cuda:{len(saved)}..{torch.cuda.device_count() - 1}")
    except (TypeError, ValueError, RuntimeError) as exc:
        raise CorruptCheckpoint(f"{source}: a random generator state does not load ({exc})") from exc
    if missing:
        warnings.warn(
            f"{source} holds no random generator state for {', '.join(missing)}; those generators keep their current state",
            CheckpointWarning,
            stacklevel=4,  # the caller of CheckpointManager.restore
        )


def _as_tuple(value: Any) -> tuple[Any, ...]:
    # random.setstate wants (version, tuple_of_ints, gauss_next); the tree keeps tuples, but be lenient
    # with lists so that a hand-edited or foreign rng.json still loads.
    if isinstance(value, list | tuple):
        return tuple(_as_tuple(v) if isinstance(v, list) else v for v in value)
    raise TypeError(f"python state must be a tuple, not {type(value).__name__}")
