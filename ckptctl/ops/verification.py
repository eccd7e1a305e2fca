"""`verify`: structure, content and (with `deep`) every tensor of a checkpoint or of a whole run.

Three levels:
1. structure (the layout's rules; reads metadata and headers only, well under 1% of the bytes); `quick`
   stops here,
2. content: digests against `ckptctl-manifest.json` / `ckptctl-digests.json` when present, and the
   CRC-32s torch recorded in every torch.save archive no digest covers (`ops.content`),
3. `deep`: every tensor chunk located and read, `check_finite` flags NaN/Inf.

Levels 2 and 3 share one parallel pass over the bytes through small reused buffers; over the ranks of a
job (torchrun, `--workers N`), each rank reads its share of those bytes and every rank gets the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState, Problem, ProblemKind
from ckptctl.contract.base import checkpoint_problems
from ckptctl.errors import CheckpointNotFound, CkptctlError, UnknownLayout
from ckptctl.formats.manifest import DIGESTS_NAME, read_manifest
from ckptctl.layouts import detect, scan_context, scan_run
from ckptctl.layouts.generic import read_as_files
from ckptctl.ops.distributed_work import Ranks
from ckptctl.ops.report import SCHEMA_VERSION, NoProgress, Progress, problem_json
from ckptctl.quoting import shell

if TYPE_CHECKING:
    from ckptctl.ops.resume_plan import ResumePlan


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """The verdict on one checkpoint."""

    url: str
    layout: str | None
    step: int | None
    problems: tuple[Problem, ...]
    digests_checked: int
    tensors_read: int
    bytes_read: int
    wrote_digests: bool = False
    crc_records_checked: int = 0

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    @property
    def unknown_layout(self) -> bool:
        """The checkpoint is of a layout ckptctl does not know: it cannot be judged (exit code 2)."""
        return any(p.kind == ProblemKind.UNKNOWN_LAYOUT for p in self.problems)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "url": self.url,
            "layout": self.layout,
            "step": self.step,
            "ok": self.ok,
            "problems": [problem_json(p) for p in self.problems],
            "digests_checked": self.digests_checked,
            "tensors_read": self.tensors_read,
            "bytes_read": self.bytes_read,
            "wrote_digests": self.wrote_digests,
            "crc_records_checked": self.crc_records_checked,
        }


@dataclass(frozen=True, slots=True)
class RunVerifyReport:
    """The verdicts on every checkpoint of a run (or on the one a resume would pick, with `latest`).

    Attributes:
        run: the run folder.
        results: one verdict per checkpoint verified.
        fresh_start: asked for what a resume would pick, the run holds no checkpoint yet (the folder is
            missing, or holds nothing but saves still being written): a resume starts from scratch, which is
            not a problem.
    """

    run: str
    results: tuple[VerifyResult, ...]
    fresh_start: bool = False

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def unknown_layout(self) -> bool:
        """A checkpoint of the run is of a layout ckptctl does not know (exit code 2)."""
        return any(r.unknown_layout for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "run": self.run,
            "ok": self.ok,
            "fresh_start": self.fresh_start,
            "results": [r.to_json() for r in self.results],
        }


@dataclass(frozen=True, slots=True)
class VerifyOptions:
    """What to check beyond structure.

    Attributes:
        deep: locate and read every tensor chunk.
        check_finite: with `deep`, flag NaN/Inf values.
        write_manifest: record digests into a checkpoint that has none (when it verifies).
        workers: threads reading at once in each process (default: one per core, 4 to 8, shared by the
            ranks of a job on one host; `ops.sweeping.threads_for`). Not the CLI's `--workers`, which
            starts processes (`ranks`).
        layout: read the checkpoint as this layout (skip detection).
        quick: structure only: no digests, no CRC-32s (reads well under 1% of the bytes).
        ranks: the ranks of a job (`ops.distributed_work.join`) that all run this verification and share
            the hashing, the CRC-32s and the reading by bytes; every rank gets the whole report. None: this
            process alone.
    """

    deep: bool = False
    check_finite: bool = False
    write_manifest: bool = False
    workers: int | None = None
    layout: str | None = None
    quick: bool = False
    ranks: Ranks | None = None


def verify_path(
    url: str, options: VerifyOptions | None = None, progress: Progress | None = None
) -> VerifyResult | RunVerifyReport:
    """Verify a checkpoint (a folder, or a single weights file), or every checkpoint of a run folder, each
    on its own (also those of a folder that is a checkpoint and holds others: a run folder with the final
    model beside its checkpoints).

    A path that does not exist, or a file of no known format, raises the registry's own clear error.
    """
    options = options or VerifyOptions()
    if options.layout is not None or not io.is_dir(url):
        return verify_checkpoint(url, options, progress)
    with scan_context():  # the scan's peeks serve the checkpoints' verification too
        refs = scan_run(url)
        if len(refs) == 1 and refs[0].url == url:
            return verify_checkpoint(url, replace(options, layout=refs[0].layout), progress)
        return _verify_refs(url, refs, options, progress)


def verify_run(
    run: str,
    options: VerifyOptions | None = None,
    progress: Progress | None = None,
    *,
    only_resume_target: bool = False,
) -> RunVerifyReport:
    """Verify every checkpoint below `run`; with `only_resume_target`, only the one a resume would load.

    Checkpoints still being written are reported with a warning, not as failures: a run that is saving
    right now is healthy.

    With `only_resume_target`, a run that has no checkpoint yet (no folder, or only saves still being
    written) is a fresh start: the report is ok with `fresh_start` set, so that a gate such as
    `ckptctl verify RUN --latest -q && torchrun train.py --resume` lets the first launch through. A run
    whose checkpoints are all broken raises `NothingResumable` (exit code 1). A run holding checkpoints of a
    layout ckptctl does not know (state `unknown`) and none it can resume from is no fresh start: it raises
    `UnknownLayout` (exit code 2), since a resume would have something to load.
    """
    options = options or VerifyOptions()
    with scan_context():  # the scan's peeks serve the checkpoints' verification too
        if only_resume_target:
            if not io.exists(run) or all(r.state in _UNFINISHED for r in scan_run(run)):
                return RunVerifyReport(run, (), fresh_start=True)
            # Imported here: only --latest plans a resume, and `verify FILE` starts faster without it (DESIGN §5).
            from ckptctl.ops.resume_plan import plan_resume

            plan = plan_resume(run)
            if plan.checkpoint is None and plan.unknown_layout:
                names = ", ".join(io.relative_to(s.url, run) or "." for s in plan.unknown_layout[:4])
                raise UnknownLayout(
                    f"{run} holds checkpoints of a layout ckptctl does not know ({names}): not a fresh start, "
                    f"and nothing ckptctl can verify ({plan.unknown_layout[0].reason})",
                    "run `ckptctl list` on it; check what a resume would load with the framework that wrote it",
                )
            if plan.checkpoint is None:
                raise NothingResumable(
                    f"{run} holds no checkpoint a resume could load", "run `ckptctl resume-plan` to see why"
                )
            picked = plan.latest_pick
            if picked is not None and picked.url != plan.checkpoint.url:
                return RunVerifyReport(run, (_verify_pick(run, plan, options, progress),))
            refs = [plan.checkpoint]
        else:
            refs = scan_run(run)
        return _verify_refs(run, refs, options, progress)


def _verify_pick(run: str, plan: ResumePlan, options: VerifyOptions, progress: Progress | None) -> VerifyResult:
    """The verdict on what the framework's own latest-finder picks (`plan.latest_pick`), which is not the checkpoint
    ckptctl would resume from: its own problems, and, when it was skipped or fails, an error naming it and the
    checkpoint to pass instead."""
    assert plan.latest_pick is not None and plan.checkpoint is not None
    url = plan.latest_pick.url
    skipped = next((s for s in plan.skipped if s.url == url), None)
    try:
        if skipped is not None and skipped.state in _UNFINISHED:
            result = VerifyResult(url, skipped.layout, skipped.step, (), 0, 0, 0)
        else:
            result = verify_checkpoint(url, replace(options, layout=skipped.layout if skipped else None), progress)
    except CkptctlError as exc:  # no checkpoint at all (an empty `checkpoint-N`)
        result = VerifyResult(url, None, None, (Problem(ProblemKind.MISSING_FILE, "", exc.message),), 0, 0, 0)
    if skipped is None and result.ok:
        return result
    why = skipped.reason if skipped is not None else next(p.message for p in result.problems if p.severity == "error")
    good = plan.checkpoint.url
    headline = Problem(
        ProblemKind.LATEST_NOT_LOADABLE,
        "",
        f"{plan.latest_pick.finder}: it picks {io.relative_to(url, run) or url}, which does not load ({why}); "
        f"resume from {io.relative_to(good, run) or good} instead ({plan.resume_hint}), or run "
        f"`{shell('ckptctl', 'repair', run)}` so that the framework's own pick is a checkpoint that loads",
    )
    return replace(result, problems=(headline, *result.problems))


def _verify_refs(
    run: str, refs: Sequence[CheckpointRef], options: VerifyOptions, progress: Progress | None
) -> RunVerifyReport:
    if not refs:
        raise CheckpointNotFound(
            f"no checkpoints found in {run}", "run `ckptctl list` on the folder above, or check the path"
        )
    results = []
    for ref in refs:
        if ref.state in _UNFINISHED:  # not a checkpoint (yet): worth a word, not a failure of the run
            kind = ProblemKind.IN_PROGRESS if ref.state is CheckpointState.IN_PROGRESS else ProblemKind.ABANDONED
            problem = Problem(kind, "", ref.note or "still being written", severity="warning")
            results.append(VerifyResult(ref.url, ref.layout, ref.step, (problem,), 0, 0, 0))
            continue
        results.append(verify_checkpoint(ref.url, replace(options, layout=ref.layout), progress))
    return RunVerifyReport(run, tuple(results))


#: States of what a save has not finished (or never will): not a checkpoint to verify.
_UNFINISHED = (CheckpointState.IN_PROGRESS, CheckpointState.ABANDONED)


class NothingResumable(CkptctlError):
    """`verify --latest` found nothing a resume could load: the check ran and failed (exit 1)."""

    exit_code = 1


def verify_checkpoint(url: str, options: VerifyOptions | None = None, progress: Progress | None = None) -> VerifyResult:
    """Verify one checkpoint folder; raises only when the folder is not a checkpoint at all."""
    with io.counting() as read:
        return _verify_checkpoint(url, options or VerifyOptions(), progress or NoProgress(), read)


def _verify_checkpoint(url: str, options: VerifyOptions, progress: Progress, read: io.ByteCounter) -> VerifyResult:
    layout, ref = detect(url, options.layout)
    if ref.state is CheckpointState.UNKNOWN:
        return VerifyResult(url, layout.name, ref.step, tuple(read_as_files(ref)), 0, 0, read.bytes_read)
    if ref.state is CheckpointState.IN_PROGRESS:
        problem = Problem(
            ProblemKind.IN_PROGRESS, "", ref.note or "the checkpoint is still being written (no completion marker)"
        )
        return VerifyResult(url, layout.name, ref.step, (problem,), 0, 0, read.bytes_read)
    if ref.state is CheckpointState.ABANDONED:
        problem = Problem(ProblemKind.ABANDONED, "", ref.note)
        return VerifyResult(url, layout.name, ref.step, (problem,), 0, 0, read.bytes_read)
    try:
        checkpoint = layout.open(url)
        problems = checkpoint_problems(layout, checkpoint)
        if ref.state is CheckpointState.SLIM:
            # Imported here: `slim` (its lock, retention and plans) is for slimmed checkpoints alone (DESIGN §5).
            from ckptctl.ops.slim import slim_problems

            problems = slim_problems(layout.name, url, problems)
    except CkptctlError as exc:
        problem = Problem.of_unreadable(exc, "", ProblemKind.BAD_METADATA)
        return VerifyResult(url, layout.name, ref.step, (problem,), 0, 0, read.bytes_read)

    if options.quick:
        return VerifyResult(url, layout.name, ref.step, tuple(problems), 0, 0, read.bytes_read)
    try:
        manifest = read_manifest(url)
    except CkptctlError as exc:
        problems.append(Problem(ProblemKind.BAD_METADATA, DIGESTS_NAME, exc.message))
        manifest = None
    try:
        archives = layout.torch_archives(checkpoint)
    except CkptctlError as exc:
        problems.append(Problem.from_error(exc, ""))
        archives = ()
    record = options.write_manifest and manifest is None
    if manifest is None and not archives and not options.deep and not record:
        # No byte to read beyond the structure (a safetensors file without a manifest: raw bytes carry no CRC): a
        # verify of one file starts without the content checks' code (DESIGN §5: a command's fixed cost).
        return VerifyResult(url, layout.name, ref.step, tuple(problems), 0, 0, read.bytes_read)
    from ckptctl.ops.content import ContentChecks, check_content
    from ckptctl.ops.digests import save_digests

    checks = ContentChecks(
        manifest=manifest,
        deep=options.deep,
        check_finite=options.check_finite,
        record_digests=record,
        workers=options.workers,
        ranks=options.ranks,
    )
    broken = frozenset(p.path for p in problems if p.severity == "error")
    content = check_content(checkpoint, archives, checks, progress, broken)
    said = {p.message for p in problems}  # a truncated file fails the structure and the read alike
    # Digests recorded before a slim name the files it dropped too.
    dropped: frozenset[str] = frozenset()
    if ref.state is CheckpointState.SLIM:
        from ckptctl.ops.slim import dropped_files

        dropped = dropped_files(url)
    problems.extend(p for p in content.problems if p.message not in said and p.path not in dropped)
    wrote = False
    if record:
        if any(p.severity == "error" for p in problems):
            problems.append(
                Problem(
                    ProblemKind.BAD_METADATA,
                    DIGESTS_NAME,
                    "not writing digests: the checkpoint fails verify, and digests would bless its current state",
                    severity="warning",
                )
            )
        else:
            if options.ranks is None or options.ranks.leader:
                save_digests(url, content.digests)
            wrote = True
    return VerifyResult(
        url,
        layout.name,
        ref.step,
        tuple(problems),
        content.digests_checked,
        content.tensors_read,
        read.bytes_read,
        wrote,
        content.crc_records_checked,
    )
