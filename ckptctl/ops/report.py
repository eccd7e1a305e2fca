"""Shared pieces of the command reports: JSON conversion, flattened metadata, display paths and the progress protocol."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Protocol

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, Problem

SCHEMA_VERSION = 1

#: `ckptctl report`: Pairs of consecutive checkpoints per folder whose drift is computed by default (the newest ones): each pair
#: reads both models, so a run of hundreds of checkpoints is not read twice over unless asked (`last=None`).
DEFAULT_LAST = 10


class Progress(Protocol):
    """Where long operations report progress; the CLI renders it on stderr, the library passes None."""

    def start(self, description: str, total: int | None) -> None: ...

    def advance(self, amount: int) -> None: ...

    def finish(self) -> None: ...


class NoProgress:
    """The do-nothing progress sink."""

    def start(self, description: str, total: int | None) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def finish(self) -> None:
        pass


def finite_json(value: Any) -> Any:
    """`value` with NaN and infinities replaced by None, so the document is strict JSON (jq, JSON.parse)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


def iso(value: datetime | None) -> str | None:
    return value.isoformat(timespec="seconds") if value else None


def jsonable(value: Any) -> Any:
    """Plain JSON types from enums, datetimes, tuples and mappings (for free-form metadata)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    return str(value)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys (`{"a": {"b": 1}}` -> `{"a.b": 1}`), each after `prefix`."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def display_path(url: str, root: str) -> str:
    """`url` as a person reads it in a report about `root`: relative to it, or whole when it lies outside."""
    rel = io.relative_to(url, root)
    return url if rel.startswith("..") else rel


def ref_json(ref: CheckpointRef) -> dict[str, Any]:
    """The JSON of a checkpoint ref as `list` documents it (DESIGN §4)."""
    return {
        "url": ref.url,
        "layout": ref.layout,
        "step": ref.step,
        "epoch": ref.epoch,
        "state": ref.state.value,
        "size_bytes": ref.size_bytes,
        "latest": ref.latest,
        "created": iso(ref.created),
        "note": ref.note,
        # A run-level state file a resume loads with this model folder (torchtune's `recipe_state.pt`), or null.
        "run_state": ref.run_state or None,
        "roles": list(ref.roles),
    }


def problem_json(problem: Problem) -> dict[str, Any]:
    """A problem as `verify --json` prints it; `record` and `entry` only when the problem has them."""
    doc = {"kind": str(problem.kind), "path": problem.path, "message": problem.message, "severity": problem.severity}
    if problem.record:
        doc["record"] = problem.record
    if problem.entry:
        doc["entry"] = problem.entry
    return doc
