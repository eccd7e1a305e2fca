"""Steps and epochs from checkpoint names: the one set of naming rules every layout and the generic reader go
by (LAYOUTS.md §13), with the framework each rule comes from.

| name | gives | written by |
|---|---|---|
| `epoch=E-step=S[.ckpt]` | step S, epoch E | Lightning's `ModelCheckpoint` default |
| `ep{E}-ba{B}[-rank{R}].pt` | step B (batches are its steps), epoch E | Composer |
| `global_stepN`, `global_step_N` | step N | DeepSpeed (`global_stepN`), verl and ByteCheckpoint (`global_step_N`) |
| `step-N`, `step_N`, `stepN`, `step-00000010`, `steps_N` | step N | LitGPT (`step-00000010`), torchtitan (`step-N`), plain loops |
| `iter_N`, `iter_0000100`, `iteration_N` | step N | Megatron-LM (`iter_0000100`), nanoGPT-style loops |
| `checkpoint-N`, `checkpoint_N`, `ckpt_N` | step N | HF Trainer (`checkpoint-N`), accelerate (`checkpoint_N`: a save count) |
| `epoch_N`, `epoch-N`, `epochN` | epoch N (no step) | torchtune (`epoch_N/` model folders), accelerate's epoch folders |
| `N` | step N | bare numbered folders (`save_dir/100/`) |

A name's checkpoint suffix (`.pt`, `.pth`, `.bin`, `.ckpt`, `.safetensors`) and a trailing rank (`-rank0`) are
removed first; each rule matches the whole remaining name, ignoring case. Checkpoints with equal positions are
ordered by time (the listing's and prune's tie-break).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CHECKPOINT_SUFFIXES", "NameFacts", "epoch_from_name", "name_facts", "step_from_name"]

#: Names frameworks give to files that hold checkpoints.
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")


@dataclass(frozen=True, slots=True)
class NameFacts:
    """What a checkpoint's name says about where training was: a step, an epoch, or both."""

    step: int | None = None
    epoch: int | None = None


#: The naming rules, most specific first; `(?P<epoch>)` and `(?P<step>)` are what each gives.
_NAME_RULES: tuple[re.Pattern[str], ...] = tuple(
    re.compile(pattern, re.IGNORECASE)
    for pattern in (
        r"epoch=(?P<epoch>\d+)-step=(?P<step>\d+)",
        r"ep(?P<epoch>\d+)-ba(?P<step>\d+)",
        r"global_?step_?(?P<step>\d+)",
        r"(?:step|steps|iter|iteration|checkpoint|ckpt)[-_]?(?P<step>\d+)",
        r"epoch[-_]?(?P<epoch>\d+)",
        r"(?P<step>\d+)",
    )
)
_RANK_SUFFIX = re.compile(r"[-_.]rank[-_]?\d+$", re.IGNORECASE)
#: More digits than any step (a hash or a date stamp named like one is no step).
_MAX_DIGITS = 18


def name_facts(name: str) -> NameFacts:
    """The step and epoch a checkpoint's name gives by the naming rules (`step-00000010`, `global_step_20`,
    `iter_0000100`, `checkpoint-30`, `epoch_1`, `epoch=1-step=40.ckpt`, `ep0-ba10-rank0.pt`); none when no rule
    matches the whole name."""
    stem = name
    for suffix in CHECKPOINT_SUFFIXES:
        stem = stem.removesuffix(suffix)
    stem = _RANK_SUFFIX.sub("", stem)
    for rule in _NAME_RULES:
        m = rule.fullmatch(stem)
        if m:
            found = m.groupdict()
            if any(len(v) > _MAX_DIGITS for v in found.values() if v):
                return NameFacts()
            return NameFacts(
                int(found["step"]) if found.get("step") else None,
                int(found["epoch"]) if found.get("epoch") else None,
            )
    return NameFacts()


def step_from_name(name: str) -> int | None:
    """The step a checkpoint's name gives (`step-100`, `global_step100`, `checkpoint-100`, `100`), or None."""
    return name_facts(name).step


def epoch_from_name(name: str) -> float | None:
    """The epoch a checkpoint's name gives (`epoch_2`, `epoch=1-step=40`, `ep0-ba10`), or None: what orders
    checkpoints that have no step (torchtune's `epoch_N/` model folders)."""
    epoch = name_facts(name).epoch
    return None if epoch is None else float(epoch)
