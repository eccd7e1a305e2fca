"""`report`: what a page about one run shows, as data (DESIGN §4 `report`); `ops.report_html` draws it.

Everything comes from the commands that already answer each question, so the page and the commands never
disagree:

- the checkpoints, their states and sizes, and which one a `latest` pointer names: the run's scan (`list`);
- which one a resume would load: `resume_targets` (resume-plan's pick, per folder of checkpoints);
- the bytes by component: each checkpoint's tensor index (headers only), model / optimizer / the rest;
- what prune and slim would free: their plans (read-only) under the run's `ckptctl.toml`, or, without one,
  `DEFAULT_POLICY` and slim's own default;
- the curves: each checkpoint's recorded metrics, or the log its framework keeps in it
  (`Layout.metric_history`: the Trainer's `log_history`) where it keeps one;
- the weight drift: `diff` of the models of consecutive whole checkpoints of each folder, its per-tensor
  relative L2 differences grouped by layer (`layer_of`). `diff` streams tensor pairs block by block, so memory
  stays flat whatever the model's size; `last` bounds how many pairs are read.

A layer's drift is the root mean square of its tensors' relative L2 differences weighted by their element
counts: the relative change of the layer as a whole when its tensors' values have similar magnitudes, and
what `diff` can give without a second pass (it keeps no norms of the tensors it proves identical unread).
"""

from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Component
from ckptctl.core.retention import RetentionPolicy
from ckptctl.errors import CkptctlError
from ckptctl.layouts import DEFAULT_SCAN_DEPTH, get_layout, scan_run
from ckptctl.ops.diff import DiffOptions, DiffReport, TensorDiff, diff
from ckptctl.ops.prune import DEFAULT_GRACE, POLICY_FILE, load_policy_file, plan_prune
from ckptctl.ops.report import SCHEMA_VERSION, NoProgress, Progress, display_path, finite_json, flatten, iso, ref_json
from ckptctl.ops.resume_plan import RESUME_TARGET, resume_targets
from ckptctl.ops.slim import DEFAULT_KEEP_FULL, load_slim_settings, plan_slim

__all__ = [
    "DEFAULT_LAST",
    "DEFAULT_POLICY",
    "CheckpointRow",
    "Curve",
    "Drift",
    "DriftPair",
    "LayerChange",
    "ReportOptions",
    "RunReport",
    "layer_changes",
    "layer_of",
    "run_report",
]

#: The prune rules the page shows when the run has no `ckptctl.toml`: an example a person can compare against.
DEFAULT_POLICY = RetentionPolicy(keep_last=3)
#: Pairs of consecutive checkpoints per folder whose drift is computed by default (the newest ones): each pair
#: reads both models, so a run of hundreds of checkpoints is not read twice over unless asked (`last=None`).
DEFAULT_LAST = 10
#: Points per curve kept on the page (evenly thinned beyond, first and last kept): a smooth line at any width.
MAX_POINTS = 1000
#: Curves per folder on the page (the rest are named in the notes).
MAX_CURVES = 16
#: States whose checkpoints hold a whole model: the drift compares them.
_MODEL_STATES = (CheckpointState.COMPLETE, CheckpointState.SLIM)
#: Log keys that count where the training is, not how it goes.
_NOT_METRICS = frozenset({"step", "epoch", "global_step", "total_flos"})


@dataclass(frozen=True, slots=True)
class ReportOptions:
    """What the report computes.

    Attributes:
        drift: compute the per-layer weight drift (reads the models of the compared checkpoints).
        last: the drift covers at most this many newest pairs of each folder (None: all).
        verify: verify each checkpoint (`verify`'s structural checks) and show the verdict.
        max_depth: how deep to look for checkpoints.
    """

    drift: bool = True
    last: int | None = DEFAULT_LAST
    verify: bool = False
    max_depth: int = DEFAULT_SCAN_DEPTH


