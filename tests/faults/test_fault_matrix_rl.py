"""THE RULE of the fault matrix (`tests.faults.test_fault_matrix`) for the RL and large-scale trainers' writers:
verl, ByteCheckpoint, torchtitan, Megatron dist-ckpt, ROLL, AReaL and Lightning (a `.ckpt` file and a sharded `.ckpt/`
folder). One checkpoint per writer, from the suite's cached writer outputs; each framework's verdicts come from
one loader process (`tests.faults.loaders.NAME`) and are cached like the writers' outputs."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import build_once
from tests.faults.conftest import Faults, _faults
from tests.faults.loaders import areal, bytecheckpoint, lightning, megatron, roll, torchtitan, verl
from tests.writers.areal_writer import WrittenAreal
from tests.writers.bytecheckpoint_writer import WrittenBytecheckpoint, write_bytecheckpoint_run
from tests.writers.lightning_writer import WrittenLightning
from tests.writers.megatron_writer import WrittenMegatron
from tests.writers.rl_runs import WrittenFsdpRuns
from tests.writers.torchtitan_writer import WrittenTorchtitan
from tests.writers.verl_writer import WrittenVerl


@pytest.fixture(scope="session")
def verl_faults(tmp_path_factory: pytest.TempPathFactory, verl_run: WrittenVerl) -> Faults:
    """verl's `global_step_2/` (FSDP2 actor and critic, data.pt), judged by verl's own resume on 2 ranks."""
    return _faults(tmp_path_factory, "verl", verl.build, verl_run.step(verl_run.steps[-1]))


@pytest.fixture(scope="session")
def bytecheckpoint_faults(tmp_path_factory: pytest.TempPathFactory) -> Faults:
    """ByteCheckpoint's `global_step_2/` (the `bytecheckpoint_run` of tests/layouts), judged by `bcp.load`."""
    written: WrittenBytecheckpoint = build_once(tmp_path_factory, "bytecheckpoint", write_bytecheckpoint_run)
    return _faults(tmp_path_factory, "bytecheckpoint", bytecheckpoint.build, written.step(2))


@pytest.fixture(scope="session")
def torchtitan_faults(tmp_path_factory: pytest.TempPathFactory, torchtitan_run: WrittenTorchtitan) -> Faults:
    """torchtitan's full save `step-2/`, judged by its `CheckpointManager.load`."""
    return _faults(tmp_path_factory, "torchtitan", torchtitan.build, torchtitan_run.step(2))


@pytest.fixture(scope="session")
def megatron_faults(tmp_path_factory: pytest.TempPathFactory, megatron_runs: WrittenMegatron) -> Faults:
    """Megatron-LM's `iter_0000002/` (TP 2, with optimizer, scheduler and RNG), judged by `dist_checkpointing.load`."""
    return _faults(tmp_path_factory, "megatron", megatron.build, megatron_runs.iteration(2))


@pytest.fixture(scope="session")
def roll_faults(tmp_path_factory: pytest.TempPathFactory, fsdp_runs: WrittenFsdpRuns) -> Faults:
    """ROLL's `checkpoint-2/` (actor, critic/ and pipeline/), judged by its FSDP2 resume (from its source)."""
    return _faults(tmp_path_factory, "roll", roll.build, fsdp_runs.roll_launch / "checkpoint-2")


@pytest.fixture(scope="session")
def areal_faults(tmp_path_factory: pytest.TempPathFactory, areal_run: WrittenAreal) -> Faults:
    """AReaL's trial at its last step (`recover_info/`, `default/recover_checkpoint/` and the step's HF export),
    judged by its `RecoverHandler.load` into a fresh FSDP engine and by `from_pretrained` of the export;
    `ckptctl verify` of the slot (which reads `recover_info/` as its own) and of the export."""
    trial: Path = build_once(tmp_path_factory, "areal-step", functools.partial(areal.step_view, areal_run.trial))
    faults = _faults(tmp_path_factory, "areal", functools.partial(areal.build, base=areal_run.base_model), trial)
    return replace(faults, targets=(areal.SLOT, areal.EXPORT))


@pytest.fixture(scope="session")
def lightning_file_faults(tmp_path_factory: pytest.TempPathFactory, lightning_run: WrittenLightning) -> Faults:
    """Lightning's `epoch=0-step=4.ckpt` file, judged by `Trainer.fit(ckpt_path=...)`."""
    return _faults(tmp_path_factory, "lightning-file", lightning.build_file, lightning_run.step(4))


@pytest.fixture(scope="session")
def lightning_sharded_faults(tmp_path_factory: pytest.TempPathFactory, lightning_run: WrittenLightning) -> Faults:
    """Lightning's sharded `epoch=0-step=4.ckpt/` folder, judged by its `_load_distributed_checkpoint`."""
    return _faults(tmp_path_factory, "lightning-sharded", lightning.build_sharded, lightning_run.sharded)


@pytest.mark.timeout(600)  # a cold build loads 55 cells on 2 ranks
def test_verl(verl_faults: Faults, tmp_path: Path) -> None:
    verl_faults.assert_rule(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)  # a cold build loads 23 cells on 2 ranks
def test_bytecheckpoint(bytecheckpoint_faults: Faults, tmp_path: Path) -> None:
    bytecheckpoint_faults.assert_rule(tmp_path)


def test_torchtitan(torchtitan_faults: Faults, tmp_path: Path) -> None:
    torchtitan_faults.assert_rule(tmp_path)


def test_megatron(megatron_faults: Faults, tmp_path: Path) -> None:
    megatron_faults.assert_rule(tmp_path)


def test_roll(roll_faults: Faults, tmp_path: Path) -> None:
    roll_faults.assert_rule(tmp_path)


def test_areal(areal_faults: Faults, tmp_path: Path) -> None:
    areal_faults.assert_rule(tmp_path)


def test_lightning_file(lightning_file_faults: Faults, tmp_path: Path) -> None:
    lightning_file_faults.assert_rule(tmp_path)


def test_lightning_sharded(lightning_sharded_faults: Faults, tmp_path: Path) -> None:
    lightning_sharded_faults.assert_rule(tmp_path)
