"""Each framework's load set on its real writer's checkpoint (issue 31): a file the framework's own resume reads,
deleted, fails `verify` naming it and lists the checkpoint as a broken one of the same layout, given inside its
run or alone.

Each case was `ok` (exit 0) before the framework declared the file, while the framework's load then fails or
loses the state the file holds (the reasons are cited where each layout declares its load set).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptctl.checkpoint import CheckpointState
from ckptctl.ops.listing import list_run
from ckptctl.ops.verification import verify_checkpoint
from tests.conftest import copy_tree
from tests.writers.bytecheckpoint_writer import WrittenBytecheckpoint
from tests.writers.rl_runs import WrittenFsdpRuns
from tests.writers.universal_writer import WrittenUniversal
from tests.writers.verl_writer import WrittenVerl

#: (layout, the checkpoint's folder from its fixture, the file its framework's load reads).
Case = tuple[str, Callable[[pytest.FixtureRequest], Path], str]


def _verl(request: pytest.FixtureRequest) -> Path:
    run: WrittenVerl = request.getfixturevalue("verl_run")
    return run.step(max(run.steps))


def _bytecheckpoint(request: pytest.FixtureRequest) -> Path:
    written: WrittenBytecheckpoint = request.getfixturevalue("bytecheckpoint_run")
    return written.run / "global_step_2"


def _roll(request: pytest.FixtureRequest) -> Path:
    runs: WrittenFsdpRuns = request.getfixturevalue("fsdp_runs")
    (launch,) = runs.roll_output.iterdir()
    return launch / "checkpoint-2"


def _open_instruct(request: pytest.FixtureRequest) -> Path:
    written: WrittenUniversal = request.getfixturevalue("deepspeed_universal")
    return written.open_instruct / "global_step2"


CASES: list[Case] = [
    ("verl", _verl, "data.pt"),
    ("bytecheckpoint", _bytecheckpoint, "extra_state/extra_state_rank_1.pt"),
    ("roll", _roll, "pipeline/rng_state_pipeline.pth"),
    ("open_instruct", _open_instruct, "driver_state.pt"),
]


def _age(path: Path) -> None:
    """Date every file an hour back: a save that stopped, not one still being written."""
    when = time.time() - 3600
    for item in [path, *path.rglob("*")]:
        os.utime(item, (when, when))


@pytest.mark.parametrize(("layout", "source", "victim"), CASES, ids=[c[0] for c in CASES])
def test_a_file_the_frameworks_load_reads_deleted_is_a_broken_checkpoint_naming_it(
    request: pytest.FixtureRequest, tmp_path: Path, layout: str, source: Callable[..., Path], victim: str
) -> None:
    src = source(request)
    # Alone (the tag without its run's siblings, `ref_policy/` or tracker): what a person copies and passes.
    ckpt = copy_tree(src, tmp_path / "run" / src.name)
    (ckpt / victim).unlink()
    _age(tmp_path / "run")

    result = verify_checkpoint(str(ckpt))
    assert result.layout == layout and not result.ok
    assert victim in [p.path for p in result.problems if p.severity == "error"], result.problems
    (ref,) = list_run(str(tmp_path / "run")).checkpoints
    assert (ref.layout, ref.state) == (layout, CheckpointState.BROKEN)
