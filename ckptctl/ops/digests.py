"""File digests of a checkpoint: check them against its manifest, or record them for a foreign checkpoint.

`verify` (level 2) and `resume-plan --digests` check them; `verify --write-manifest` and the transformers
callback record them. Files are hashed in parallel with blake3.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ckptctl import io
from ckptctl.checkpoint import Problem, ProblemKind
from ckptctl.errors import CkptctlError
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import DIGESTS_NAME, MANIFEST_NAME, FileRecord, Manifest, now_iso
from ckptctl.ops.report import Progress

__all__ = ["check_digests", "write_digests"]


def _workers(requested: int | None) -> int:
    return requested or max(2, min(8, os.cpu_count() or 2))


def check_digests(
    url: str, manifest: Manifest, present: Mapping[str, int], workers: int | None, progress: Progress
) -> tuple[list[Problem], int]:
    """Hash every file the manifest lists (in parallel) and compare; returns problems and files checked."""
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
    progress.start("hashing", sum(rec.size for rec in todo.values()))

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

    with io.ContextThreadPool(max_workers=_workers(workers)) as pool:
        problems.extend(p for p in pool.map(check, sorted(todo.items(), key=lambda kv: -kv[1].size)) if p)
    progress.finish()
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


def write_digests(url: str, files: Mapping[str, int], workers: int | None, progress: Progress) -> Manifest:
    """Record size and blake3 of every file of a foreign checkpoint into `ckptctl-digests.json`."""
    todo = sorted((rel, size) for rel, size in files.items() if rel not in (DIGESTS_NAME, MANIFEST_NAME))
    progress.start("hashing", sum(size for _, size in todo))

    def digest(item: tuple[str, int]) -> tuple[str, FileRecord]:
        rel, size = item
        value = file_digest(io.join(url, rel))
        progress.advance(size)
        return rel, FileRecord(size, value)

    with io.ContextThreadPool(max_workers=_workers(workers)) as pool:
        records = dict(pool.map(digest, todo))
    progress.finish()
    manifest = Manifest(files=records, created=now_iso())
    io.write_bytes_atomic(io.join(url, DIGESTS_NAME), manifest.to_json())
    return manifest
