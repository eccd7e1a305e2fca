"""`list`: every checkpoint of a run folder, from listings and tiny marker reads only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState
from ckptctl.layouts import DEFAULT_SCAN_DEPTH, get_layout, scan_run
from ckptctl.ops.report import SCHEMA_VERSION, ref_json

SORT_KEYS = ("step", "created", "size", "url")


@dataclass(frozen=True, slots=True)
class ListReport:
    """The checkpoints found below a run folder.

    Attributes:
        run: the run folder.
        checkpoints: those listed (after filters, sorting and the limit).
        total: how many matched the filters before the limit.
    """

    run: str
    checkpoints: tuple[CheckpointRef, ...]
    total: int

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "run": self.run,
            "checkpoints": [ref_json(c) for c in self.checkpoints],
            "total": self.total,
        }


def list_run(
    run: str,
    *,
    sort: str = "step",
    reverse: bool = False,
    states: frozenset[CheckpointState] | None = None,
    layout: str | None = None,
    limit: int | None = None,
    max_depth: int = DEFAULT_SCAN_DEPTH,
) -> ListReport:
    """Find every checkpoint below `run`.

    Args:
        run: run folder (local path or fsspec URL).
        sort: one of `SORT_KEYS`; `step` groups checkpoints by their folder, those without a step first, equal
            steps by epoch, then by time.
        reverse: newest/largest first.
        states: keep only these states.
        layout: keep only this layout.
        limit: keep at most this many (after sorting).
        max_depth: how deep to look for nested runs.

    Raises:
        UnknownLayout: `layout` names no layout (the message lists the known ones).
        CheckpointNotFound: `run` is not a folder.
    """
    if sort not in SORT_KEYS:
        raise ValueError(f"sort must be one of {SORT_KEYS}")
    if layout is not None:
        get_layout(layout)
    refs = scan_run(run, max_depth=max_depth)
    if states is not None:
        refs = [r for r in refs if r.state in states]
    if layout is not None:
        refs = [r for r in refs if r.layout == layout]

    def key(ref: CheckpointRef) -> tuple[Any, ...]:
        if sort == "created":
            return (ref.created.timestamp() if ref.created else 0.0, ref.url)
        if sort == "size":
            return (ref.size_bytes, ref.url)
        if sort == "url":
            return (ref.url,)
        # Grouped by the folder holding them, so the checkpoints of one run stay together; equal steps (an epoch
        # folder has none) by epoch, then by time (the naming rules of `layouts.generic`), then by name.
        ordered = ref.step is not None or ref.epoch is not None
        created = ref.created.timestamp() if ordered and ref.created else 0.0
        return (io.parent_of(ref.url), ref.step is not None, ref.step or 0, ref.epoch or 0.0, created, ref.url)

    refs.sort(key=key, reverse=reverse)
    total = len(refs)
    if limit is not None:
        refs = refs[:limit]
    return ListReport(run=run, checkpoints=tuple(refs), total=total)
