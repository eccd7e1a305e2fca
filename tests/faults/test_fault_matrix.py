"""THE RULE of the fault matrix, per framework: whenever the framework's own load of a damaged checkpoint fails
or loses state, `ckptctl verify` exits non-zero naming the damaged file; whenever verify exits 0, the load
restored every tensor equal to the undamaged copy's. Flips no checksum can see are caught once a manifest is
written; the cells listed in known_gaps.txt are asserted to still be gaps (see `tests.faults.harness`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.conftest import Faults


def test_native(native_faults: Faults, tmp_path: Path) -> None:
    native_faults.assert_rule(tmp_path)


def test_dcp_single(dcp_single_faults: Faults, tmp_path: Path) -> None:
    dcp_single_faults.assert_rule(tmp_path)


def test_dcp_fsdp2(dcp_fsdp_faults: Faults, tmp_path: Path) -> None:
    dcp_fsdp_faults.assert_rule(tmp_path)


def test_hf_trainer(trainer_faults: Faults, tmp_path: Path) -> None:
    trainer_faults.assert_rule(tmp_path)


def test_hf_trainer_peft(trainer_peft_faults: Faults, tmp_path: Path) -> None:
    trainer_peft_faults.assert_rule(tmp_path)


def test_hf_model_folder(hf_model_faults: Faults, tmp_path: Path) -> None:
    hf_model_faults.assert_rule(tmp_path)


@pytest.mark.parametrize(
    "framework",
    [
        "deepspeed-zero2",
        "deepspeed-zero3",
        pytest.param("deepspeed-universal", marks=pytest.mark.long),  # ~200 cells
        "openrlhf",
        "open-instruct",
    ],
)
def test_deepspeed_based(deepspeed_faults: dict[str, Faults], framework: str, tmp_path: Path) -> None:
    deepspeed_faults[framework].assert_rule(tmp_path)


def test_accelerate(accelerate_faults: Faults, tmp_path: Path) -> None:
    accelerate_faults.assert_rule(tmp_path)


def test_peft_adapter(peft_faults: Faults, tmp_path: Path) -> None:
    peft_faults.assert_rule(tmp_path)