@dataclass(frozen=True, slots=True)
class CheckpointRow:
    """One checkpoint of the run as the page shows it.

    Attributes:
        ref: the checkpoint as `list` sees it.
        path: its path relative to the run.
        resume: a resume of its folder would load it (resume-plan's pick).
        bytes_by_part: `model`, `optimizer` and `other` bytes (tensor bytes of each component; the rest of its
            size is `other`); empty when it could not be opened.
        prune: what prune's plan does with it: `keep`, `delete`, `slim`, or "" when it is not in the plan.
        prune_reasons: why (what keeps it, or why it goes).
        prune_frees: bytes prune's plan frees from it (deleted or slimmed).
        slim_frees: bytes slim's plan frees from it.
        verified: verify's verdict (None: not verified).
        problems: verify's error messages, when verified.
        error: why it could not be opened ("" when it was).
    """

    ref: CheckpointRef
    path: str
    resume: bool = False
    bytes_by_part: Mapping[str, int] = field(default_factory=dict)
    prune: str = ""
    prune_reasons: tuple[str, ...] = ()
    prune_frees: int = 0
    slim_frees: int = 0
    verified: bool | None = None
    problems: tuple[str, ...] = ()
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        doc = ref_json(self.ref)
        doc.update(
            path=self.path,
            resume=self.resume,
            bytes_by_part=dict(self.bytes_by_part),
            prune={"action": self.prune or None, "reasons": list(self.prune_reasons), "frees": self.prune_frees},
            slim_frees=self.slim_frees,
            verify=None if self.verified is None else {"ok": self.verified, "problems": list(self.problems)},
            error=self.error or None,
        )
        return doc


@dataclass(frozen=True, slots=True)
class Curve:
    """One metric of one folder of checkpoints over the steps.

    Attributes:
        folder: the folder, relative to the run ("." for the run itself).
        metric: the metric's name as recorded (nested names dotted).
        points: (step, value), by step.
        source: `log` (the framework's log kept in the newest checkpoint) or `checkpoints` (each checkpoint's
            own metrics).
    """

    folder: str
    metric: str
    points: tuple[tuple[int, float], ...]
    source: str

    def to_json(self) -> dict[str, Any]:
        return {
            "folder": self.folder,
            "metric": self.metric,
            "source": self.source,
            "points": [list(p) for p in self.points],
        }


@dataclass(frozen=True, slots=True)
class LayerChange:
    """How one layer (a group of tensors, `layer_of`) changed between two checkpoints.

    Attributes:
        layer: the group's name.
        rel_l2: the root mean square of its tensors' relative L2 differences, weighted by element counts.
        max_rel_l2: its most changed tensor's relative L2 difference.
        tensors: tensors compared in the group.
        numel: their elements.
    """

    layer: str
    rel_l2: float
    max_rel_l2: float
    tensors: int
    numel: int

    def to_json(self) -> dict[str, Any]:
        return finite_json(
            {
                "layer": self.layer,
                "rel_l2": self.rel_l2,
                "max_rel_l2": self.max_rel_l2,
                "tensors": self.tensors,
                "numel": self.numel,
            }
        )


@dataclass(frozen=True, slots=True)
class DriftPair:
    """Two consecutive checkpoints compared, and what changed per layer (empty with `error`)."""

    a: str
    b: str
    a_step: int | None
    b_step: int | None
    layers: tuple[LayerChange, ...] = ()
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "a_step": self.a_step,
            "b_step": self.b_step,
            "layers": [c.to_json() for c in self.layers],
            "error": self.error or None,
        }


@dataclass(frozen=True, slots=True)
class Drift:
    """The weight drift along one folder of checkpoints: layers x pairs.

    Attributes:
        folder: the folder, relative to the run.
        pairs: the pairs compared, oldest first.
        layers: every layer any pair holds, in name order (numbers as numbers).
        skipped: older pairs left out by `ReportOptions.last`.
    """

    folder: str
    pairs: tuple[DriftPair, ...]
    layers: tuple[str, ...]
    skipped: int = 0

    def value(self, layer: str, pair: DriftPair) -> float | None:
        found = next((c for c in pair.layers if c.layer == layer), None)
        return None if found is None else found.rel_l2

    def to_json(self) -> dict[str, Any]:
        return {
            "folder": self.folder,
            "layers": list(self.layers),
            "pairs": [p.to_json() for p in self.pairs],
            "skipped_pairs": self.skipped,
        }


