"""The HF Trainer layout on `checkpoint-N` folders written by `transformers.Trainer` itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptctl import io
from ckptctl.checkpoint import CheckpointState, Component, ProblemKind
from ckptctl.contract.base import checkpoint_problems
from ckptctl.families.in_progress import IN_PROGRESS_WINDOW_S
from ckptctl.formats.chunks import read_tensor
from ckptctl.frameworks.deepspeed.layout import DeepSpeedLayout
from ckptctl.frameworks.hf_trainer.layout import HfTrainerLayout
from ckptctl.layouts import detect, scan_run
from ckptctl.ops.verification import verify_checkpoint
from tests.conftest import CliResult, copy_tree
from tests.writers.dcp_writer import write_single_process_dcp
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.trainer_writer import WrittenTrainerRun

LAYOUT = HfTrainerLayout()
Cli = Callable[..., CliResult]


class Payload:
    """Pickles as `func(*args)`: what a malicious checkpoint carries."""

    def __init__(self, func: object, *args: object) -> None:
        self.func = func
        self.args = args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


@pytest.fixture
def ckpt(trainer_run: WrittenTrainerRun, tmp_path: Path) -> Path:
    """A private copy of checkpoint-4 in a run folder of its own."""
    return copy_tree(trainer_run.checkpoints[-1], tmp_path / "out" / "checkpoint-4")


def _problems(url: Path, severity: str = "error") -> list[tuple[str, str]]:
    """The layout's rules and its load set, as verify judges them."""
    return [(p.kind, p.path) for p in checkpoint_problems(LAYOUT, LAYOUT.open(str(url))) if p.severity == severity]


def _errors(url: Path) -> list[tuple[str, str]]:
    return _problems(url)


def test_list_reads_step_and_epoch_from_trainer_state(trainer_run: WrittenTrainerRun) -> None:
    refs = sorted(scan_run(str(trainer_run.output_dir)), key=lambda r: r.step or 0)
    assert [(io.name_of(r.url), r.layout, r.step, r.epoch, r.state) for r in refs] == [
        ("checkpoint-2", "hf_trainer", 2, 0.25, CheckpointState.COMPLETE),
        ("checkpoint-4", "hf_trainer", 4, 0.5, CheckpointState.COMPLETE),
    ]


def test_open_reports_components_and_metadata(trainer_run: WrittenTrainerRun) -> None:
    checkpoint = LAYOUT.open(str(trainer_run.checkpoints[-1]))
    assert checkpoint.components == {
        Component.MODEL,
        Component.OPTIMIZER,
        Component.SCHEDULER,
        Component.RNG,
        Component.TRAINER_STATE,
        Component.CONFIG,
        Component.EXTRA,
    }
    assert checkpoint.world_size == 1
    meta = checkpoint.metadata
    assert meta["trainer_state"]["max_steps"] == 4 and "loss" in meta["trainer_state"]
    args = meta["training_args"]
    assert (args["learning_rate"], args["per_device_train_batch_size"], args["save_steps"]) == (5e-05, 2, 2)
    assert isinstance(args["lr_scheduler_type"], str)  # an enum member read back as its value
    assert meta["config"]["model_type"] == "llama"


def test_tensor_index_reads_the_model_and_the_optimizer(trainer_run: WrittenTrainerRun) -> None:
    checkpoint = LAYOUT.open(str(trainer_run.checkpoints[-1]))
    reference = load_file(str(trainer_run.reference))
    model = {e.name: e for e in checkpoint.tensors(Component.MODEL)}
    assert set(model) == set(reference)
    assert sum(e.numel for e in model.values()) == trainer_run.model_parameters
    for name, entry in model.items():
        assert torch.equal(read_tensor(checkpoint.url, entry), reference[name]), name
    saved = torch.load(trainer_run.checkpoints[-1] / "optimizer.pt", map_location="cpu", weights_only=True)
    optimizer = {e.name: e for e in checkpoint.tensors(Component.OPTIMIZER)}
    assert len(optimizer) == 3 * len(saved["state"])  # step, exp_avg, exp_avg_sq per parameter
    for index, state in saved["state"].items():
        for key, value in state.items():
            got = read_tensor(checkpoint.url, optimizer[f"optimizer.state.{index}.{key}"])
            assert torch.equal(got, value), (index, key)


