"""DeepSpeed itself resumes from `ckptctl reshard --to deepspeed-universal` on another number of gloo CPU ranks
(2 -> 1 and 1 -> 2, ZeRO-2 and ZeRO-3) and trains on as it would have from the original state.

The runs (`tests.writers.universal_resume`) take 2 steps after loading, on the same global batches at
either world size; the first step's loss checks the loaded weights, the second the loaded optimizer state
(Adam's moments and step, the LR scheduler). Tolerance: a relative 1e-4 of the loss. The model trains in
bf16 as it was saved: the forward pass on a batch of 4 rows against 2 of 2 rows, and the bf16 gradient
averaged over 2 ranks against computed on 1, round differently (the observed differences are ~2e-5
relative, while a missing or misplaced state moves the loss by orders of magnitude more).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptctl.frameworks.deepspeed import reshard as universal_writer
from ckptctl.ops.reshard import ReshardOptions, reshard
from tests.conftest import build_once
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.universal_resume import STEPS, resume_losses

pytestmark = pytest.mark.slow
RTOL = 1e-4


def _reshard_universal(src: Path, dst: Path) -> None:
    # Named here, not only through the registry's dotted name, so that the writer cache's key covers the writer.
    assert universal_writer.WRITER.target == "deepspeed-universal"
    reshard(str(src), str(dst), ReshardOptions(to="deepspeed-universal"))


@pytest.fixture(scope="session")
def resumed(tmp_path_factory: pytest.TempPathFactory, deepspeed_runs: dict[int, WrittenDeepSpeed]) -> dict[str, Any]:
    tags = {stage: deepspeed_runs[stage].latest for stage in (2, 3)}
    return build_once(tmp_path_factory, "reshard-resume", lambda root: resume_losses(root, tags, _reshard_universal))


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize(("run", "reference"), [("to_1", "original"), ("to_2", "to_1")], ids=["2to1", "1to2"])
def test_deepspeed_resumes_on_another_world_size(resumed: dict[str, Any], stage: int, run: str, reference: str) -> None:
    got = resumed[run][stage]
    expected = resumed[reference][stage]
    assert got["global_steps"] == expected["global_steps"] == 4 + STEPS  # the counters came along
    assert got["losses"] == pytest.approx(expected["losses"], rel=RTOL)
