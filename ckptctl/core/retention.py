"""Retention: which checkpoints of a run to keep, as a pure plan over what is known about them.

The same `RetentionPolicy` serves the manager (applied after each commit) and `ckptctl prune`. Planning is
separate from deleting, so a dry run is free and the rules are testable without touching a disk: the
callers gather the facts about each checkpoint into a `Candidate` (step, time, size, metrics, and the
protections they detected on disk), and `RetentionPolicy.plan` returns one `Decision` per candidate.

How a plan is made, per series (the checkpoints of one folder, e.g. `_actor/` and `_critic/` apart):

1. Protections keep a checkpoint whatever the rules say: the newest complete checkpoint, pinned steps, the
   reasons the caller found (a `latest` pointer names it, it is being written, ...), checkpoints without a
   step or an epoch (they cannot be ordered; epoch folders such as `epoch_3/` are ordered by epoch) and, with `older_than`, those not older than that.
2. Rules, composed with "any": `keep_last` (the newest N complete checkpoints), `keep_every` (complete
   checkpoints whose step is a multiple of K), `keep_best` (the complete checkpoint with the best value of
   a metric). Broken and superseded checkpoints are kept by no rule: a rule keeps checkpoints a resume
   could load. What a killed save left (`Candidate.abandoned`) is not a checkpoint at all: not even a
   policy without rules keeps it; only the protections of 1 do.
3. `max_total_size`, over the whole run: while the run is larger, checkpoints that only rules keep are
   deleted, oldest first (those `keep_best` keeps last of all). Protected ones never go.

4. `keep_full_last` (slim instead of delete): of the checkpoints kept, only the newest N complete ones of each
   series stay whole, with every protected one; the others are kept slim (`Decision.slim`: the caller drops
   their training-only state, `ckptctl slim`), so a run keeps each model it keeps and pays for the optimizer
   state of the newest N only.

A policy with no rule at all keeps everything. With `older_than` and no other rule, every unprotected
checkpoint older than the age is deleted; with only `max_total_size`, checkpoints go only to fit the budget.

This module imports nothing heavy (no torch), so that `ckptctl prune` works where torch is not installed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from ckptctl.units import format_age, format_size, parse_age, parse_size

__all__ = [
    "Candidate",
    "Decision",
    "KeepBest",
    "RetentionPolicy",
]

NEWEST = "newest complete"
PINNED = "pinned"
NO_STEP = "no step (cannot be ordered)"
NO_RULE = "no rule keeps it"
BROKEN = "not complete (rules keep only complete checkpoints)"


@dataclass(frozen=True, slots=True)
class Candidate:
    """What retention knows about one checkpoint. Facts only: the caller reads the disk, the policy decides.

    Attributes:
        step: the global step, or None when nothing says (such a checkpoint is never deleted unless it has an
            epoch).
        url: identifies the checkpoint in the decisions (a path or URL; any unique string).
        series: checkpoints with the same series are ordered against each other (their folder).
        created: when the checkpoint was written (for `older_than` and for "oldest first").
        size_bytes: bytes deleting it would free (for `max_total_size`).
        complete: committed and whole; only complete checkpoints count for the rules.
        metrics: numbers recorded with the checkpoint (for `keep_best`).
        protected: why it may never be deleted, as found by the caller (`named by latest`, ...). The
            plan flags a protected checkpoint that no rule keeps as `blocked`.
        busy: why it is being written right now, or "" (kept, and never counted as blocked).
        note: why it is not complete (superseded by a rollback, an abandoned save), given as the reason it
            goes; "" says it is broken.
        abandoned: what a save left when its writer stopped: no rule keeps it (see the module docstring).
        epoch: the epoch, which orders checkpoints that have no step (`epoch_0/`, `epoch_1/` model folders).
        slim: its training-only state was dropped already (`ckptctl slim`): it counts as complete for the
            rules, and is never slimmed again nor counted among the `keep_full_last` whole ones.
    """

    step: int | None
    url: str = ""
    series: str = ""
    created: datetime | None = None
    size_bytes: int = 0
    complete: bool = True
    metrics: Mapping[str, Any] = field(default_factory=dict)
    protected: tuple[str, ...] = ()
    busy: str = ""
    note: str = ""
    abandoned: bool = False
    epoch: float | None = None

    @property
    def ordered(self) -> bool:
        """Whether it has a place in its series: a step, or an epoch."""
        return self.step is not None or self.epoch is not None

    slim: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether to keep one checkpoint, and why.

    Attributes:
        step: the global step.
        keep: True to keep the checkpoint, False to delete it.
        reasons: what keeps it (`newest complete`, `keep_last=3`, `pinned`, `named by latest`, ...), or why
            it goes (`no rule keeps it`, `over max_total_size=500GB`).
        url: the candidate's url.
        blocked: no rule keeps it, only a protection the caller found (a pointer names it, ...): the
            policy wanted it deleted and could not.
        slim: kept, without its training-only state (`keep_full_last`): the caller slims it.
    """

    step: int | None
    keep: bool
    reasons: tuple[str, ...]
    url: str = ""
    blocked: bool = False
    slim: bool = False


