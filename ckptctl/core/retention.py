"""Retention: which checkpoints of a run to keep, as a pure plan over step numbers.

The same `RetentionPolicy` serves the manager (applied after each commit) and `ckptctl prune`. Planning
is separate from deleting, so a dry run is free and the rules are testable without touching a disk.
Rules compose with "any": a step is kept when at least one rule keeps it, and the newest step is always
kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Decision", "RetentionPolicy"]


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether to keep one step, and why.

    Attributes:
        step: the global step.
        keep: True to keep the checkpoint, False to delete it.
        reasons: the rules that keep it (`newest`, `keep_last=3`, `keep_every=100`), or why it goes.
    """

    step: int
    keep: bool
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """Rules for which checkpoints to keep.

    Attributes:
        keep_last: keep the newest N steps.
        keep_every: keep every step divisible by K (long-term milestones).

    A policy with no rule keeps everything.
    """

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for rule in ("keep_last", "keep_every"):
            value = getattr(self, rule)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{rule} must be a positive integer or None, not {value!r}")

    @property
    def keeps_everything(self) -> bool:
        return self.keep_last is None and self.keep_every is None

    def plan(self, steps: Sequence[int]) -> list[Decision]:
        """Decide for each step (duplicates collapse); the result is ordered by step, oldest first.

        Pure: it reads no files and depends on nothing but `steps` and the policy.
        """
        ordered = sorted(set(steps))
        recent = set(ordered[-self.keep_last :]) if self.keep_last else set()
        decisions = []
        for step in ordered:
            reasons: list[str] = []
            if step == ordered[-1]:
                reasons.append("newest")
            if step in recent:
                reasons.append(f"keep_last={self.keep_last}")
            if self.keep_every and step % self.keep_every == 0:
                reasons.append(f"keep_every={self.keep_every}")
            if self.keeps_everything:
                reasons.append("no retention rule")
            keep = bool(reasons)
            decisions.append(Decision(step, keep, tuple(reasons) if keep else ("no rule keeps it",)))
        return decisions
