"""File digests of a checkpoint: check them against its manifest, or record them for a foreign checkpoint.

`verify` (level 2) and `resume-plan --digests` check them; `verify --write-manifest` and the transformers
callback record them. Files are hashed in parallel with blake3, each read once through a small reused
buffer (`io.sweep`), so memory stays flat whatever their size; over the ranks of a job each rank hashes
its share of the files by bytes (`ops.sweeping`). `DigestPlan` is the part `verify` runs in the same pass
as its other content checks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ckptctl import io
from ckptctl.checkpoint import Problem, ProblemKind
from ckptctl.errors import StorageError
from ckptctl.formats.digest import DigestSink
from ckptctl.formats.manifest import DIGESTS_NAME, MANIFEST_NAME, FileRecord, Manifest, now_iso
from ckptctl.io.sweep import Job, Span
from ckptctl.ops.distributed_work import Ranks
from ckptctl.ops.report import Progress
from ckptctl.ops.sweeping import sweep_jobs, threads_for

__all__ = ["DigestPlan", "check_digests", "save_digests", "write_digests"]

#: What hashing one file found: (the read error, or None; the blake3 digest when it was read whole).
Hashed = tuple[str | None, str | None]


class DigestPlan:
    """The digests to compute over a checkpoint's files: to check against a manifest, or to record.

    `jobs` (one per file) go through a sweep (`ops.sweeping.sweep_jobs`, with any other checks' jobs); their
    verdicts, handed to `conclude`, make `problems()`, `mismatched()` and `records()`.

    Args:
        url: the checkpoint.
        present: its files, relative path -> size.
        manifest: the digests to check, or None.
        record: compute the digest of every file (but the digest files themselves) to record them.
    """

    def __init__(self, url: str, present: Mapping[str, int], manifest: Manifest | None, record: bool = False) -> None:
        self._manifest = manifest
        self._present = present
        self._before: list[Problem] = []
        # rel -> (sink, size, recorded digest or None)
        self._sinks: dict[str, tuple[DigestSink, int, str | None]] = {}
        if manifest is not None:
            self._missing_or_resized(manifest, present)
            for rel, rec in manifest.files.items():
                if present.get(rel) == rec.size:
                    self._sinks[rel] = (DigestSink(), rec.size, rec.blake3)
        if record:
            for rel, size in present.items():
                if rel not in (DIGESTS_NAME, MANIFEST_NAME) and rel not in self._sinks:
                    self._sinks[rel] = (DigestSink(), size, None)
        self._found: dict[str, Hashed] = {}
        self.jobs = [
            Job([Span(io.join(url, rel), 0, size, sink, ordered=True)], _hashed(sink))
            for rel, (sink, size, _) in self._sinks.items()
        ]

    def conclude(self, verdicts: list[Hashed]) -> None:
        """The verdicts of `jobs`, in their order (from this process's sweep or from the ranks that hashed
        them)."""
        self._found = dict(zip(self._sinks, verdicts, strict=True))

    @property
    def checked(self) -> frozenset[str]:
        """The files whose content a recorded digest vouches for (checked in this pass)."""
        return frozenset(rel for rel, (_, _, recorded) in self._sinks.items() if recorded is not None)

    @property
    def count(self) -> int:
        """How many recorded digests are checked."""
        return len(self.checked)

    def _missing_or_resized(self, manifest: Manifest, present: Mapping[str, int]) -> None:
        # A recorded file that is gone or changed size fails without hashing. A checkpoint manifest the core
        # wrote is checked for these by its layout's verify already; digests of foreign checkpoints rely on this.
        if manifest.native:
            return
        for rel, rec in sorted(manifest.files.items()):
            if rel not in present:
                self._before.append(
                    Problem(ProblemKind.MISSING_FILE, rel, f"{rel} was recorded in {DIGESTS_NAME} but is missing")
                )
            elif present[rel] != rec.size:
                self._before.append(
                    Problem(
                        ProblemKind.SIZE_MISMATCH,
                        rel,
                        f"{rel} has {present[rel]} bytes, {DIGESTS_NAME} recorded {rec.size}",
                    )
                )

    def problems(self) -> list[Problem]:
        """After the sweep: files missing, resized, unreadable or changed; files added (warnings)."""
        problems = list(self._before)
        for rel, (_, _, recorded) in sorted(self._sinks.items(), key=lambda kv: -kv[1][1]):
            error, digest = self._found[rel]
            if error is not None:
                problems.append(Problem(ProblemKind.UNREADABLE, rel, f"{rel}: {error}"))
            elif recorded is not None and digest != recorded:
                problems.append(
                    Problem(ProblemKind.DIGEST_MISMATCH, rel, f"{rel}: content differs from the recorded blake3 digest")
                )
        if self._manifest is not None and self._manifest.native is False:
            for rel in sorted(set(self._present) - set(self._manifest.files) - {DIGESTS_NAME, MANIFEST_NAME}):
                problems.append(
                    Problem(
                        ProblemKind.UNEXPECTED_FILE,
                        rel,
                        f"{rel} was added after the digests were recorded",
                        severity="warning",
                    )
                )
        return problems

    def mismatched(self) -> frozenset[str]:
        """After the sweep: the files whose content differs from their recorded digest."""
        return frozenset(
            rel
            for rel, (_, _, recorded) in self._sinks.items()
            if recorded is not None and self._found[rel][0] is None and self._found[rel][1] != recorded
        )

    def records(self) -> dict[str, FileRecord]:
        """After the sweep: size and digest of every file hashed (those that could be read whole)."""
        found = self._found
        return {
            rel: FileRecord(size, found[rel][1] or "")
            for rel, (_, size, _) in sorted(self._sinks.items())
            if found[rel][0] is None
        }


def _hashed(sink: DigestSink) -> Callable[[], Hashed]:
    def verdict() -> Hashed:
        return (sink.error, None) if sink.error is not None else (None, sink.hexdigest())

    return verdict


def check_digests(
    url: str,
    manifest: Manifest,
    present: Mapping[str, int],
    workers: int | None,
    progress: Progress,
    ranks: Ranks | None = None,
) -> tuple[list[Problem], int]:
    """Hash every file the manifest lists (in parallel: `workers` threads; over a job's `ranks`, each rank
    its share by bytes) and compare; returns problems and files checked (the same on every rank)."""
    plan = DigestPlan(url, present, manifest)
    _run(plan, workers, progress, ranks)
    return plan.problems(), plan.count


def write_digests(
    url: str, files: Mapping[str, int], workers: int | None, progress: Progress, ranks: Ranks | None = None
) -> Manifest:
    """Record size and blake3 of every file of a foreign checkpoint into `ckptctl-digests.json` (over a job's
    `ranks`, each rank hashes its share and rank 0 writes the file).

    Raises:
        StorageError: a file could not be read whole.
    """
    plan = DigestPlan(url, files, None, record=True)
    _run(plan, workers, progress, ranks)
    unreadable = [p for p in plan.problems() if p.kind == ProblemKind.UNREADABLE]
    if unreadable:
        raise StorageError(unreadable[0].message)
    if ranks is not None and not ranks.leader:
        return Manifest(files=plan.records(), created=now_iso())
    return save_digests(url, plan.records())


def save_digests(url: str, records: Mapping[str, FileRecord]) -> Manifest:
    """Write `ckptctl-digests.json` with these records into the checkpoint at `url` (atomically)."""
    manifest = Manifest(files=dict(records), created=now_iso())
    io.write_bytes_atomic(io.join(url, DIGESTS_NAME), manifest.to_json())
    return manifest


def _run(plan: DigestPlan, workers: int | None, progress: Progress, ranks: Ranks | None) -> None:
    plan.conclude(sweep_jobs(plan.jobs, ranks, threads_for(workers, ranks), progress, "hashing"))
