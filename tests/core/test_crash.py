"""SIGKILL at any moment of a save leaves the previous checkpoint and the `latest` pointer intact, the
partial one recognisable as a staging folder, and `restore` working.

A worker process builds a ~50 MB state (a model and AdamW moments, every tensor filled with the step
number) and forks one child per case, which saves and is SIGKILLed either after a delay spread over a
save (a fraction of its measured save time), or at a named moment of the commit protocol, where it stops
until killed (see `_workers._install_hang`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ckptctl.core import CheckpointManager, RetentionPolicy, StepNaming
from ckptctl.core.lock import LOCK_NAME
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import MANIFEST_NAME, read_manifest
from tests.core import _workers
from tests.core.util import run_worker

pytestmark = pytest.mark.slow

NAMING = StepNaming()


@dataclass(frozen=True)
class Case:
    mode: str  # "loop" for a timed kill, else the commit phase to stop at
    fraction: float = 0.0  # timed kills: delay after "begin 2" as a fraction of one save's duration

    @property
    def id(self) -> str:
        return f"after-{self.fraction:.2f}-of-a-save" if self.mode == "loop" else f"at-{self.mode}"


CASES = [Case("loop", f) for f in (0.15, 0.45, 0.75, 1.3)] + [
    Case(point) for point in ("manifest", "rename", "pointer", "retention", "exchanged")
]


def expected_fill(case: Case, step: int) -> float:
    # Re-saving step 2 (fill 2.5) was killed before or after the atomic swap of the two folders.
    return 2.5 if case.mode == "exchanged" and step == 2 else float(step)


def check_after_kill(root: Path, case: Case) -> None:
    manager = CheckpointManager(root)
    committed = manager.all_steps()
    assert committed, "the first checkpoint must have survived"

    for name in os.listdir(root):
        if NAMING.step_of(name) is not None:  # a step folder is always complete: no half-written ones
            assert (root / name / MANIFEST_NAME).exists(), f"{name} has no manifest"
        # the run lock the manager's pointer update takes (a killed holder's is stale, and taken over) and
        # anything partial, recognisably so
        elif name not in ("latest", ".ckptctl-trash", LOCK_NAME):
            # (a lock's temporary file only where the file system has no unnamed files: it is swept later)
            partial = (".latest.tmp-", LOCK_NAME + ".tmp-")
            assert NAMING.staging_step(name) is not None or name.startswith(partial), name

    for step in committed:  # every committed checkpoint is intact, byte for byte
        step_dir = root / NAMING.folder(step)
        manifest = read_manifest(str(step_dir))
        assert manifest is not None and manifest.step == step
        for rel, record in manifest.files.items():
            assert (step_dir / rel).stat().st_size == record.size, f"{step_dir}/{rel}"
            assert file_digest(str(step_dir / rel)) == record.blake3, f"{step_dir}/{rel}"

    newest = manager.latest_step()
    assert newest == committed[-1]
    pointer = manager.pointer()
    if case.mode in ("loop", "pointer") and len(committed) > 1 and pointer != NAMING.folder(newest):
        # killed after the rename and before the pointer update: the pointer names the previous commit
        assert pointer == NAMING.folder(committed[-2])
    else:
        assert pointer == NAMING.folder(newest)
    if case.mode == "pointer":
        assert committed == [1, 2] and pointer == "step-1"
    if case.mode in ("manifest", "rename"):
        assert committed == [1] and any(NAMING.staging_step(n) == 2 for n in os.listdir(root))

    state = _workers.big_state()
    assert manager.restore(state) == newest
    value = expected_fill(case, newest)
    for p in state["model"].parameters():
        assert torch.all(p == value), f"restored step {newest} does not hold its values"
    assert all(torch.all(s["exp_avg_sq"] == value) for s in state["optimizer"].state.values())
    assert state["counter"] == {"step": value}

    if case.mode == "retention":  # killed half-way through deleting step 1: the next retention finishes it
        half_deleted = os.listdir(root / ".ckptctl-trash")
        assert len(half_deleted) == 1 and half_deleted[0].startswith("step-1.")
        manager = CheckpointManager(root, policy=RetentionPolicy(keep_last=1))
        manager.save(3, {"x": 1})
        manager.wait()
        assert not (root / ".ckptctl-trash").exists() and manager.all_steps() == [3]


def test_sigkill_at_any_moment_of_a_save(tmp_path: Path) -> None:
    roots = {case: tmp_path / case.id for case in CASES}
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps([[str(roots[c]), c.mode, c.fraction] for c in CASES]))
    done = run_worker("crash", str(spec))
    reports = {Path(r["root"]): r for r in map(json.loads, done.stdout.splitlines())}
    for case in CASES:
        report = reports[roots[case]]
        try:
            assert report["killed"], "the worker did not die of SIGKILL"
            check_after_kill(roots[case], case)
        except AssertionError as exc:
            raise AssertionError(f"{case.id}: {exc}\nworker said: {report['lines']}") from exc
