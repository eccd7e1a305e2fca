"""The ROLL layout on launch folders saved by FSDP2 the way ROLL saves, and on Megatron-strategy folders
arranged from real pieces (tests.writers.rl_runs)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState, Component, ProblemKind
from ckptctl.layouts import open_checkpoint, scan_run
from ckptctl.ops.prune import checkpoint_metrics
from ckptctl.ops.verification import verify_checkpoint, verify_run
from tests.conftest import CliResult, copy_tree
from tests.writers.rl_runs import ROLL_LAUNCH, WrittenFsdpRuns


def _refs(folder: Path) -> dict[str, CheckpointRef]:
    return {io.relative_to(r.url, str(folder)): r for r in scan_run(str(folder))}


def _set_age(folder: Path, seconds: float) -> None:
    then = time.time() - seconds
    for path in folder.rglob("*"):
        os.utime(path, (then, then))


def test_list_finds_every_launch(fsdp_runs: WrittenFsdpRuns, roll_megatron: Path, tmp_path: Path) -> None:
    output = copy_tree(fsdp_runs.roll_output, tmp_path / "output")
    copy_tree(fsdp_runs.roll_launch, output / "20250103-090000")  # a relaunch writes a new timestamp folder
    copy_tree(roll_megatron / "20250102-080000", output / "20250102-080000")
    found = sorted((name, r.layout, r.step, r.state, r.latest) for name, r in _refs(output).items())
    complete = CheckpointState.COMPLETE
    assert found == [
        (f"{ROLL_LAUNCH}/checkpoint-1", "roll", 1, complete, False),
        (f"{ROLL_LAUNCH}/checkpoint-2", "roll", 2, complete, False),
        ("20250102-080000/checkpoint-3", "roll", 3, complete, False),
        ("20250102-080000/checkpoint-4", "roll", 4, complete, False),
        ("20250103-090000/checkpoint-1", "roll", 1, complete, False),
        ("20250103-090000/checkpoint-2", "roll", 2, complete, False),
    ]  # ROLL keeps no `latest`: a resume takes the path


def test_inspect_an_actor_and_critic_checkpoint(fsdp_runs: WrittenFsdpRuns) -> None:
    checkpoint = open_checkpoint(str(fsdp_runs.roll_launch / "checkpoint-2"))
    meta = checkpoint.metadata
    assert (checkpoint.layout, checkpoint.ref.step, checkpoint.world_size) == ("roll", 2, 2)
    assert meta["progress"] == {
        "step": 2,
        "kv.scheduler_state_math.consumed_prompts": 8,
        "kv.scheduler_state_math.epoch": 0,
    }
    assert meta["metrics"] == {"system/step": 2, "critic/score/mean": 0.2, "actor/pg_loss": 0.5}
    assert (meta["actor"]["strategy"], meta["critic"]["strategy"]) == ("fsdp2", "fsdp2")
    assert meta["rng_keys"] == ["cpu", "numpy", "python"]
    assert {
        Component.MODEL,
        Component.OPTIMIZER,
        Component.SCHEDULER,
        Component.RNG,
        Component.TRAINER_STATE,
        Component.CONFIG,
    } <= checkpoint.components
    model = [t for t in checkpoint.tensors(Component.MODEL)]
    critic = [t for t in model if t.name.startswith("critic.")]
    assert sum(t.numel for t in critic) == fsdp_runs.model_parameters  # the critic's own weights
    assert sum(t.numel for t in model) == 2 * fsdp_runs.model_parameters
    assert all(c.file.startswith("critic/") for t in critic for c in t.chunks)
    assert checkpoint_metrics(checkpoint.ref)["critic/score/mean"] == 0.2


def test_every_launch_verifies(fsdp_runs: WrittenFsdpRuns, roll_megatron: Path) -> None:
    for run in (fsdp_runs.roll_output, roll_megatron):
        report = verify_run(str(run))
        assert report.ok, [(r.url, r.problems) for r in report.results if r.problems]


def test_a_folder_holding_only_some_ranks_files(fsdp_runs: WrittenFsdpRuns, tmp_path: Path) -> None:
    launch = copy_tree(fsdp_runs.roll_launch, tmp_path / "output" / ROLL_LAUNCH)
    (launch / "checkpoint-2" / "critic" / "dcp" / "__0_0.distcp").unlink()  # rank 0's upload has not arrived
    (launch / "checkpoint-1" / "dcp" / "__1_0.distcp").unlink()  # nor rank 1's: only .metadata tells
    _set_age(launch / "checkpoint-2", 0)
    refs = _refs(launch)
    assert refs["checkpoint-2"].state is CheckpointState.IN_PROGRESS
    assert "no critic/dcp/__0_0.distcp (no critic/dcp/ data files of rank(s) 0)" in refs["checkpoint-2"].note
    _set_age(launch / "checkpoint-2", 3600)
    assert _refs(launch)["checkpoint-2"].state is CheckpointState.BROKEN
    for name, missing in (("checkpoint-2", "critic/dcp/__0_0.distcp"), ("checkpoint-1", "dcp/__1_0.distcp")):
        result = verify_checkpoint(str(launch / name))
        assert (ProblemKind.MISSING_FILE, missing) in [(p.kind, p.path) for p in result.problems], name


def test_a_folder_without_the_pipeline_state_is_not_complete(fsdp_runs: WrittenFsdpRuns, tmp_path: Path) -> None:
    launch = copy_tree(fsdp_runs.roll_launch, tmp_path / ROLL_LAUNCH)
    (launch / "checkpoint-1" / "pipeline" / "worker_state_pipeline.json").unlink()
    _set_age(launch / "checkpoint-1", 3600)
    ref = _refs(launch)["checkpoint-1"]
    assert (ref.layout, ref.state) == ("roll", CheckpointState.BROKEN)
    assert [(p.kind, p.path) for p in verify_checkpoint(str(launch / "checkpoint-1")).problems] == [
        (ProblemKind.MISSING_FILE, "pipeline/worker_state_pipeline.json")
    ]


def test_megatron_checkpoints(roll_megatron: Path, fsdp_runs: WrittenFsdpRuns, tmp_path: Path) -> None:
    dist = open_checkpoint(str(roll_megatron / "20250102-080000" / "checkpoint-3"))
    assert dist.metadata["actor"]["strategy"] == "megatron"
    assert dist.world_size == 2  # one RNG file per rank
    assert sum(t.numel for t in dist.tensors(Component.MODEL)) == fsdp_runs.model_parameters  # dist_model/ DCP
    legacy = open_checkpoint(str(roll_megatron / "20250102-080000" / "checkpoint-4"))
    assert legacy.metadata["actor"]["parallelism"]["tensor_model_parallel_size"] == 2
    assert legacy.metadata["actor"]["mp_ranks"] == ["mp_rank_00", "mp_rank_01"]
    assert {Component.MODEL, Component.OPTIMIZER, Component.SCHEDULER, Component.RNG} <= legacy.components

    launch = copy_tree(roll_megatron / "20250102-080000", tmp_path / "20250102-080000")
    (launch / "checkpoint-4" / "iter_0000001" / "mp_rank_01" / "model_optim_rng.pt").unlink()
    (launch / "checkpoint-3" / "rng_state" / "rng_state_0.pth").unlink()
    _set_age(launch, 3600)
    refs = _refs(launch)
    assert refs["checkpoint-3"].state is CheckpointState.BROKEN
    assert [(p.kind, p.path) for p in verify_checkpoint(str(launch / "checkpoint-4")).problems] == [
        (ProblemKind.MISSING_FILE, "iter_0000001/mp_rank_01/model_optim_rng.pt")
    ]


def test_resume_plan_on_another_world_size_reshards_the_fsdp2_dcp_folder(
    fsdp_runs: WrittenFsdpRuns, roll_megatron: Path, run_cli: Callable[..., CliResult]
) -> None:
    """ROLL's FSDP2 strategy reloads `dcp/` with `dcp.load` into the new run's sharded state dict
    (alibaba/ROLL `roll/distributed/strategy/fsdp2_strategy.py`, `load_checkpoint` →
    `_load_checkpoint_with_dcp`), so torch DCP reshards it onto any number of ranks."""
    result = run_cli("resume-plan", fsdp_runs.roll_output, "--world-size", "4", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert doc["checkpoint"]["url"] == str(fsdp_runs.roll_launch / "checkpoint-2")
    assert (doc["world_size_ok"], doc["world_size"]["saved"], doc["world_size"]["target"]) == (True, 2, 4)
    assert "reshards" in doc["world_size"]["note"] and doc["world_size"]["fix"] == ""
    # Each of the 4 ranks reads a quarter of the actor's dcp/ tensors, as torch's own metadata sizes them.
    metadata = FileSystemReader(str(fsdp_runs.roll_launch / "checkpoint-2" / "dcp")).read_metadata()
    stored = sum(
        math.prod(item.size) * item.properties.dtype.itemsize
        for item in metadata.state_dict_metadata.values()
        if isinstance(item, TensorStorageMetadata)
    )
    assert doc["bytes_per_rank"] == stored // 4

    megatron = run_cli("resume-plan", roll_megatron, "--world-size", "4", "--json")  # no dcp/: not checked
    assert megatron.exit_code == 0 and megatron.json["world_size_ok"] is None