@dataclass(frozen=True, slots=True)
class RunReport:
    """Everything the page about a run shows.

    Attributes:
        run: the run folder.
        created: when the report was made.
        checkpoints: every checkpoint, by folder and step.
        policy: the prune rules applied, as a person reads them, and where they come from.
        slim_policy: slim's settings applied, likewise.
        prune_frees: bytes prune's plan frees.
        slim_frees: bytes slim's plan frees.
        curves: the recorded metrics.
        drift: the weight drift of each folder with at least two whole checkpoints (empty without drift).
        drift_computed: whether drift was asked for.
        notes: remarks for a person (what could not be read, what was left out).
    """

    run: str
    created: datetime
    checkpoints: tuple[CheckpointRow, ...]
    policy: str
    slim_policy: str
    prune_frees: int
    slim_frees: int
    curves: tuple[Curve, ...]
    drift: tuple[Drift, ...]
    drift_computed: bool
    notes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(c.ref.size_bytes for c in self.checkpoints)

    def bytes_by_part(self) -> dict[str, int]:
        """Bytes by part over every checkpoint, `unread` for those that could not be opened."""
        totals: dict[str, int] = defaultdict(int)
        for row in self.checkpoints:
            if row.bytes_by_part:
                for part, n in row.bytes_by_part.items():
                    totals[part] += n
            else:
                totals["unread"] += row.ref.size_bytes
        return dict(totals)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "run": self.run,
            "created": iso(self.created),
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "total_bytes": self.total_bytes,
            "bytes_by_part": self.bytes_by_part(),
            "prune": {"policy": self.policy, "frees": self.prune_frees},
            "slim": {"policy": self.slim_policy, "frees": self.slim_frees},
            "curves": [c.to_json() for c in self.curves],
            "drift": [d.to_json() for d in self.drift] if self.drift_computed else None,
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------------------------------
# Layers.
# --------------------------------------------------------------------------------------------------


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: its name up to the first numbered part (`model.layers.3.mlp.up.weight`
    -> `model.layers.3`), else without its last part (`model.embed_tokens.weight` -> `model.embed_tokens`)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def _natural(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders `layers.2` before `layers.10`."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", text) if p)


def layer_changes(report: DiffReport) -> tuple[LayerChange, ...]:
    """The per-layer change of a comparison that kept its equal pairs (`DiffOptions.keep_equal`), in name order.
    Pairs whose values were not compared (a shape change) are left out."""
    groups: dict[str, list[TensorDiff]] = defaultdict(list)
    for pair in (*report.changed, *report.equal_tensors):
        if pair.rel_l2 is not None:
            groups[layer_of(pair.name)].append(pair)
    out = []
    for layer in sorted(groups, key=_natural):
        pairs = groups[layer]
        numel = sum(p.numel for p in pairs)
        rels = [p.rel_l2 or 0.0 for p in pairs]
        mean_square = sum(p.numel * r * r for p, r in zip(pairs, rels, strict=True)) / numel if numel else 0.0
        out.append(LayerChange(layer, math.sqrt(mean_square), max(rels), len(pairs), numel))
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# The report.
# --------------------------------------------------------------------------------------------------