def test_open_index_and_verify_need_no_transformers(trainer_run: WrittenTrainerRun) -> None:
    code = (
        "import sys\n"
        "for m in ('torch', 'transformers', 'accelerate', 'numpy', 'deepspeed'): sys.modules[m] = None\n"
        "from ckptctl import io\n"
        "from ckptctl.frameworks.hf_trainer.layout import HfTrainerLayout\n"
        f"checkpoint = HfTrainerLayout().open({str(trainer_run.checkpoints[-1])!r})\n"
        "entries = checkpoint.tensor_index()\n"
        "inspect_bytes = io.READ_STATS.bytes_read\n"
        "problems = HfTrainerLayout().verify(checkpoint)\n"
        "print(inspect_bytes, len(entries), len(problems), checkpoint.metadata['training_args']['seed'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    inspect_bytes, entries, problems, seed = map(int, out.stdout.split())
    assert entries > 0 and problems == 0 and seed == 0
    size = sum(p.stat().st_size for p in trainer_run.checkpoints[-1].iterdir())
    assert inspect_bytes < size // 4


def test_without_trainer_state_it_is_in_progress_then_broken(ckpt: Path) -> None:
    (ckpt / "trainer_state.json").unlink()
    _, ref = detect(str(ckpt))
    assert ref.state is CheckpointState.IN_PROGRESS and ref.step == 4  # the name still says which step
    long_ago = time.time() - IN_PROGRESS_WINDOW_S - 60
    for path in ckpt.iterdir():
        os.utime(path, (long_ago, long_ago))
    _, ref = detect(str(ckpt))
    assert ref.state is CheckpointState.BROKEN and "trainer_state.json" in ref.note
    assert not verify_checkpoint(str(ckpt)).ok
    assert (ProblemKind.MISSING_FILE, "trainer_state.json") in _errors(ckpt)


def test_garbage_trainer_state(ckpt: Path) -> None:
    (ckpt / "trainer_state.json").write_text('{"global_step": ')
    assert _errors(ckpt) == [(ProblemKind.BAD_METADATA, "trainer_state.json")]


def test_truncated_optimizer(ckpt: Path) -> None:
    victim = ckpt / "optimizer.pt"
    victim.write_bytes(victim.read_bytes()[:-5000])
    assert _errors(ckpt) == [(ProblemKind.TRUNCATED, "optimizer.pt")]


def test_missing_optimizer_is_a_problem_unless_save_only_model(ckpt: Path) -> None:
    (ckpt / "optimizer.pt").unlink()
    assert _errors(ckpt) == [(ProblemKind.MISSING_FILE, "optimizer.pt")]


@pytest.mark.parametrize("victim", ["optimizer.pt", "training_args.bin", "rng_state.pth"])
def test_hostile_pickles_are_refused_and_nothing_runs(ckpt: Path, tmp_path: Path, run_cli: Cli, victim: str) -> None:
    marker = tmp_path / "pwned"
    path = ckpt / victim
    real = torch.load(path, map_location="cpu", weights_only=False)
    payload = Payload(os.system, f"touch {marker}")
    if isinstance(real, dict):  # hidden among the real content
        real["evil"] = payload
    else:
        real.evil = payload
    torch.save(real, path)
    result = run_cli("verify", ckpt, "--json")
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    errors = [p for p in result.json["problems"] if p["severity"] == "error"]
    assert [(p["kind"], p["path"]) for p in errors] == [("unsafe_pickle", victim)]
    assert "posix.system" in errors[0]["message"]
    run_cli("inspect", ckpt, "--json")  # whatever it answers, it runs nothing
    assert not marker.exists()


def test_per_process_rng_files_give_the_world_size(ckpt: Path) -> None:
    rng = ckpt / "rng_state.pth"
    for rank in (0, 1, 2):
        shutil.copy(rng, ckpt / f"rng_state_{rank}.pth")
    rng.unlink()
    assert LAYOUT.open(str(ckpt)).world_size == 3
    (ckpt / "rng_state_1.pth").unlink()
    # Trainer._load_rng_state logs that it found none for that process and goes on: a warning.
    assert _errors(ckpt) == []
    assert _problems(ckpt, "warning") == [(ProblemKind.MISSING_FILE, "rng_state_1.pth")]


def test_deepspeed_inside_is_one_trainer_checkpoint(
    ckpt: Path, deepspeed_runs: dict[int, WrittenDeepSpeed], run_cli: Cli
) -> None:
    ds = deepspeed_runs[3]
    shutil.copytree(ds.latest, ckpt / "global_step4")
    (ckpt / "latest").write_text("global_step4")
    (ckpt / "optimizer.pt").unlink()  # DeepSpeed saves the optimizer itself
    refs = scan_run(str(ckpt.parent))
    assert [(r.layout, io.name_of(r.url)) for r in refs] == [("hf_trainer", "checkpoint-4")]
    checkpoint = LAYOUT.open(str(ckpt))
    assert checkpoint.metadata["deepspeed"]["zero_stage"] == 3
    assert checkpoint.world_size == 1  # rng_state.pth: one process, as the Trainer recorded it
    optimizer = list(checkpoint.tensors(Component.OPTIMIZER))
    assert optimizer and all(c.file.startswith("global_step4/") for e in optimizer for c in e.chunks)
    # The model is the Trainer's safetensors; DeepSpeed's copy of it is not counted twice.
    assert sum(e.numel for e in checkpoint.tensors(Component.MODEL)) == ds.model_parameters
    inner = {e.name: e for e in DeepSpeedLayout().open(str(ds.latest)).tensors(Component.OPTIMIZER)}
    for entry in optimizer[:5]:
        assert torch.equal(read_tensor(str(ckpt), entry), read_tensor(str(ds.latest), inner[entry.name]))
    assert _errors(ckpt) == []
    (ckpt / "latest").write_text("global_step9")
    assert _errors(ckpt) == [(ProblemKind.MISSING_FILE, "latest")]
    assert run_cli("verify", ckpt).exit_code == 1


def test_fsdp_sharded_state_inside(ckpt: Path) -> None:
    # Trainer + FSDP with SHARDED_STATE_DICT saves torch DCP folders instead of model.safetensors.
    written = write_single_process_dcp(ckpt / "pytorch_model_fsdp_0")
    written.reference.unlink()
    (ckpt / "model.safetensors").unlink()
    checkpoint = LAYOUT.open(str(ckpt))
    model = list(checkpoint.tensors(Component.MODEL))
    assert model and all(c.file.startswith("pytorch_model_fsdp_0/") for e in model for c in e.chunks)
    assert _errors(ckpt) == []
    (next((ckpt / "pytorch_model_fsdp_0").glob("*.distcp"))).unlink()
    assert ProblemKind.MISSING_FILE in {kind for kind, _ in _errors(ckpt)}


def test_folders_without_trainer_files_are_left_to_other_layouts(
    tmp_path: Path, hf_model_dirs: dict[str, Path]
) -> None:
    plain = copy_tree(hf_model_dirs["single"], tmp_path / "checkpoint-7")
    assert detect(str(plain))[0].name == "hf"
    assert LAYOUT.identify(str(tmp_path), io.list_dir(str(tmp_path))) is None


def test_trainer_state_head_is_enough_for_list(ckpt: Path) -> None:
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["log_history"] = [{"loss": 1.0, "step": i} for i in range(20_000)]  # a long run's history
    (ckpt / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    before = io.READ_STATS.bytes_read
    ref = LAYOUT.identify(str(ckpt), io.list_dir(str(ckpt)))
    assert ref is not None and (ref.step, ref.epoch) == (4, 0.5)
    assert io.READ_STATS.bytes_read - before <= 4096
