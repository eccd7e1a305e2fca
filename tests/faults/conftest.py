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
from tests.faults.harness import assert_rule
from tests.faults.loaders import accelerate, dcp, deepspeed, hf_model, native, peft, trainer
from tests.writers.accelerate_writer import WrittenAccelerate
from tests.writers.dcp_writer import WrittenDcp
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.openrlhf_writer import WrittenOpenRlhf
from tests.writers.peft_writer import WrittenPeft
from tests.writers.trainer_writer import WrittenTrainerRun
from tests.writers.universal_writer import WrittenUniversal


@dataclass(frozen=True)
class Faults:
    """A checkpoint, the matrix's name of its framework, and the framework's verdict by cell id
    (`tests.faults.cells.Cell.id`). `targets`: what `ckptctl verify` is given, relative to the checkpoint ("":
    the checkpoint itself; AReaL's trial: its recover slot and its export, the checkpoints a user verifies)."""

    framework: str
    checkpoint: Path
    verdicts: dict[str, str]
    targets: tuple[str, ...] = ("",)

    def assert_rule(self, tmp: Path) -> None:
        """THE RULE on every cell (`tests.faults.harness.assert_rule`)."""
        assert_rule(self.framework, self.checkpoint, self.verdicts, tmp, self.targets)


def _faults(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path, Path], dict[str, str]], checkpoint: Path
) -> Faults:
    verdicts = build_once(tmp_path_factory, f"faults-{name}", functools.partial(build, checkpoint))
    return Faults(name, checkpoint, verdicts)


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


@pytest.fixture(scope="session")
def deepspeed_faults(
    tmp_path_factory: pytest.TempPathFactory,
    deepspeed_runs: dict[int, WrittenDeepSpeed],
    deepspeed_universal: WrittenUniversal,
    openrlhf_ppo: WrittenOpenRlhf,
) -> dict[str, Faults]:
    """The DeepSpeed-based checkpoints by framework, judged in one 2-rank spawn (`loaders.deepspeed`), each
    after its run's older tag: the ZeRO-2 and ZeRO-3 `global_step4` by `engine.load_checkpoint`, the ZeRO-2
    run's universal conversion with `load_universal`, OpenRLHF's actor tag by its strategy's `load_ckpt`,
    open-instruct's tag by its resume."""
    zero = {stage: {"kind": "zero", "stage": stage, "universal": False} for stage in (2, 3)}
    jobs: dict[str, dict[str, object]] = {
        f"deepspeed-zero{stage}": {
            **zero[stage],
            "checkpoint": deepspeed_runs[stage].latest,
            "prior": deepspeed_runs[stage].save_dir / deepspeed_runs[stage].tags[0],
        }
        for stage in (2, 3)
    }
    jobs["deepspeed-universal"] = {
        **zero[2],
        "universal": True,
        "checkpoint": deepspeed_universal.universal(2),
        "prior": deepspeed_universal.save_dirs[2] / "global_step2",
    }
    jobs["open-instruct"] = {
        **zero[2],
        "kind": "open_instruct",
        "checkpoint": deepspeed_universal.open_instruct / "global_step4",
        "prior": deepspeed_universal.open_instruct / "global_step2",
    }
    jobs["openrlhf"] = {
        "kind": "openrlhf",
        "checkpoint": openrlhf_ppo.actor / openrlhf_ppo.latest,
        "prior": openrlhf_ppo.actor / "global_step2",
        "pretrain": openrlhf_ppo.output_dir.parent / "pretrain",
    }
    verdicts = build_once(tmp_path_factory, "faults-deepspeed", functools.partial(deepspeed.build, jobs))
    return {name: Faults(name, Path(str(job["checkpoint"])), verdicts[name]) for name, job in jobs.items()}


@pytest.fixture(scope="session")
def accelerate_faults(tmp_path_factory: pytest.TempPathFactory, accelerate_runs: WrittenAccelerate) -> Faults:
    """The plain accelerate run's newest `checkpoint_N`, judged by `Accelerator.load_state` after its older one."""
    *_, prior, checkpoint = accelerate_runs.plain_checkpoints()
    verdicts = build_once(tmp_path_factory, "faults-accelerate", functools.partial(accelerate.build, checkpoint, prior))
    return Faults("accelerate", checkpoint, verdicts)


@pytest.fixture(scope="session")
def peft_faults(tmp_path_factory: pytest.TempPathFactory, peft_adapters: WrittenPeft) -> Faults:
    """PEFT's `plain` LoRA adapter folder, judged by `PeftModel.from_pretrained` on its base model."""
    adapter = peft_adapters.adapters["plain"]
    verdicts = build_once(tmp_path_factory, "faults-peft", functools.partial(peft.build, adapter, peft_adapters.base))
    return Faults("peft", adapter, verdicts)