def run_report(run: str, options: ReportOptions | None = None, progress: Progress | None = None) -> RunReport:
    """Gather what the page about `run` shows (see the module docstring). Read-only.

    Raises:
        CheckpointNotFound: `run` is not a folder.
    """
    from ckptctl.ops.verification import verify_checkpoint

    options = options or ReportOptions()
    progress = progress or NoProgress()
    refs = scan_run(run, max_depth=options.max_depth)
    notes: list[str] = []
    opened: dict[str, Checkpoint] = {}
    errors: dict[str, str] = {}
    for ref in refs:
        try:
            opened[ref.url] = get_layout(ref.layout).open(ref.url)
        except CkptctlError as exc:
            errors[ref.url] = exc.message
    resumed = {url for url, why in resume_targets(run, refs).items() if why == RESUME_TARGET}
    policy, prune_by_url = _prune_plan(run, notes)
    slim_policy, slim_by_url = _slim_plan(run, notes)
    verdicts: dict[str, tuple[bool, tuple[str, ...]]] = {}
    if options.verify:
        progress.start("verifying", len(refs))
        for ref in refs:
            result = verify_checkpoint(ref.url)
            verdicts[ref.url] = (result.ok, tuple(p.message for p in result.problems if p.severity == "error"))
            progress.advance(1)
        progress.finish()
    rows = []
    for ref in refs:
        prune_item = prune_by_url.get(ref.url)
        action, reasons, frees = "", (), 0
        if prune_item is not None:
            action = "slim" if prune_item.slim else ("keep" if prune_item.keep else "delete")
            reasons = prune_item.reasons
            frees = prune_item.slim_bytes if prune_item.slim else (0 if prune_item.keep else prune_item.size_bytes)
        verdict = verdicts.get(ref.url)
        rows.append(
            CheckpointRow(
                ref=ref,
                path=display_path(ref.url, run) or ".",
                resume=ref.url in resumed,
                bytes_by_part=_parts(opened[ref.url]) if ref.url in opened else {},
                prune=action,
                prune_reasons=tuple(reasons),
                prune_frees=frees,
                slim_frees=slim_by_url.get(ref.url, 0),
                verified=None if verdict is None else verdict[0],
                problems=() if verdict is None else verdict[1],
                error=errors.get(ref.url, ""),
            )
        )
    rows.sort(key=lambda r: (io.parent_of(r.ref.url), r.ref.step is not None, r.ref.step or 0, r.ref.url))
    curves = _curves(run, refs, opened, notes)
    drift = _drift(run, refs, options, progress) if options.drift else ()
    return RunReport(
        run=run,
        created=datetime.now(UTC),
        checkpoints=tuple(rows),
        policy=policy,
        slim_policy=slim_policy,
        prune_frees=sum(r.prune_frees for r in rows),
        slim_frees=sum(r.slim_frees for r in rows),
        curves=curves,
        drift=drift,
        drift_computed=options.drift,
        notes=tuple(notes),
    )


def _parts(checkpoint: Checkpoint) -> dict[str, int]:
    """Model, optimizer and other bytes of an opened checkpoint (a tensor index it cannot read: all other)."""
    parts = {"model": 0, "optimizer": 0, "other": 0}
    try:
        for entry in checkpoint.tensors():
            if entry.component is Component.MODEL:
                parts["model"] += entry.nbytes
            elif entry.component is Component.OPTIMIZER:
                parts["optimizer"] += entry.nbytes
    except CkptctlError:
        parts["model"] = parts["optimizer"] = 0
    parts["other"] = max(0, checkpoint.ref.size_bytes - parts["model"] - parts["optimizer"])
    return parts


def _prune_plan(run: str, notes: list[str]) -> tuple[str, dict[str, Any]]:
    """(the rules as a person reads them, url -> prune's planned item)."""
    try:
        found = load_policy_file(run)
    except CkptctlError as exc:
        notes.append(f"prune: {exc.message}")
        return "unreadable policy file", {}
    if found is None:
        policy, grace = DEFAULT_POLICY, None
        where = f"no {POLICY_FILE}: an example policy"
    else:
        policy, grace = found
        where = f"from {POLICY_FILE}"
    try:
        plan = plan_prune(run, policy, grace=grace or DEFAULT_GRACE)
    except CkptctlError as exc:
        notes.append(f"prune: {exc.message}")
        return f"{policy.describe()} ({where})", {}
    return f"{policy.describe()} ({where})", {item.url: item for item in plan.items}


def _slim_plan(run: str, notes: list[str]) -> tuple[str, dict[str, int]]:
    """(slim's settings as a person reads them, url -> bytes slim's plan frees)."""
    try:
        keep_full, older_than = load_slim_settings(run)
    except CkptctlError as exc:
        notes.append(f"slim: {exc.message}")
        return "unreadable [slim] table", {}
    where = f"from {POLICY_FILE}" if keep_full is not None or older_than is not None else "the default"
    described = f"keep_full={keep_full or DEFAULT_KEEP_FULL}" + (f", older_than={older_than}" if older_than else "")
    try:
        plan = plan_slim(run, keep_full=keep_full or DEFAULT_KEEP_FULL, older_than=older_than)
    except CkptctlError as exc:
        notes.append(f"slim: {exc.message}")
        return f"{described} ({where})", {}
    return f"{described} ({where})", {item.url: item.freed_bytes for item in plan.slim}


# --------------------------------------------------------------------------------------------------
# Curves.
# --------------------------------------------------------------------------------------------------


