"""Real checkpoints for the layout tests, written once per session by the frameworks themselves:
torch DCP, DeepSpeed ZeRO and the Hugging Face Trainer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.writers.dcp_writer import WrittenDcp, write_fsdp_dcp, write_single_process_dcp
from tests.writers.deepspeed_writer import WrittenDeepSpeed, write_deepspeed_runs
from tests.writers.trainer_writer import WrittenTrainerRun, write_trainer_run


@pytest.fixture(scope="session")
def fsdp_dcp(tmp_path_factory: pytest.TempPathFactory) -> WrittenDcp:
    """2 ranks, FSDP2, AdamW: keys `model.*`, `optim.*` and a `trainer_state.step` value (slow: spawns)."""
    return write_fsdp_dcp(tmp_path_factory.mktemp("dcp-fsdp"), name="step-3")


@pytest.fixture(scope="session")
def raw_dcp(tmp_path_factory: pytest.TempPathFactory) -> WrittenDcp:
    """A plain single-process `dcp.save` of an unprefixed state dict (many dtypes, views, scalars)."""
    return write_single_process_dcp(tmp_path_factory.mktemp("dcp-raw") / "raw")


@pytest.fixture
def fsdp_copy(fsdp_dcp: WrittenDcp, tmp_path: Path) -> Path:
    """A private copy of the FSDP checkpoint that a test may damage."""
    import shutil

    return Path(shutil.copytree(fsdp_dcp.path, tmp_path / "run" / fsdp_dcp.path.name))


@pytest.fixture(scope="session")
def deepspeed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, WrittenDeepSpeed]:
    """DeepSpeed on 2 CPU ranks, bf16, ZeRO 0, 2 and 3, tags global_step2 and global_step4 (slow: spawns)."""
    return write_deepspeed_runs(tmp_path_factory.mktemp("deepspeed"), stages=(0, 2, 3))


@pytest.fixture(scope="session")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> WrittenTrainerRun:
    """transformers.Trainer on CPU: checkpoint-2 and checkpoint-4 of the tiny Llama (slow: a subprocess)."""
    return write_trainer_run(tmp_path_factory.mktemp("trainer") / "out")
