"""THE RULE of the fault matrix, per framework: whenever the framework's own load of a damaged checkpoint fails
or loses state, `ckptctl verify` exits non-zero naming the damaged file; whenever verify exits 0, the load
restored every tensor equal to the undamaged copy's. Flips no checksum can see are caught once a manifest is
written; the cells listed in known_gaps.txt are asserted to still be gaps (see `tests.faults.harness`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.conftest import Faults
from tests.faults.harness import assert_rule


def test_native(native_faults: Faults, tmp_path: Path) -> None:
    assert_rule("native", native_faults.checkpoint, native_faults.verdicts, tmp_path)


def test_dcp_single(dcp_single_faults: Faults, tmp_path: Path) -> None:
    assert_rule("dcp-single", dcp_single_faults.checkpoint, dcp_single_faults.verdicts, tmp_path)


def test_dcp_fsdp2(dcp_fsdp_faults: Faults, tmp_path: Path) -> None:
    assert_rule("dcp-fsdp2", dcp_fsdp_faults.checkpoint, dcp_fsdp_faults.verdicts, tmp_path)


def test_hf_trainer(trainer_faults: Faults, tmp_path: Path) -> None:
    assert_rule("hf-trainer", trainer_faults.checkpoint, trainer_faults.verdicts, tmp_path)


def test_hf_trainer_peft(trainer_peft_faults: Faults, tmp_path: Path) -> None:
    assert_rule("hf-trainer-peft", trainer_peft_faults.checkpoint, trainer_peft_faults.verdicts, tmp_path)


def test_hf_model_folder(hf_model_faults: Faults, tmp_path: Path) -> None:
    assert_rule("hf-model", hf_model_faults.checkpoint, hf_model_faults.verdicts, tmp_path)


@pytest.mark.parametrize(
    "framework", ["deepspeed-zero2", "deepspeed-zero3", "deepspeed-universal", "openrlhf", "open-instruct"]
)
def test_deepspeed_based(deepspeed_faults: dict[str, Faults], framework: str, tmp_path: Path) -> None:
    faults = deepspeed_faults[framework]
    assert_rule(framework, faults.checkpoint, faults.verdicts, tmp_path)


def test_accelerate(accelerate_faults: Faults, tmp_path: Path) -> None:
    assert_rule("accelerate", accelerate_faults.checkpoint, accelerate_faults.verdicts, tmp_path)


def test_peft_adapter(peft_faults: Faults, tmp_path: Path) -> None:
    assert_rule("peft", peft_faults.checkpoint, peft_faults.verdicts, tmp_path)