def _curves(
    run: str, refs: list[CheckpointRef], opened: Mapping[str, Checkpoint], notes: list[str]
) -> tuple[Curve, ...]:
    """Per folder: the log kept in its newest whole checkpoint that keeps one, else its checkpoints' metrics."""
    by_folder: dict[str, list[Checkpoint]] = defaultdict(list)
    for ref in refs:
        if ref.url in opened and ref.state in _MODEL_STATES:
            by_folder[io.parent_of(ref.url)].append(opened[ref.url])
    curves: list[Curve] = []
    for folder in sorted(by_folder):
        members = sorted(by_folder[folder], key=lambda c: c.ref.step or 0)
        shown = display_path(folder, run) or "."
        series: dict[str, dict[int, float]] = defaultdict(dict)
        source = "checkpoints"
        history = _history(members)
        if history:
            source = "log"
            for entry in history:
                step = entry["step"]
                for name, value in _numbers(entry):
                    series[name][step] = value
        else:
            for checkpoint in members:
                if checkpoint.ref.step is None:
                    continue
                for name, value in _numbers(checkpoint.metrics):
                    series[name][checkpoint.ref.step] = value
        names = sorted(series, key=lambda n: ("loss" not in n.lower(), n))
        if len(names) > MAX_CURVES:
            notes.append(
                f"curves of {shown}: {len(names) - MAX_CURVES} more metrics not drawn: {', '.join(names[MAX_CURVES:])}"
            )
        for name in names[:MAX_CURVES]:
            points = sorted(series[name].items())
            if len(points) >= 1:
                curves.append(Curve(shown, name, _thinned(points), source))
    return tuple(curves)


def _history(members: list[Checkpoint]) -> tuple[Mapping[str, Any], ...]:
    for checkpoint in reversed(members):
        try:
            history = get_layout(checkpoint.layout).metric_history(checkpoint)
        except CkptctlError:
            continue
        if history:
            return history
    return ()


def _numbers(metrics: Mapping[str, Any]) -> Iterable[tuple[str, float]]:
    for name, value in flatten(metrics).items():
        if name in _NOT_METRICS or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            yield name, float(value)


def _thinned(points: list[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    if len(points) <= MAX_POINTS:
        return tuple(points)
    stride = (len(points) - 1) / (MAX_POINTS - 1)
    return tuple(points[round(i * stride)] for i in range(MAX_POINTS))


# --------------------------------------------------------------------------------------------------
# Drift.
# --------------------------------------------------------------------------------------------------


def _drift(run: str, refs: list[CheckpointRef], options: ReportOptions, progress: Progress) -> tuple[Drift, ...]:
    """The per-layer drift of consecutive whole checkpoints of each folder, the newest `options.last` pairs."""
    by_folder: dict[str, list[CheckpointRef]] = defaultdict(list)
    for ref in refs:
        if ref.state in _MODEL_STATES and ref.step is not None:
            by_folder[io.parent_of(ref.url)].append(ref)
    planned: list[tuple[str, list[tuple[CheckpointRef, CheckpointRef]], int]] = []
    for folder in sorted(by_folder):
        members = sorted(by_folder[folder], key=lambda r: (r.step or 0, r.url))
        pairs = list(itertools.pairwise(members))
        keep = len(pairs) if options.last is None else min(len(pairs), options.last)
        if keep:
            planned.append((folder, pairs[len(pairs) - keep :], len(pairs) - keep))
    progress.start("weight drift", sum(len(p) for _, p, _ in planned))
    found = []
    try:
        for folder, pairs, skipped in planned:
            compared = []
            for a, b in pairs:
                compared.append(_compare(run, a, b))
                progress.advance(1)
            layers = sorted({c.layer for p in compared for c in p.layers}, key=_natural)
            found.append(Drift(display_path(folder, run) or ".", tuple(compared), tuple(layers), skipped))
    finally:
        progress.finish()
    return tuple(found)


def _compare(run: str, a: CheckpointRef, b: CheckpointRef) -> DriftPair:
    path_a, path_b = display_path(a.url, run) or ".", display_path(b.url, run) or "."
    try:
        report = diff(a.url, b.url, DiffOptions(keep_equal=True))
    except CkptctlError as exc:
        return DriftPair(path_a, path_b, a.step, b.step, error=exc.message)
    return DriftPair(path_a, path_b, a.step, b.step, layer_changes(report))
