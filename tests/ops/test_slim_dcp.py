"""`slim` of DCP folders (a 2-rank FSDP2 `get_state_dict` save, torchtitan's `step-N/`, Megatron dist-ckpt's
`iter_N/`): the model items are rewritten into new data files and a new `.metadata`, which torch's own
`dcp.load` reads to the same tensors as the original's, and `convert` writes the same bytes from."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptctl.checkpoint import CheckpointState
from ckptctl.errors import CkptctlError
from ckptctl.families.dcp_slim import training_only
from ckptctl.formats.dcp_metadata import METADATA_NAME, parse_dcp_metadata
from ckptctl.formats.slim_marker import SLIM_MARKER, read_slim_marker
from ckptctl.layouts import detect
from ckptctl.layouts.slimming import slim_checkpoint, slimmable
from ckptctl.ops.convert import ConvertOptions
from ckptctl.ops.resume_plan import plan_resume
from ckptctl.ops.slim import KILL_AT_ENV, slim
from ckptctl.ops.verification import VerifyOptions, verify_path
from tests.conftest import CliResult, copy_tree
from tests.ops.test_prune import tree
from tests.ops.test_slim import NO_GRACE, REPO, converted, states
from tests.writers.megatron_writer import WrittenMegatron
from tests.writers.torchtitan_writer import WrittenTorchtitan


def dcp_loaded(folder: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `keys` as torch's own `dcp.load` reads them from the DCP folder, into fresh tensors of the
    shapes and dtypes its `.metadata` gives (torch's `FileSystemReader` reading it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    described = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {key: torch.zeros(described[key].size, dtype=described[key].properties.dtype) for key in keys}
    dcp.load(state, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    return state


def model_keys(folder: Path) -> list[str]:
    """The tensor keys of the DCP folder that slim keeps (every one not training-only)."""
    metadata = parse_dcp_metadata((folder / METADATA_NAME).read_bytes(), str(folder))
    return [key for key, _ in metadata.tensors() if training_only(key) is None]


def assert_slimmed_like(slimmed: Path, original: Path, tmp_path: Path, options: ConvertOptions | None = None) -> None:
    """`slimmed` is a slim checkpoint holding exactly the original's model items: torch loads them to equal
    tensors, it holds no training-only key, it verifies (every kept item read back) and converts to the
    same files."""
    assert detect(str(slimmed))[1].state is CheckpointState.SLIM
    keys = model_keys(original)
    assert keys and model_keys(slimmed) == keys
    stored = parse_dcp_metadata((slimmed / METADATA_NAME).read_bytes(), str(slimmed)).entries
    assert not [key for key in stored if training_only(key)]
    loaded, before = dcp_loaded(slimmed, keys), dcp_loaded(original, keys)
    assert all(torch.equal(loaded[key], before[key]) for key in keys)
    assert verify_path(str(slimmed), VerifyOptions(deep=True)).ok
    name = slimmed.name
    assert converted(slimmed, tmp_path / f"{name}-slim", options) == converted(
        original, tmp_path / f"{name}-full", options
    )


def test_fsdp2_dcp_run_slims_its_older_steps_and_keeps_their_model(
    demo_dir: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    original = demo_dir / "dcp"
    run = copy_tree(original, tmp_path / "dcp")
    before = sum(p.stat().st_size for p in (run / "step-10").iterdir())
    report = slim(str(run), grace=NO_GRACE)
    assert [Path(i.url).name for i in report.slimmed] == ["step-10", "step-20"] and not report.skipped
    planned = {Path(i.url).name: i.freed_bytes for i in report.plan.slim}
    freed = {Path(i.url).name: i.freed_bytes for i in report.slimmed}
    # AdamW's two fp32 moments are twice the model: two thirds of the tensors go (less the counters kept).
    assert all(0.6 * before < freed[name] < before for name in freed)
    assert all(0 < planned[name] <= freed[name] for name in planned)
    assert states(run) == {"step-10": "slim", "step-20": "slim", "step-30": "complete"}
    for name in ("step-10", "step-20"):
        assert_slimmed_like(run / name, original / name, tmp_path)
        marker = read_slim_marker(str(run / name))
        assert marker is not None and marker.dropped == ("optimizer",)
        assert sorted(marker.written) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    listed = run_cli("list", run, "--json").json["checkpoints"]
    assert {Path(row["url"]).name: row["state"] for row in listed} == states(run)
    # The newest is the resume target; slimmed on its own, a resume goes back to the newest whole one.
    _, newest = detect(str(run / "step-30"))
    assert slim_checkpoint(newest) > 0
    resume = plan_resume(str(run))
    assert resume.checkpoint is None
    assert {Path(s.url).name: s.state for s in resume.skipped}["step-30"] is CheckpointState.SLIM
    # Slim again: nothing left to do.
    again = tree(run)
    assert not slim(str(run), grace=NO_GRACE).slimmed and tree(run) == again


def test_torch_reads_the_nested_model_and_counters_of_a_slim_save(demo_dir: Path, tmp_path: Path) -> None:
    """`dcp_to_torch_save` (torch's planner for a state dict it has not got: the default planner's key paths
    in `.metadata`) rebuilds the nested model from the slim folder as from the original."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    original = demo_dir / "dcp" / "step-10"
    slimmed = copy_tree(original, tmp_path / "step-10")
    slim_checkpoint(detect(str(slimmed))[1])
    dcp_to_torch_save(str(slimmed), str(tmp_path / "slim.pt"))
    dcp_to_torch_save(str(original), str(tmp_path / "full.pt"))
    slim_state = torch.load(tmp_path / "slim.pt", weights_only=True)
    full_state = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(slim_state) == {"model"} and set(full_state) == {"model", "optim"}
    assert slim_state["model"].keys() == full_state["model"].keys()
    assert all(torch.equal(slim_state["model"][k], full_state["model"][k]) for k in full_state["model"])


