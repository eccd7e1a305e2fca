"""`slim` of Lightning (`.ckpt` files and sharded `.ckpt/` folders), ROLL (`checkpoint-N/` with `dcp/` and `critic/`)
and AReaL (the recover slot) saves written by the real writers: what goes, that the framework's own load of the
model part reads the same tensors, that `convert` writes the same bytes, and what `list`/`resume-plan` say."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptctl.checkpoint import CheckpointState
from ckptctl.formats.dcp_metadata import METADATA_NAME, parse_dcp_metadata
from ckptctl.formats.slim_marker import SLIM_NOTE, is_slim_file, read_slim_marker
from ckptctl.layouts import detect, scan_run
from ckptctl.layouts.slimming import slim_checkpoint, slimmable
from ckptctl.ops.resume_plan import plan_resume
from ckptctl.ops.slim import RESUME_TARGET, slim
from ckptctl.ops.verification import VerifyOptions, verify_path
from tests.conftest import copy_tree
from tests.ops.test_prune import tree
from tests.ops.test_slim import NO_GRACE, converted
from tests.writers.areal_writer import WrittenAreal
from tests.writers.lightning_writer import WrittenLightning
from tests.writers.rl_runs import WrittenFsdpRuns


def dcp_loaded(folder: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `keys` as torch's own `dcp.load` reads them (into tensors shaped as `.metadata` says)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    described = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {key: torch.zeros(described[key].size, dtype=described[key].properties.dtype) for key in keys}
    dcp.load(state, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    return state


def tensor_keys(folder: Path) -> list[str]:
    return [key for key, _ in parse_dcp_metadata((folder / METADATA_NAME).read_bytes(), str(folder)).tensors()]


def assert_same_model_items(slimmed: Path, original: Path, model: Callable[[str], bool]) -> None:
    """The slim DCP folder holds exactly the original's tensor items that are the `model`'s, which torch's
    `dcp.load` reads to equal tensors, and no other tensor item."""
    keys = [key for key in tensor_keys(original) if model(key)]
    assert keys and tensor_keys(slimmed) == keys
    loaded, before = dcp_loaded(slimmed, keys), dcp_loaded(original, keys)
    assert all(torch.equal(loaded[key], before[key]) for key in keys)


def test_lightning_file_drops_optimizer_and_schedulers_and_loads_the_same(
    lightning_run: WrittenLightning, tmp_path: Path
) -> None:
    from tests.writers.lightning_module import TinyLlamaModule

    run = copy_tree(lightning_run.linked, tmp_path / "linked")
    name = "epoch=0-step=2.ckpt"
    report = slim(str(run), grace=NO_GRACE)
    assert [Path(i.url).name for i in report.slimmed] == [name]
    assert report.slimmed[0].dropped == ("optimizer", "scheduler")
    slimmed, original = run / name, lightning_run.linked / name
    freed = original.stat().st_size - slimmed.stat().st_size
    assert report.slimmed[0].freed_bytes == freed > 0.6 * original.stat().st_size  # AdamW: two moments a weight
    assert is_slim_file(str(slimmed)) and not is_slim_file(str(original))
    assert slimmed.stat().st_mtime_ns == original.stat().st_mtime_ns  # still dated as the save
    # What Lightning's own loaders read: the whole dict but the two entries, the weights to the byte.
    full = torch.load(original, weights_only=False)
    cut = torch.load(slimmed, weights_only=False)
    assert set(full) - set(cut) == {"optimizer_states", "lr_schedulers"}
    for key in cut:
        if key != "state_dict":
            assert cut[key] == full[key], key
    assert cut["state_dict"]._metadata == full["state_dict"]._metadata
    module = TinyLlamaModule.load_from_checkpoint(slimmed)
    reference = TinyLlamaModule.load_from_checkpoint(original)
    assert all(
        torch.equal(a, b) for a, b in zip(module.state_dict().values(), reference.state_dict().values(), strict=True)
    )
    assert module.hparams == reference.hparams
    # list, verify, resume-plan and convert.
    assert {Path(r.url).name: r.state for r in scan_run(str(run))} == {
        name: CheckpointState.SLIM,
        "epoch=0-step=4.ckpt": CheckpointState.COMPLETE,
    }
    assert verify_path(str(run), VerifyOptions(deep=True)).ok
    assert converted(slimmed, tmp_path / "slim") == converted(original, tmp_path / "full")
    newest = run / "epoch=0-step=4.ckpt"
    newest.write_bytes(newest.read_bytes()[:100])
    resume = plan_resume(str(run))
    assert resume.checkpoint is None
    assert {Path(s.url).name: s.reason for s in resume.skipped}[name] == SLIM_NOTE
    # Slimmed once: nothing left to drop.
    again = slim(str(run), grace=NO_GRACE)
    assert not again.slimmed


def test_lightning_sharded_folder_drops_its_optimizer_items(lightning_run: WrittenLightning, tmp_path: Path) -> None:
    original = lightning_run.sharded
    slimmed = copy_tree(original, tmp_path / original.name)
    # The only save of its folder is what a resume loads: slimmed directly, as the manager's retention does.
    assert slim(str(slimmed), grace=NO_GRACE).plan.items[0].reasons[0] == RESUME_TARGET
    assert slim_checkpoint(detect(str(slimmed))[1]) > 0
    assert_same_model_items(slimmed, original, lambda key: key.startswith("model."))
    marker = read_slim_marker(str(slimmed))
    assert marker is not None and marker.dropped == ("optimizer",)
    assert (slimmed / "meta.pt").read_bytes() == (original / "meta.pt").read_bytes()
    assert detect(str(slimmed))[1].state is CheckpointState.SLIM
    assert verify_path(str(slimmed), VerifyOptions(deep=True)).ok
    assert converted(slimmed, tmp_path / "slim") == converted(original, tmp_path / "full")


def test_roll_checkpoint_keeps_its_model_and_drops_the_rest(fsdp_runs: WrittenFsdpRuns, tmp_path: Path) -> None:
    launch = copy_tree(fsdp_runs.roll_launch, tmp_path / "launch")
    report = slim(str(launch), grace=NO_GRACE)
    assert [Path(i.url).name for i in report.slimmed] == ["checkpoint-1"]
    assert report.slimmed[0].dropped == ("optimizer", "rng", "scheduler")
    assert report.plan.keep[0].reasons[0] == RESUME_TARGET  # checkpoint-2
    slimmed, original = launch / "checkpoint-1", fsdp_runs.roll_launch / "checkpoint-1"
    assert not (slimmed / "pipeline" / "rng_state_pipeline.pth").exists()
    assert (slimmed / "pipeline" / "worker_state_pipeline.json").exists()
    before = sum(p.stat().st_size for p in original.rglob("*") if p.is_file())
    assert report.slimmed[0].freed_bytes > 0.5 * before
    # ROLL's FSDP2 save: `{**model.state_dict(), ...}` at the top of `dcp/`, the model's own keys.
    training = ("optimizer.", "scheduler.", "rng_state.")
    assert_same_model_items(slimmed / "dcp", original / "dcp", lambda key: not key.startswith(training))
    assert "lm_head.weight" in tensor_keys(slimmed / "dcp")
    assert {Path(r.url).name: r.state for r in scan_run(str(launch))}["checkpoint-1"] is CheckpointState.SLIM
    assert verify_path(str(launch), VerifyOptions(deep=True)).ok
    assert Path(plan_resume(str(launch)).checkpoint.url).name == "checkpoint-2"  # type: ignore[union-attr]
    assert converted(slimmed, tmp_path / "slim") == converted(original, tmp_path / "full")


def test_areal_recover_slot_is_kept_while_resumed_and_slims_its_optimizer(
    areal_run: WrittenAreal, tmp_path: Path
) -> None:
    trial = copy_tree(areal_run.trial, tmp_path / "trial")
    before = tree(trial)
    report = slim(str(trial), grace=NO_GRACE)
    slot = trial / "default" / "recover_checkpoint"
    assert not report.slimmed and tree(trial) == before
    assert {Path(i.url).name: i.reasons[0] for i in report.plan.items}["recover_checkpoint"] == RESUME_TARGET
    # A slot no resume reads (an archived trial): slimmed directly.
    times = {p.name: p.stat().st_mtime_ns for p in slot.iterdir()}
    assert slim_checkpoint(detect(str(slot))[1]) > 0.6 * sum(
        p.stat().st_size for p in (areal_run.trial / "default" / "recover_checkpoint").iterdir()
    )
    # AReaL's own load (`DCPState.load_state_dict`: `set_model_state_dict` of the `dcp.model.*` items) reads these.
    assert_same_model_items(
        slot, areal_run.trial / "default" / "recover_checkpoint", lambda key: key.startswith("dcp.model.")
    )
    assert not [k for k in tensor_keys(slot) if k.startswith("dcp.optim")]
    # The rewritten files keep their times: AReaL's torn-save rule still reads the save as finished.
    assert {p.name: p.stat().st_mtime_ns for p in slot.iterdir() if p.name in times} == times
    listed = {Path(r.url).name: r for r in scan_run(str(trial))}
    assert listed["recover_checkpoint"].state is CheckpointState.SLIM
    assert verify_path(str(slot), VerifyOptions(deep=True)).ok
    resume = plan_resume(str(trial))
    assert resume.checkpoint is None or Path(resume.checkpoint.url).name != "recover_checkpoint"
    full = areal_run.trial / "default" / "recover_checkpoint"
    assert converted(slot, tmp_path / "slim") == converted(full, tmp_path / "full")


def test_a_lightning_file_whose_pickle_cannot_be_cut_is_kept_whole(tmp_path: Path) -> None:
    """A kept entry sharing a dict with `optimizer_states` (pickle memoises a dict empty, then fills it): the
    file is refused, nothing written."""
    shared = {"lr": 0.1}
    state = {
        "epoch": 0,
        "global_step": 2,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": {"w": torch.ones(4)},
        "optimizer_states": [{"param_groups": [shared], "state": {0: {"exp_avg": torch.zeros(4)}}}],
        "lr_schedulers": [],
        "hyper_parameters": shared,
    }
    folder = tmp_path / "ckpts"
    folder.mkdir()
    for step in (2, 4):
        torch.save(state, folder / f"epoch=0-step={step}.ckpt")
    before = tree(folder)
    found = slimmable(detect(str(folder / "epoch=0-step=2.ckpt"))[1])
    assert isinstance(found, str) and "cannot be cut apart" in found
    assert not slim(str(folder), grace=NO_GRACE).slimmed and tree(folder) == before
    assert not os.path.exists(folder / ".ckptctl-trash")


@pytest.mark.parametrize("point", ["staged", "installed"])
def test_a_kill_leaves_the_whole_lightning_file_or_the_slim_one(
    lightning_run: WrittenLightning, tmp_path: Path, point: str
) -> None:
    import subprocess
    import sys

    from ckptctl.ops.slim import KILL_AT_ENV
    from tests.ops.test_slim import REPO

    run = copy_tree(lightning_run.linked, tmp_path / "linked")
    name = "epoch=0-step=2.ckpt"
    env = {**os.environ, KILL_AT_ENV: point, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "ckptctl", "slim", str(run / name), "-y", "--grace", "0"]
    killed = subprocess.run(args, env=env, capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    assert is_slim_file(str(run / name)) is (point == "installed")
    if point == "staged":
        assert (run / name).read_bytes() == (lightning_run.linked / name).read_bytes()
    assert [Path(r.url).name for r in scan_run(str(run))] == [name, "epoch=0-step=4.ckpt"]
    assert verify_path(str(run)).ok


def test_lightning_deepspeed_folder_keeps_its_masters_as_a_model_file(
    lightning_run: WrittenLightning, tmp_path: Path
) -> None:
    run = copy_tree(lightning_run.deepspeed, tmp_path / "deepspeed")
    name = "epoch=0-step=1.ckpt"
    report = slim(str(run), grace=NO_GRACE)
    assert [Path(i.url).name for i in report.slimmed] == [name] and report.slimmed[0].dropped == ("optimizer",)
    assert not list((run / name / "checkpoint").glob("*optim_states.pt"))
    assert verify_path(str(run), VerifyOptions(deep=True)).ok
    assert converted(run / name, tmp_path / "slim") == converted(lightning_run.deepspeed / name, tmp_path / "full")
