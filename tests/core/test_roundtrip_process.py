"""Save in one fresh process, restore in another: the state and the random streams continue exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.core.util import assert_same, run_worker

pytestmark = pytest.mark.slow


def test_fresh_process_round_trip(run_dir: Path) -> None:
    run_worker("roundtrip-save", str(run_dir))
    run_worker("roundtrip-restore", str(run_dir))
    expected = torch.load(run_dir / "expected.pt", weights_only=True)
    observed = torch.load(run_dir / "observed.pt", weights_only=True)

    assert_same(expected["state"]["model"], observed["state"]["model"], "model")
    assert_same(expected["state"]["optimizer"], observed["state"]["optimizer"], "optimizer")
    assert_same(expected["state"]["scheduler"], observed["state"]["scheduler"], "scheduler")
    assert_same(expected["state"]["sampler"], observed["state"]["sampler"], "sampler")
    assert_same(expected["state"]["trainer"], observed["state"]["trainer"], "trainer")
    assert_same(expected["draws"], observed["draws"], "next random draws")

    # guard against a trivial pass: the optimizer really had moments, the scheduler really moved
    adam = expected["state"]["optimizer"]["state"]
    assert adam and all(s["exp_avg"].abs().sum() > 0 for s in adam.values())
    assert expected["state"]["scheduler"]["last_epoch"] == 5
    assert expected["state"]["sampler"]["position"] > 0
