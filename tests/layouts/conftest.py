"""Real checkpoints for the layout tests, written once per session by the frameworks themselves:
torch DCP (the single-process save, DeepSpeed ZeRO and the Hugging Face Trainer runs live in
tests/conftest.py, shared with the other tests); and the run folders of the RL frameworks
(OpenRLHF, open-instruct, AReaL, ROLL) arranged from such real pieces (`tests.writers.rl_runs`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import build_once
from tests.writers.bytecheckpoint_writer import WrittenBytecheckpoint, write_bytecheckpoint_run
from tests.writers.dcp_writer import WrittenDcp, write_fsdp_dcp
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.distributed_save_writer import WrittenDistributedSaves, write_distributed_saves
from tests.writers.rl_runs import arrange_open_instruct, arrange_openrlhf, arrange_roll_megatron


@pytest.fixture(scope="session")
def fsdp_dcp(tmp_path_factory: pytest.TempPathFactory) -> WrittenDcp:
    """2 ranks, FSDP2, AdamW: keys `model.*`, `optim.*` and a `trainer_state.step` value (slow: spawns)."""
    return build_once(tmp_path_factory, "dcp-fsdp", lambda root: write_fsdp_dcp(root, name="step-3"))


@pytest.fixture
def fsdp_copy(fsdp_dcp: WrittenDcp, tmp_path: Path) -> Path:
    """A private copy of the FSDP checkpoint that a test may damage."""
    import shutil

    return Path(shutil.copytree(fsdp_dcp.path, tmp_path / "run" / fsdp_dcp.path.name))


@pytest.fixture(scope="session")
def openrlhf_run(
    tmp_path_factory: pytest.TempPathFactory,
    deepspeed_runs: dict[int, WrittenDeepSpeed],
    hf_model_dirs: dict[str, Path],
) -> Path:
    """OpenRLHF PPO's `--ckpt.path`: ZeRO-2 actor and ZeRO-3 critic tags, metric.json, best tags, an HF export."""
    root = tmp_path_factory.mktemp("openrlhf") / "ckpt"
    return arrange_openrlhf(root, deepspeed_runs[2], deepspeed_runs[3], hf_model_dirs["single"])


@pytest.fixture(scope="session")
def open_instruct_run(
    tmp_path_factory: pytest.TempPathFactory,
    deepspeed_runs: dict[int, WrittenDeepSpeed],
    hf_model_dirs: dict[str, Path],
) -> Path:
    """open-instruct's outputs: `state/` (--checkpoint_state_dir) and `output/` (HF snapshots)."""
    root = tmp_path_factory.mktemp("open-instruct")
    arrange_open_instruct(root / "state", root / "output", deepspeed_runs[2], hf_model_dirs["single"])
    return root


@pytest.fixture(scope="session")
def roll_megatron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ROLL output folder of the Megatron strategy: checkpoint-3 (dist-ckpt) and checkpoint-4 (legacy, TP 2)."""
    launch = tmp_path_factory.mktemp("roll-megatron") / "output" / "20250102-080000"
    arrange_roll_megatron(launch / "checkpoint-3", 3)
    arrange_roll_megatron(launch / "checkpoint-4", 4, legacy=True)
    return launch.parent


@pytest.fixture(scope="session")
def distributed_saves(tmp_path_factory: pytest.TempPathFactory) -> WrittenDistributedSaves:
    """transformers' `save_pretrained(distributed_checkpoint=True)` and torch's `dcp.save(use_collectives=False)`
    of an FSDP2 model on 2 CPU ranks: per-rank files, no global index (slow: spawns)."""
    return build_once(tmp_path_factory, "distributed-saves", write_distributed_saves)


@pytest.fixture(scope="session")
def bytecheckpoint_run(tmp_path_factory: pytest.TempPathFactory) -> WrittenBytecheckpoint:
    """ByteCheckpoint 0.0.2's own `bcp.save` on 2 ranks (FSDP2): global steps 1 and 2 with the tracker, a
    step folder of two roles, the full state at step 2 and ByteCheckpoint's own merge of its model."""
    return build_once(tmp_path_factory, "bytecheckpoint", write_bytecheckpoint_run)