@dataclass(frozen=True, slots=True)
class KeepBest:
    """Keep the complete checkpoint with the lowest (`min`) or highest (`max`) value of a metric."""

    metric: str
    mode: Literal["min", "max"]

    @classmethod
    def parse(cls, text: str) -> KeepBest:
        """`eval_loss`, `eval_loss:min` or `accuracy:max`. Without a mode, metrics whose name ends in
        `loss`, `perplexity`, `ppl` or `error` are minimised and the others maximised (as the HF Trainer
        defaults `greater_is_better`).

        Raises:
            ValueError: an empty metric name or a mode other than min/max.
        """
        metric, sep, mode = text.strip().rpartition(":")
        if not sep:
            metric, mode = text.strip(), ""
        metric = metric.strip()
        if not metric:
            raise ValueError(f"{text!r}: name a metric, e.g. eval_loss:min")
        if not mode:
            lowered = metric.lower()
            mode = "min" if lowered.endswith(("loss", "perplexity", "ppl", "error")) else "max"
        if mode not in ("min", "max"):
            raise ValueError(f"{text!r}: the mode after ':' must be min or max")
        return cls(metric, "min" if mode == "min" else "max")

    def __str__(self) -> str:
        return f"{self.metric}:{self.mode}"

    def value(self, metrics: Mapping[str, Any]) -> float | None:
        value = metrics.get(self.metric)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return None
        return float(value)


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """Rules for which checkpoints to keep (see the module docstring for how they combine).

    Attributes:
        keep_last: keep the newest N complete checkpoints of each series.
        keep_every: keep complete checkpoints whose step is divisible by K (long-term milestones).
        keep_best: keep the best complete checkpoint of each series by each of these metrics.
        max_total_size: delete checkpoints only rules keep, oldest first, until the run holds at most this
            many bytes.
        older_than: only checkpoints older than this may be deleted.
        pin: steps never deleted.
        keep_full_last: of the checkpoints kept, the newest N complete ones of each series (and the protected
            ones) stay whole; the others are kept slim (`Decision.slim`). None keeps every kept one whole.

    A policy with no rule keeps everything.

    Example:
        >>> policy = RetentionPolicy(keep_last=3, keep_every=1000, keep_best=(KeepBest.parse("eval_loss"),))
        >>> [d.step for d in policy.plan([500, 1000, 1500, 2000, 2500, 3000]) if not d.keep]
        [500, 1500]
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: tuple[KeepBest, ...] = ()
    max_total_size: int | None = None
    older_than: timedelta | None = None
    pin: frozenset[int] = frozenset()
    keep_full_last: int | None = None

    def __post_init__(self) -> None:
        for rule in ("keep_last", "keep_every", "keep_full_last"):
            value = getattr(self, rule)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{rule} must be a positive integer or None, not {value!r}")
        size = self.max_total_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise ValueError(f"max_total_size must be a number of bytes >= 0 or None, not {size!r}")
        if self.older_than is not None and (
            not isinstance(self.older_than, timedelta) or self.older_than < timedelta(0)
        ):
            raise ValueError(f"older_than must be a non-negative timedelta or None, not {self.older_than!r}")
        best = self.keep_best
        if isinstance(best, KeepBest | str):
            best = (best,)
        object.__setattr__(self, "keep_best", tuple(KeepBest.parse(b) if isinstance(b, str) else b for b in best))
        if not all(isinstance(b, KeepBest) for b in self.keep_best):
            raise ValueError(f"keep_best must hold KeepBest rules or 'metric[:min|max]' strings, not {best!r}")
        pins = frozenset(self.pin)
        if any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in pins):
            raise ValueError(f"pin must hold non-negative steps, not {sorted(pins, key=str)!r}")
        object.__setattr__(self, "pin", pins)

    @classmethod
    def from_mapping(cls, rules: Mapping[str, Any]) -> RetentionPolicy:
        """A policy from plain values, as a `ckptctl.toml` `[retention]` table holds them.

        Keys: `keep_last`, `keep_every`, `keep_full_last` (integers), `keep_best` (`"eval_loss:min"` or a list of those),
        `max_total_size` (`"500GB"`, `"2TiB"` or bytes), `older_than` (`"7d"`, `"12h"`, `"30m"`), `pin` (a
        list of steps).

        Raises:
            ValueError: an unknown key or a value of the wrong kind (the message names the key).
        """
        known = ("keep_last", "keep_every", "keep_best", "max_total_size", "older_than", "pin", "keep_full_last")
        unknown = sorted(set(rules) - set(known))
        if unknown:
            raise ValueError(f"unknown retention rule(s) {', '.join(unknown)} (known: {', '.join(known)})")
        values: dict[str, Any] = {}
        for key in ("keep_last", "keep_every", "keep_full_last"):
            if key in rules:
                values[key] = _integer(rules[key], key)
        if "keep_best" in rules:
            best = rules["keep_best"]
            items = [best] if isinstance(best, str) else best
            if not isinstance(items, list) or not all(isinstance(b, str) for b in items):
                raise ValueError(f"keep_best must be 'metric[:min|max]' or a list of those, not {best!r}")
            values["keep_best"] = tuple(KeepBest.parse(b) for b in items)
        if "max_total_size" in rules:
            size = rules["max_total_size"]
            values["max_total_size"] = parse_size(size) if isinstance(size, str) else _integer(size, "max_total_size")
        if "older_than" in rules:
            age = rules["older_than"]
            if not isinstance(age, str):
                raise ValueError(f"older_than must be an age such as '7d', '12h' or '30m', not {age!r}")
            values["older_than"] = parse_age(age)
        if "pin" in rules:
            pins = rules["pin"]
            if not isinstance(pins, list):
                raise ValueError(f"pin must be a list of steps, not {pins!r}")
            values["pin"] = frozenset(_integer(p, "pin") for p in pins)
        return cls(**values)

    @property
    def keeps_everything(self) -> bool:
        """True when no rule can delete anything (pins alone delete nothing)."""
        return not self._keep_rules and self.max_total_size is None and self.older_than is None

    @property
    def _keep_rules(self) -> bool:
        return self.keep_last is not None or self.keep_every is not None or bool(self.keep_best)

    def describe(self) -> str:
        """The rules in one line (`keep_last=3, keep_every=1000, max_total_size=500GB`)."""
        parts = []
        if self.keep_last is not None:
            parts.append(f"keep_last={self.keep_last}")
        if self.keep_every is not None:
            parts.append(f"keep_every={self.keep_every}")
        parts += [f"keep_best={best}" for best in self.keep_best]
        if self.max_total_size is not None:
            parts.append(f"max_total_size={format_size(self.max_total_size)}")
        if self.older_than is not None:
            parts.append(f"older_than={format_age(self.older_than)}")
        if self.pin:
            parts.append(f"pin={','.join(map(str, sorted(self.pin)))}")
        if self.keep_full_last is not None:
            parts.append(f"keep_full_last={self.keep_full_last}")
        return ", ".join(parts) or "no rule (keeps everything)"

    def to_json(self) -> dict[str, Any]:
        return {
            "keep_last": self.keep_last,
            "keep_every": self.keep_every,
            "keep_best": [str(b) for b in self.keep_best],
            "max_total_size": self.max_total_size,
            "older_than_seconds": None if self.older_than is None else self.older_than.total_seconds(),
            "pin": sorted(self.pin),
            "keep_full_last": self.keep_full_last,
        }

    def plan(self, checkpoints: Iterable[Candidate | int], *, now: datetime | None = None) -> list[Decision]:
        """Decide for each checkpoint; ordered by series, then step (oldest first), step-less ones first.

        Pure: it reads no files and depends on nothing but its arguments. Bare integers are steps of
        complete checkpoints (the manager's view); candidates with the same url collapse into one.

        Args:
            checkpoints: what is known about each checkpoint of the run.
            now: the current time; required when the policy has `older_than`.

        Raises:
            ValueError: `older_than` without `now`.
        """
        if self.older_than is not None and now is None:
            raise ValueError("a policy with older_than needs `now` to plan")
        unique: dict[str, Candidate] = {}
        for item in checkpoints:
            candidate = item if isinstance(item, Candidate) else Candidate(step=int(item), url=str(int(item)))
            unique.setdefault(candidate.url, candidate)
        ordered = sorted(unique.values(), key=_order)
        hard: dict[str, list[str]] = {c.url: self._protections(c, now) for c in ordered}
        soft: dict[str, list[str]] = {c.url: [] for c in ordered}
        for series in _series(ordered):
            self._apply_rules(series, hard, soft)
        evicted = self._fit_budget(ordered, hard, soft)

        whole = self._whole(ordered, hard, soft, evicted)
        decisions = []
        for c in ordered:
            reasons = hard[c.url] + soft[c.url]
            if c.url in evicted:
                decisions.append(Decision(c.step, False, (evicted[c.url],), c.url))
            elif reasons:
                blocked = not soft[c.url] and not c.busy and set(hard[c.url]) <= set(c.protected)
                slim = self.keep_full_last is not None and c.complete and not c.slim and c.url not in whole
                if slim:
                    reasons = [*reasons, f"slim (keep_full_last={self.keep_full_last})"]
                decisions.append(Decision(c.step, True, tuple(reasons), c.url, blocked, slim))
            else:
                decisions.append(Decision(c.step, False, (NO_RULE if c.complete else c.note or BROKEN,), c.url))
        return decisions

    def _whole(
        self,
        ordered: list[Candidate],
        hard: dict[str, list[str]],
        soft: dict[str, list[str]],
        evicted: dict[str, str],
    ) -> set[str]:
        """The kept checkpoints `keep_full_last` leaves whole: the newest N complete (not slim) ones of each
        series, and every one a protection keeps (the newest complete, what a pointer names, one being
        written, pinned steps, ...)."""
        if self.keep_full_last is None:
            return set()
        whole = {c.url for c in ordered if hard[c.url]}
        for series in _series(ordered):
            kept = [
                c for c in series if c.complete and not c.slim and c.url not in evicted and (hard[c.url] or soft[c.url])
            ]
            whole |= {c.url for c in kept[-self.keep_full_last :]}
        return whole

    def _protections(self, c: Candidate, now: datetime | None) -> list[str]:
        reasons = list(c.protected)
        if c.busy:
            reasons.append(c.busy)
        if not c.ordered:
            reasons.append(NO_STEP)
        elif c.step in self.pin:
            reasons.append(PINNED)
        if self.older_than is not None and now is not None:
            if c.created is None:
                reasons.append("age unknown (older_than)")
            elif _aware(now) - _aware(c.created) <= self.older_than:
                reasons.append(f"not older than {format_age(self.older_than)}")
        return reasons

    def _apply_rules(self, series: list[Candidate], hard: dict[str, list[str]], soft: dict[str, list[str]]) -> None:
        usable = [c for c in series if c.complete and c.ordered]
        if usable:
            hard[usable[-1].url].insert(0, NEWEST)
        if self.keep_last is not None:
            for c in usable[-self.keep_last :]:
                soft[c.url].append(f"keep_last={self.keep_last}")
        if self.keep_every is not None:
            for c in usable:
                if c.step is not None and c.step % self.keep_every == 0:
                    soft[c.url].append(f"keep_every={self.keep_every}")
        for best in self.keep_best:
            scored = [(v, c) for c in usable if (v := best.value(c.metrics)) is not None]
            if scored:
                sign = 1 if best.mode == "max" else -1
                # Ties go to the newest: `usable` is oldest first and max() keeps the first maximum.
                value, winner = max(reversed(scored), key=lambda vc: sign * vc[0])
                soft[winner.url].append(f"best {best.metric} ({best.mode}) = {value:g}")
        checkpoints = [c for c in series if not c.abandoned]
        if not self._keep_rules and self.max_total_size is not None:
            for c in checkpoints:
                soft[c.url].append("no keep rule (max_total_size decides)")
        if self.keeps_everything:
            for c in checkpoints:
                soft[c.url].append("no retention rule")

    def _fit_budget(
        self, ordered: list[Candidate], hard: dict[str, list[str]], soft: dict[str, list[str]]
    ) -> dict[str, str]:
        """Checkpoints to delete so that the run fits `max_total_size` -> the reason."""
        if self.max_total_size is None:
            return {}
        kept = [c for c in ordered if hard[c.url] or soft[c.url]]
        total = sum(c.size_bytes for c in kept)
        if total <= self.max_total_size:
            return {}
        evictable = [c for c in kept if not hard[c.url]]
        # Oldest first; checkpoints that keep_best keeps go last of all (they are the valuable ones).
        evictable.sort(key=lambda c: (any(r.startswith("best ") for r in soft[c.url]), *_age_key(c)))
        reason = f"over max_total_size={format_size(self.max_total_size)}"
        evicted = {}
        for c in evictable:
            if total <= self.max_total_size:
                break
            evicted[c.url] = reason
            total -= c.size_bytes
        return evicted


def _order(c: Candidate) -> tuple[Any, ...]:
    return (c.series, c.ordered, c.step is not None, c.step or 0, c.epoch or 0.0, *_age_key(c), c.url)


def _age_key(c: Candidate) -> tuple[float, int]:
    return (_aware(c.created).timestamp() if c.created else -math.inf, c.step if c.step is not None else -1)


def _series(ordered: list[Candidate]) -> list[list[Candidate]]:
    groups: dict[str, list[Candidate]] = {}
    for c in ordered:
        groups.setdefault(c.series, []).append(c)
    return list(groups.values())


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _integer(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, not {value!r}")
    return value
