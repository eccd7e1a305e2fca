"""The open-instruct layout on a checkpoint state folder arranged from real DeepSpeed tags (tests.writers.rl_runs)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState, Component, ProblemKind
from ckptctl.layouts import open_checkpoint, scan_run
from ckptctl.ops.verification import verify_checkpoint, verify_run
from tests.conftest import CliResult, copy_tree
from tests.layouts.test_deepspeed import Payload
from tests.writers.deepspeed_writer import WrittenDeepSpeed


def _age(folder: Path, seconds: float = 3600.0) -> None:
    """Make every file of a folder look written `seconds` ago (0: just now)."""
    then = time.time() - seconds
    for path in folder.rglob("*"):
        os.utime(path, (then, then))


def _refs(folder: Path) -> dict[str, CheckpointRef]:
    return {io.name_of(r.url): r for r in scan_run(str(folder))}


def test_list_uses_the_training_step_and_skips_the_shared_reference_policy(open_instruct_run: Path) -> None:
    refs = sorted(scan_run(str(open_instruct_run)), key=lambda r: r.url)
    state_of_step_2 = refs[1].state  # no completion marker: in progress or broken, by its age
    assert state_of_step_2 is not CheckpointState.COMPLETE
    assert [(io.relative_to(r.url, str(open_instruct_run)), r.layout, r.step, r.state, r.latest) for r in refs] == [
        ("output/grpo_tiny__1__1700000000_checkpoints/step_1", "open_instruct", 1, CheckpointState.COMPLETE, False),
        ("output/grpo_tiny__1__1700000000_checkpoints/step_2", "open_instruct", 2, state_of_step_2, False),
        ("state/global_step2", "open_instruct", 1, CheckpointState.COMPLETE, False),  # tag 2 = optimizer steps
        ("state/global_step4", "open_instruct", 2, CheckpointState.COMPLETE, True),
    ]


def test_inspect_reports_counters_rng_data_state_and_reference_policy(
    open_instruct_run: Path, deepspeed_runs: dict[int, WrittenDeepSpeed]
) -> None:
    checkpoint = open_checkpoint(str(open_instruct_run / "state" / "global_step4"))
    meta = checkpoint.metadata
    assert (checkpoint.layout, checkpoint.ref.step, checkpoint.world_size) == ("open_instruct", 2, 2)
    assert meta["progress"] == {"training_step": 2, "episode": 32, "num_total_tokens": 1024, "optimizer_steps": 4}
    assert meta["rng_keys"] == ["numpy_rng_state", "python_rng_state", "torch_cpu_rng_state"]
    assert meta["driver_state"] == ["data_prep_actor_state", "dataloader_state"]
    assert meta["ref_policy"]["path"] == "../ref_policy/pytorch_model.bin"
    assert {Component.MODEL, Component.OPTIMIZER, Component.RNG, Component.DATALOADER} <= checkpoint.components
    assert sum(t.numel for t in checkpoint.tensors(Component.MODEL)) == deepspeed_runs[2].model_parameters


def test_the_whole_run_verifies(open_instruct_run: Path) -> None:
    report = verify_run(str(open_instruct_run / "state"))
    assert report.ok, [(r.url, r.problems) for r in report.results if r.problems]


def test_a_tag_with_fewer_entries_than_the_fullest_is_broken(open_instruct_run: Path, tmp_path: Path) -> None:
    state = copy_tree(open_instruct_run / "state", tmp_path / "state")
    (state / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()  # an upload cut short
    _age(state / "global_step2", 0)
    assert _refs(state)["global_step2"].state is CheckpointState.IN_PROGRESS  # could still be arriving
    _age(state / "global_step2")
    refs = _refs(state)
    assert refs["global_step2"].state is CheckpointState.BROKEN
    assert "fewer than global_step4's 4" in refs["global_step2"].note
    assert refs["global_step4"].state is CheckpointState.COMPLETE
    result = verify_checkpoint(str(state / "global_step2"))
    assert not result.ok
    messages = [p.message for p in result.problems if p.kind == ProblemKind.MISSING_FILE]
    assert any("lacks bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in m for m in messages)


def test_a_hostile_driver_state_is_refused_and_not_run(open_instruct_run: Path, tmp_path: Path) -> None:
    state = copy_tree(open_instruct_run / "state", tmp_path / "state")
    marker = tmp_path / "pwned"
    torch.save({"dataloader_state": Payload(os.system, f"touch {marker}")}, state / "global_step4" / "driver_state.pt")
    assert _refs(state)["global_step4"].state is CheckpointState.BROKEN
    result = verify_checkpoint(str(state / "global_step4"))
    assert (ProblemKind.UNSAFE_PICKLE, "driver_state.pt") in [(p.kind, p.path) for p in result.problems]
    assert not marker.exists()


def test_a_missing_reference_policy_is_a_warning(open_instruct_run: Path, tmp_path: Path) -> None:
    state = copy_tree(open_instruct_run / "state", tmp_path / "state")
    (state / "ref_policy" / "pytorch_model.bin").unlink()
    result = verify_checkpoint(str(state / "global_step4"))
    assert result.ok
    assert [(p.kind, p.path, p.severity) for p in result.problems] == [
        (ProblemKind.MISSING_FILE, "../ref_policy/pytorch_model.bin", "warning")
    ]


def test_a_snapshot_without_its_marker_is_in_progress_then_broken(open_instruct_run: Path, tmp_path: Path) -> None:
    output = copy_tree(open_instruct_run / "output", tmp_path / "output")
    _age(output, 0)
    assert _refs(output)["step_2"].state is CheckpointState.IN_PROGRESS
    _age(output)
    refs = _refs(output)
    assert (refs["step_1"].state, refs["step_2"].state) == (CheckpointState.COMPLETE, CheckpointState.BROKEN)
    assert not verify_checkpoint(str(next(output.iterdir()) / "step_2")).ok


def test_convert_without_config_takes_the_snapshot_of_the_tags_training_step(
    open_instruct_run: Path,
    deepspeed_runs: dict[int, WrittenDeepSpeed],
    run_cli: Callable[..., CliResult],
    tmp_path: Path,
) -> None:
    """A tag of `--checkpoint_state_dir` holds no config: open-instruct writes it only into the HF snapshots
    under `--output_dir` (see `arrange_open_instruct`), found beside the state folder. global_step4 is
    training step 2: step_2 is the snapshot of the same step."""
    from transformers import AutoModelForCausalLM

    tag = open_instruct_run / "state" / "global_step4"
    snapshots = open_instruct_run / "output" / "grpo_tiny__1__1700000000_checkpoints"
    result = run_cli("convert", tag, tmp_path / "hf", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert doc["weights"] == "master" and "config.json" in doc["copied"]
    assert f"config.json taken from {snapshots / 'step_2'}" in doc["warnings"]
    reference = deepspeed_runs[2].reference_tensors()  # DeepSpeed's own zero_to_fp32 of that tag
    state = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).state_dict()
    assert sorted(state) == sorted(reference)
    for name, tensor in reference.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name

    # The state folder inside the output folder (`--checkpoint_state_dir out/state --output_dir out`), and no
    # snapshot of training step 1 (global_step2): the latest snapshot serves, of the newest run (its name ends
    # in its start time).
    out = tmp_path / "out"
    state = copy_tree(open_instruct_run / "state", out / "state")
    copy_tree(snapshots / "step_2", out / "grpo_tiny__1__1700000000_checkpoints" / "step_3")
    newest = copy_tree(snapshots / "step_2", out / "grpo_tiny__1__1800000000_checkpoints" / "step_3")
    copy_tree(snapshots / "step_1", out / "grpo_tiny__1__1800000000_checkpoints" / "step_2")
    other = run_cli("convert", state / "global_step2", tmp_path / "hf-1", "--json")
    assert other.exit_code == 0, other.stderr
    assert f"config.json taken from {newest}" in other.json["warnings"]
