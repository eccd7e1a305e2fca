"""One checkpoint per real writer, and its framework's verdict on every cell of the fault matrix.

The verdicts are cached per machine like the writers' outputs (`build_once`, keyed by the loader's code, the
frameworks' versions and the checkpoint's path, which names the writer's cache entry): a warm run only
verifies the damaged copies, a cold one runs each framework's loader process once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import build_once
from tests.faults.loaders import dcp, hf_model, native, trainer
from tests.writers.dcp_writer import WrittenDcp
from tests.writers.trainer_writer import WrittenTrainerRun


@dataclass(frozen=True)
class Faults:
    """A checkpoint and its framework's verdict by cell id (`tests.faults.cells.Cell.id`)."""

    checkpoint: Path
    verdicts: dict[str, str]


def _faults(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path, Path], dict[str, str]], checkpoint: Path
) -> Faults:
    verdicts = build_once(tmp_path_factory, f"faults-{name}", functools.partial(build, checkpoint))
    return Faults(checkpoint, verdicts)


@pytest.fixture(scope="session")
def native_faults(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path) -> Faults:
    """The demo's single-process native `step-30`, judged by `CheckpointManager.restore`."""
    return _faults(tmp_path_factory, "native", native.build, demo_dir / "native" / "step-30")


@pytest.fixture(scope="session")
def dcp_single_faults(tmp_path_factory: pytest.TempPathFactory, raw_dcp: WrittenDcp) -> Faults:
    """A single-process `dcp.save` of the writer's sample state dict, judged by `dcp.load` in one process."""
    return _faults(tmp_path_factory, "dcp-single", dcp.build_single, raw_dcp.path)


@pytest.fixture(scope="session")
def dcp_fsdp_faults(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path) -> Faults:
    """The demo's 2-rank FSDP2 `dcp.save` of `get_state_dict`, judged by `dcp.load` + `set_state_dict` on 2 ranks."""
    return _faults(tmp_path_factory, "dcp-fsdp", dcp.build_fsdp, demo_dir / "dcp" / "step-30")


@pytest.fixture(scope="session")
def trainer_faults(tmp_path_factory: pytest.TempPathFactory, trainer_run: WrittenTrainerRun) -> Faults:
    """The Trainer's `checkpoint-4` of the tiny Llama, judged by the Trainer's own resume path."""
    return _faults(tmp_path_factory, "trainer", trainer.build_plain, trainer_run.checkpoints[-1])


@pytest.fixture(scope="session")
def trainer_peft_faults(tmp_path_factory: pytest.TempPathFactory, trainer_run: WrittenTrainerRun) -> Faults:
    """The Trainer's `checkpoint-2` of the LoRA run (an adapter with the Trainer's files), judged likewise."""
    return _faults(tmp_path_factory, "trainer-peft", trainer.build_peft, trainer_run.peft_run / "checkpoint-2")


@pytest.fixture(scope="session")
def hf_model_faults(tmp_path_factory: pytest.TempPathFactory, hf_model_dirs: dict[str, Path]) -> Faults:
    """transformers' `save_pretrained` of the tiny Llama in shards with their index, judged by `from_pretrained`."""
    return _faults(tmp_path_factory, "hf-model", hf_model.build, hf_model_dirs["sharded"])
