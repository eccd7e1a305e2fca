"""What every loader process shares: read the spec, load the reference copy, judge each damaged copy.

A loader module defines `load(path, options) -> state` (the framework's own load of the checkpoint at `path`
into fresh objects, returning everything it restored as a nested dict of tensors and plain values) and calls
`run(load)` from its `__main__`. A verdict is `ok` when the damaged copy's state equals the reference copy's
key for key (tensors bit for bit, dtype and shape included), `failed: <exception line>` when the load raised,
`lost: <what>` when it loaded but some state is missing or different, or when it warned (a warning the
reference load did not give: the framework noticed something missing and went on).
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["flatten", "judge", "load_capturing", "local_shards", "run", "without_path"]

Load = Callable[[str, Mapping[str, Any]], Any]


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts, lists and tuples as dotted keys (the leaves: tensors, arrays, plain values)."""
    if isinstance(tree, Mapping):
        items = [(str(k), v) for k, v in tree.items()]
    elif isinstance(tree, list | tuple) and tree and any(isinstance(v, Mapping | list | tuple) for v in tree):
        items = [(str(i), v) for i, v in enumerate(tree)]
    else:
        return {prefix.rstrip("."): _leaf(tree)}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}{key}."))
    return out


def _leaf(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if type(value).__module__ == "numpy":
        return torch.from_numpy(value.copy()) if hasattr(value, "shape") else value.item()
    return value


def _equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        # Bit for bit: NaN equals NaN where the reference had the same bits.
        return bool(
            torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
        )
    try:
        return bool(a == b)
    except Exception:  # values whose == is not a bool (arrays in tuples): compare their text
        return repr(a) == repr(b)


def differences(reference: Mapping[str, Any], got: Mapping[str, Any]) -> list[str]:
    """The keys missing, added or different in `got`, each with how."""
    found = [f"{k} missing" for k in reference if k not in got]
    found += [f"{k} added" for k in got if k not in reference]
    found += [f"{k} differs" for k in reference if k in got and not _equal(reference[k], got[k])]
    return found


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


def load_capturing(load: Load, path: str, options: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`load(path)` flattened, and the warnings (python's and WARNING log records) it gave."""
    records = _Records()
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in options.get("loggers", ()))]
    for logger in loggers:
        logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = flatten(load(path, options))
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    return state, [f"{w.category.__name__}: {w.message}" for w in caught] + records.messages


def judge(load: Load, path: str, options: Mapping[str, Any], reference: Mapping[str, Any], known: set[str]) -> str:
    """The verdict on the copy at `path` against the reference state (see the module's doc)."""
    try:
        state, said = load_capturing(load, path, options)
    except BaseException as exc:  # whatever the framework raises (SystemExit included) is a failed load
        if isinstance(exc, KeyboardInterrupt):
            raise
        line = without_path((str(exc).strip().splitlines() or [""])[0], path)
        return f"failed: {type(exc).__name__}: {line[:200]}"
    lost = differences(reference, state)
    new = [without_path(m, path) for m in said if without_path(m, path) not in known]
    if lost:
        return f"lost: {len(lost)} of {len(reference)} entries ({'; '.join(lost[:3])})"
    if new:
        return f"lost: warned ({new[0][:200]})"
    return "ok"


def without_path(message: str, path: str) -> str:
    """A warning's text without the copy's own folder (the reference's names another folder)."""
    return message.replace(path, "<ckpt>").replace(str(Path(path).parent), "<parent>")


def run(load: Load) -> None:
    """The loader process: `python -m tests.faults.loaders.NAME SPEC.json` (see `tests.faults.cells`)."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    options = spec["options"]
    reference, said = load_capturing(load, spec["reference"], options)
    known = {without_path(m, spec["reference"]) for m in said}
    verdicts = {"reference": "ok"}
    for cell in spec["cells"]:
        verdicts[cell["id"]] = judge(load, cell["path"], options, reference, known)
    Path(spec["out"]).write_text(json.dumps(verdicts, indent=1))


def local_shards(tree: Any) -> Any:
    """`tree` (dicts and lists) with each DTensor as its local shard: what this rank holds, for the ranks that
    compare their own state."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, Mapping):
        return {k: local_shards(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [local_shards(v) for v in tree]
    return tree.to_local() if isinstance(tree, DTensor) else tree
