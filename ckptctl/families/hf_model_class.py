"""The transformers class a `config.json` names, found and built the way every plugin that asks transformers about a
model does it: only classes transformers itself ships (never `trust_remote_code`), built from the config alone on
the meta device (no memory, no weights) with transformers' warnings, log lines and progress bars off.

Shared by the HF model reader's check of `convert` outputs (`frameworks.hf.architecture`) and the HF Trainer's
training-state source (`frameworks.hf_trainer.state`), which asks transformers which parameters its Trainer puts in
which optimizer group. transformers is optional: without it (or before 5) there is no class.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["build_on_meta", "excess_layers", "has_transformers_5", "model_class", "quiet"]


def has_transformers_5() -> bool:
    """Whether transformers 5 or later is importable (`model_spec` reverts its weight conversions, in
    `core_model_loading`, which 4.x has not)."""
    return importlib.util.find_spec("transformers") is not None and bool(
        importlib.util.find_spec("transformers.core_model_loading")
    )


def model_class(config: Mapping[str, Any], notes: list[str]) -> tuple[str, Any] | None:
    """`(name, class)` of the transformers model `config["architectures"][0]` names, or None with a note."""
    architectures = config.get("architectures")
    if not (isinstance(architectures, list) and architectures and isinstance(architectures[0], str)):
        notes.append("config.json names no architecture: the tensors were not checked against a model")
        return None
    name = architectures[0]
    if not has_transformers_5():
        notes.append(f"transformers 5 or later is not importable: the tensors were not checked against {name}")
        return None
    import transformers

    cls = getattr(transformers, name, None) if name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        notes.append(f"transformers has no model class {name} (custom code?): the tensors were not checked against it")
        return None
    return name, cls


def build_on_meta(cls: Any, config: Mapping[str, Any]) -> Any:
    """The model `cls` builds from `config` on the meta device (transformers quiet while it does).

    Raises:
        Exception: whatever transformers raises for a config it cannot use (ValueError, TypeError, KeyError, ...).
    """
    import torch

    with quiet(), torch.device("meta"), torch.no_grad():
        return cls._from_config(cls.config_class.from_dict(dict(config)))


#: A config may ask for up to this many layers or experts (or as many as the checkpoint has tensors): more
#: would only make transformers build a meta model for minutes that cannot match the checkpoint anyway.
_MIN_BUILD_BOUND = 1024


def excess_layers(config: Mapping[str, Any], tensors: int) -> str | None:
    """`key=value` of a count of layers or experts in `config` (or its sub-configs) larger than a checkpoint of
    `tensors` tensors could hold, or None: checked before building, which such a config would make last minutes."""
    bound = max(tensors, _MIN_BUILD_BOUND)
    return next((f"{key}={value}" for key, value in _counts(config) if value > bound), None)


def _counts(config: Mapping[str, Any], depth: int = 0) -> list[tuple[str, int]]:
    """Every integer of `config` (and its sub-configs) whose key counts layers or experts."""
    found = []
    for key, value in config.items():
        if isinstance(value, dict) and depth < 8:
            found += _counts(value, depth + 1)
        elif type(value) is int and ("layers" in key or "experts" in key):
            found.append((key, value))
    return found


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers' warnings, log lines and progress bars off while it builds or loads, restored after."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