def test_torchtitan_steps_drop_optimizer_scheduler_and_dataloader(
    torchtitan_run: WrittenTorchtitan, tmp_path: Path
) -> None:
    top = copy_tree(torchtitan_run.dump_folder, tmp_path / "dump")
    run = top / "checkpoint"
    report = slim(str(run), grace=NO_GRACE)
    assert [Path(i.url).name for i in report.slimmed] == ["step-1"] and report.freed_bytes > 0
    marker = read_slim_marker(str(run / "step-1"))
    assert marker is not None and marker.dropped == ("dataloader", "optimizer", "scheduler")
    options = ConvertOptions(config_dir=str(torchtitan_run.assets))
    assert_slimmed_like(run / "step-1", torchtitan_run.step(1), tmp_path, options)
    counters = parse_dcp_metadata((run / "step-1" / METADATA_NAME).read_bytes(), "step-1").bytes_keys
    assert set(counters) == {"train_state.step", "train_state.ntokens_seen"}
    # The model-only step-3 (torchtitan's last save with `last_save_model_only`) holds nothing to drop.
    assert slimmable(detect(str(run / "step-3"))[1]) == "model weights only (an export): nothing to drop"


def test_megatron_iteration_drops_optimizer_and_rng_and_release_is_kept(
    megatron_runs: WrittenMegatron, tmp_path: Path
) -> None:
    run = copy_tree(megatron_runs.save, tmp_path / "save")
    report = slim(str(run), grace=NO_GRACE)
    assert [Path(i.url).name for i in report.slimmed] == ["iter_0000001"] and report.freed_bytes > 0
    slimmed = run / "iter_0000001"
    marker = read_slim_marker(str(slimmed))
    assert marker is not None and marker.dropped == ("optimizer", "rng")
    assert (slimmed / "common.pt").exists() and (slimmed / "metadata.json").exists()
    assert_slimmed_like(slimmed, megatron_runs.iteration(1), tmp_path)
    release = copy_tree(megatron_runs.release_save, tmp_path / "release")
    before = tree(release)
    kept = slim(str(release / "release"), grace=NO_GRACE)
    assert not kept.slimmed and tree(release) == before


@pytest.mark.parametrize("point", ["staged", "installed"])
def test_a_kill_leaves_the_whole_original_or_the_whole_slim_dcp_folder(
    demo_dir: Path, tmp_path: Path, point: str
) -> None:
    run = copy_tree(demo_dir / "dcp", tmp_path / "run")
    env = {**os.environ, KILL_AT_ENV: point, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "ckptctl", "slim", str(run / "step-10"), "-y", "--grace", "0"]
    killed = subprocess.run(args, env=env, capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    expected = "slim" if point == "installed" else "complete"
    assert states(run) == {"step-10": expected, "step-20": "complete", "step-30": "complete"}
    assert verify_path(str(run)).ok
    assert (run / "step-10" / SLIM_MARKER).exists() is (point == "installed")
    if point != "installed":
        assert tree(run / "step-10") == tree(demo_dir / "dcp" / "step-10")
    else:
        assert_slimmed_like(run / "step-10", demo_dir / "dcp" / "step-10", tmp_path)


def test_a_copy_outside_the_kernel_slims_the_same_and_a_truncated_data_file_leaves_the_original(
    demo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptctl.families.dcp_slim as dcp_slim

    def refused(*args: object) -> int:
        raise OSError(errno.EXDEV, "not across filesystems")

    monkeypatch.setattr(dcp_slim.os, "copy_file_range", refused)
    original = demo_dir / "dcp" / "step-10"
    copied = copy_tree(original, tmp_path / "copied" / "step-10")
    assert slim_checkpoint(detect(str(copied))[1]) > 0
    assert_slimmed_like(copied, original, tmp_path)

    cut = copy_tree(original, tmp_path / "cut" / "step-10")
    data = cut / "__1_0.distcp"
    os.truncate(data, 100)  # inside its first item, a model one
    before = tree(cut)
    with pytest.raises(CkptctlError, match="truncated"):
        slim_checkpoint(detect(str(cut))[1])
    assert tree(cut) == before and detect(str(cut))[1].state is not CheckpointState.SLIM
