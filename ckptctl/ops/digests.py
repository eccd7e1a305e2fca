"""File digests of a checkpoint: check them against its manifest, or record them for a foreign checkpoint.

`verify` (level 2) and `resume-plan --digests` check them; `verify --write-manifest` and the transformers
callback record them. Files are hashed in parallel with blake3.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from ckptctl import io
from ckptctl.checkpoint import Problem, ProblemKind
from ckptctl.errors import CkptctlError
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import DIGESTS_NAME, MANIFEST_NAME, FileRecord, Manifest, now_iso
from ckptctl.ops.distributed_work import Ranks, split
from ckptctl.ops.report import Progress

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["check_digests", "write_digests"]


def _workers(requested: int | None) -> int:
    return requested or max(2, min(8, os.cpu_count() or 2))


def check_digests(
    url: str,
    manifest: Manifest,
    present: Mapping[str, int],
    workers: int | None,
    progress: Progress,
    ranks: Ranks | None = None,
) -> tuple[list[Problem], int]:
    """Hash every file the manifest lists (in parallel; over a job's `ranks`, each rank its share by bytes)
    and compare; returns problems and files checked (the same on every rank)."""
    todo = {rel: rec for rel, rec in manifest.files.items() if present.get(rel) == rec.size}
    problems: list[Problem] = []
    # A recorded file that is gone or changed size fails without hashing. A checkpoint manifest the core
    # wrote is checked for these by its layout's verify already; digests of foreign checkpoints rely on this.
    if not manifest.native:
        for rel, rec in sorted(manifest.files.items()):
            if rel not in present:
                problems.append(
                    Problem(ProblemKind.MISSING_FILE, rel, f"{rel} was recorded in {DIGESTS_NAME} but is missing")
                )
            elif present[rel] != rec.size:
                problems.append(
                    Problem(
                        ProblemKind.SIZE_MISMATCH,
                        rel,
                        f"{rel} has {present[rel]} bytes, {DIGESTS_NAME} recorded {rec.size}",
                    )
                )

    def check(item: tuple[str, FileRecord]) -> Problem | None:
        rel, rec = item
        try:
            digest = file_digest(io.join(url, rel))
        except CkptctlError as exc:
            return Problem(ProblemKind.UNREADABLE, rel, exc.message)
        finally:
            progress.advance(rec.size)
        if digest != rec.blake3:
            return Problem(ProblemKind.DIGEST_MISMATCH, rel, f"{rel}: content differs from the recorded blake3 digest")
        return None

    items = sorted(todo.items(), key=lambda kv: -kv[1].size)
    sizes = [rec.size for _, rec in items]
    problems.extend(p for p in split(ranks, sizes, _hashing(items, sizes, check, workers, progress)) if p)
    if manifest.native is False:
        for rel in sorted(set(present) - set(manifest.files) - {DIGESTS_NAME, MANIFEST_NAME}):
            problems.append(
                Problem(
                    ProblemKind.UNEXPECTED_FILE,
                    rel,
                    f"{rel} was added after the digests were recorded",
                    severity="warning",
                )
            )
    return problems, len(todo)


def write_digests(
    url: str, files: Mapping[str, int], workers: int | None, progress: Progress, ranks: Ranks | None = None
) -> Manifest:
    """Record size and blake3 of every file of a foreign checkpoint into `ckptctl-digests.json` (over a job's
    `ranks`, each rank hashes its share and rank 0 writes the file)."""
    todo = sorted((rel, size) for rel, size in files.items() if rel not in (DIGESTS_NAME, MANIFEST_NAME))

    def digest(item: tuple[str, int]) -> tuple[str, FileRecord]:
        rel, size = item
        value = file_digest(io.join(url, rel))
        progress.advance(size)
        return rel, FileRecord(size, value)

    sizes = [size for _, size in todo]
    records = dict(split(ranks, sizes, _hashing(todo, sizes, digest, workers, progress)))
    manifest = Manifest(files=records, created=now_iso())
    if ranks is None or ranks.leader:
        io.write_bytes_atomic(io.join(url, DIGESTS_NAME), manifest.to_json())
    return manifest


def _hashing(
    items: Sequence[T], sizes: Sequence[int], work: Callable[[T], R], workers: int | None, progress: Progress
) -> Callable[[list[int]], dict[int, R]]:
    """A share of `items` (by index, for `distributed_work.split`) handed to `work` on a pool of threads,
    with a progress bar of its `sizes`."""

    def run(indices: list[int]) -> dict[int, R]:
        progress.start("hashing", sum(sizes[i] for i in indices))
        with io.ContextThreadPool(max_workers=_workers(workers)) as pool:
            found = dict(zip(indices, pool.map(work, [items[i] for i in indices]), strict=True))
        progress.finish()
        return found

    return run
