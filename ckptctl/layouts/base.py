"""The Layout protocol: what every on-disk layout module implements (DESIGN §1–2).

A layout recognises its folders from a directory listing (cheap, no file reads beyond tiny markers),
opens one into a `Checkpoint` (headers and metadata only), and checks its completeness rules. The
shared contract test in `tests/layouts/test_contract.py` runs against every registered layout.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, Problem
from ckptctl.io import DirEntry


@runtime_checkable
class Layout(Protocol):
    """One on-disk checkpoint layout."""

    #: Short stable name shown in `list`/`inspect` and accepted by `--layout`.
    name: str

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """The folder's ref if it is a checkpoint of this layout, else None.

        Must decide from `entries` (the folder's listing) and at most a few tiny reads, because `list`
        calls it for every folder of a run.
        """
        ...

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """The name of the child folder a `latest`-style pointer in this folder names, if any."""
        ...

    def open(self, url: str) -> Checkpoint:
        """Open a checkpoint identified by this layout: components, metadata, lazy tensor index."""
        ...

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """Structural problems: missing or short files, metadata that does not parse or cover its data."""
        ...


_STEP_PATTERNS = (
    re.compile(r"^(?:step|global_step|globalstep|checkpoint|ckpt|iter|iteration|steps?)[-_]?(\d+)$", re.IGNORECASE),
    re.compile(r"^(\d+)$"),
)


#: How many absent ranks or shards a layout names one by one (`absent_numbers`); the rest are counted.
LISTED_ABSENT = 20


def absent_numbers(present: Iterable[int], count: int, limit: int = LISTED_ABSENT) -> tuple[list[int], int]:
    """The first `limit` numbers of 0..count-1 missing from `present`, and how many are missing in all.

    Ranks and shard counts come from file names and metadata that a damaged or hostile checkpoint may set
    to billions (`rng_state_99999999999.pth`): this never loops over more than `len(present) + limit`
    numbers, where listing every number below `count` would never end.
    """
    have = {n for n in present if 0 <= n < count}
    listed = list(itertools.islice((n for n in range(count) if n not in have), limit))
    return listed, max(0, count) - len(have)


def step_from_name(name: str) -> int | None:
    """The step a folder name encodes (`step-100`, `step_100`, `global_step100`, `checkpoint-100`, `100`)."""
    for pattern in _STEP_PATTERNS:
        m = pattern.match(name)
        if m:
            return int(m.group(1))
    return None


def timestamp(mtime: float | None) -> datetime | None:
    """A UTC datetime from a POSIX mtime (None or 0 means unknown)."""
    return datetime.fromtimestamp(mtime, tz=UTC) if mtime else None


def folder_size(url: str, entries: Sequence[DirEntry] | None = None) -> int:
    """Total size of the files below a folder (recursive).

    `entries`, the folder's listing when the caller has it, saves a request when it holds no folder.
    """
    if io.is_local(url):
        total = 0
        for root, _dirs, files in os.walk(io.local_path(url)):
            for f in files:
                try:
                    total += os.stat(os.path.join(root, f)).st_size
                except FileNotFoundError:
                    continue
        return total
    if entries is not None and not any(e.is_dir for e in entries):
        return sum(e.size for e in entries)
    return sum(e.size for e in io.list_tree(url).values())


def newest_mtime(entries: Sequence[DirEntry]) -> float | None:
    """The newest modification time of the files in a listing (None for an empty listing)."""
    times = [e.mtime for e in entries if not e.is_dir and e.mtime]
    return max(times) if times else None


def list_files(url: str) -> dict[str, int]:
    """Every file below a folder: relative path (with `/`) -> size in bytes (one listing on object stores)."""
    if io.is_local(url):
        files: dict[str, int] = {}
        base = io.local_path(url)
        for root, _dirs, names in os.walk(base):
            for n in names:
                full = os.path.join(root, n)
                try:
                    files[os.path.relpath(full, base).replace(os.sep, "/")] = os.stat(full).st_size
                except FileNotFoundError:
                    continue
        return files
    return {rel: entry.size for rel, entry in sorted(io.list_tree(url).items())}
