"""The AReaL layout on a trial folder saved by FSDP2 the way AReaL saves (tests.writers.rl_runs), and on one
AReaL's own engine, Saver and RecoverHandler wrote (tests.writers.areal_writer)."""

from __future__ import annotations

import os
import pickle
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from ckptctl import io
from ckptctl.checkpoint import CheckpointState, Component, ProblemKind
from ckptctl.contract.resume import PlanContext
from ckptctl.formats.chunks import read_tensor
from ckptctl.layouts import get_layout, open_checkpoint, scan_run
from ckptctl.ops.resume_plan import plan_resume, profile_for
from ckptctl.ops.verification import verify_checkpoint, verify_run
from tests.conftest import CliResult, copy_tree
from tests.layouts.test_deepspeed import Payload
from tests.writers.areal_writer import WrittenAreal
from tests.writers.rl_runs import AREAL_EXPERIMENT, WrittenFsdpRuns


def _touch(path: Path, when: float) -> None:
    os.utime(path, (when, when))


def _trial(fsdp_runs: WrittenFsdpRuns, tmp_path: Path) -> Path:
    return copy_tree(fsdp_runs.areal_trial, tmp_path / "checkpoints" / "tester" / AREAL_EXPERIMENT / "trial0")


def _age(trial: Path, seconds: float = 3600.0) -> float:
    """Shift every file's time back by `seconds`, keeping their order (a save that stopped long ago)."""
    for path in trial.rglob("*"):
        stat = path.stat()
        _touch(path, stat.st_mtime - seconds)
    return time.time() - seconds


def test_list_finds_slots_and_exports_of_nested_trials(fsdp_runs: WrittenFsdpRuns, tmp_path: Path) -> None:
    user = tmp_path / "checkpoints" / "tester"
    copy_tree(fsdp_runs.areal_trial, user / AREAL_EXPERIMENT / "trial0")
    copy_tree(fsdp_runs.areal_trial, user / "math-ppo" / "run-7")
    refs = sorted(scan_run(str(user)), key=lambda r: r.url)
    found = [(io.relative_to(r.url, str(user)), r.layout, r.step, r.epoch, r.state, r.latest) for r in refs]
    complete = CheckpointState.COMPLETE
    for trial in (f"{AREAL_EXPERIMENT}/trial0", "math-ppo/run-7"):
        assert [f for f in found if f[0].startswith(trial)] == [
            (f"{trial}/critic/recover_checkpoint", "areal", 1, 0.0, complete, True),
            (f"{trial}/default/epoch0epochstep0globalstep0", "areal", 0, 0.0, complete, False),
            (f"{trial}/default/epoch0epochstep1globalstep1", "areal", 1, 0.0, complete, False),
            (f"{trial}/default/recover_checkpoint", "areal", 1, 0.0, complete, True),
        ]
    assert len(found) == 8  # recover_info/ (and its empty recover_checkpoint/) is part of the slots, not listed


def test_inspect_joins_the_slot_and_recover_info(fsdp_runs: WrittenFsdpRuns) -> None:
    slot = fsdp_runs.areal_trial / "default" / "recover_checkpoint"
    checkpoint = open_checkpoint(str(slot))
    meta = checkpoint.metadata
    assert (checkpoint.layout, checkpoint.ref.step, checkpoint.ref.epoch, checkpoint.world_size) == ("areal", 1, 0.0, 2)
    assert meta["progress"] == {"epoch": 0, "epoch_step": 1, "global_step": 1, "steps_per_epoch": 8}
    assert (meta["dataloader_ranks"], meta["last_commit_step"]) == (2, 1)
    assert checkpoint.components == {
        Component.MODEL,
        Component.OPTIMIZER,
        Component.TRAINER_STATE,
        Component.DATALOADER,
        Component.EXTRA,
    }
    assert {Component.SCHEDULER, Component.RNG} <= set(checkpoint.missing_components)  # AReaL saves neither
    model = {t.name: t for t in checkpoint.tensors(Component.MODEL)}
    assert sum(t.numel for t in model.values()) == fsdp_runs.model_parameters
    export = load_file(str(fsdp_runs.areal_trial / "default" / "epoch0epochstep1globalstep1" / "model.safetensors"))
    head = read_tensor(checkpoint.url, model["dcp.model.lm_head.weight"])  # both shards of the slot
    assert torch.equal(head, export["lm_head.weight"])


def test_the_whole_trial_verifies(fsdp_runs: WrittenFsdpRuns) -> None:
    report = verify_run(str(fsdp_runs.areal_trial))
    assert report.ok, [(r.url, r.problems) for r in report.results if r.problems]
    assert len(report.results) == 4


def test_an_unfinished_in_place_overwrite_is_caught(fsdp_runs: WrittenFsdpRuns, tmp_path: Path) -> None:
    trial = _trial(fsdp_runs, tmp_path)
    slot = trial / "default" / "recover_checkpoint"
    then = _age(trial)
    _touch(slot / "__1_0.distcp", then + 600)  # rank 1 rewrote its data; the old .metadata is still there
    ref = {r.url: r for r in scan_run(str(trial))}[str(slot)]
    assert ref.state is CheckpointState.BROKEN
    assert "__1_0.distcp is newer than .metadata" in ref.note
    problems = [(p.kind, p.path) for p in verify_checkpoint(str(slot)).problems if p.severity == "error"]
    assert (ProblemKind.BAD_METADATA, ".metadata") in problems


def test_info_files_older_than_the_weights_are_a_torn_save(fsdp_runs: WrittenFsdpRuns, tmp_path: Path) -> None:
    trial = _trial(fsdp_runs, tmp_path)
    slot = trial / "default" / "recover_checkpoint"
    then = _age(trial)
    for path in slot.iterdir():  # the slot was rewritten 10 minutes later; the info files were not
        _touch(path, then + 600)
    ref = {r.url: r for r in scan_run(str(trial))}[str(slot)]
    assert ref.state is CheckpointState.BROKEN
    assert "older than the weights" in ref.note
    result = verify_checkpoint(str(slot))
    assert not result.ok
    torn = {p.path for p in result.problems if p.kind == ProblemKind.BAD_METADATA}
    assert "../../recover_info/step_info.json" in torn


def test_a_fresh_torn_save_is_in_progress(fsdp_runs: WrittenFsdpRuns, tmp_path: Path) -> None:
    trial = _trial(fsdp_runs, tmp_path)
    slot = trial / "default" / "recover_checkpoint"
    now = time.time()
    for path in (trial / "recover_info").iterdir():
        _touch(path, now - 120)
    for path in slot.iterdir():  # the weights were just written, the info files are still the old ones
        _touch(path, now - 5)
    ref = {r.url: r for r in scan_run(str(trial))}[str(slot)]
    assert ref.state is CheckpointState.IN_PROGRESS


def test_a_hostile_dataloader_info_is_refused_and_not_run(fsdp_runs: WrittenFsdpRuns, tmp_path: Path) -> None:
    trial = _trial(fsdp_runs, tmp_path)
    marker = tmp_path / "pwned"
    info = trial / "recover_info" / "dataloader_info.pkl"
    stamp = info.stat().st_mtime
    info.write_bytes(pickle.dumps([Payload(os.system, f"touch {marker}")]))
    _touch(info, stamp)
    slot = trial / "default" / "recover_checkpoint"
    checkpoint = open_checkpoint(str(slot))
    assert Component.DATALOADER not in checkpoint.components
    result = verify_checkpoint(str(slot))
    assert [(p.kind, p.path) for p in result.problems] == [
        (ProblemKind.UNSAFE_PICKLE, "../../recover_info/dataloader_info.pkl")
    ]
    assert not marker.exists()


def test_a_slot_without_recover_info_is_broken(fsdp_runs: WrittenFsdpRuns, tmp_path: Path) -> None:
    trial = _trial(fsdp_runs, tmp_path)
    shutil.rmtree(trial / "recover_info")
    _age(trial)  # (while the slot is fresh, its info may still be coming: in progress)
    ref = {r.url: r for r in scan_run(str(trial))}[str(trial / "default" / "recover_checkpoint")]
    assert (ref.state, ref.step, ref.latest) == (CheckpointState.BROKEN, None, False)
    assert "start from scratch" in ref.note
    result = verify_checkpoint(str(trial / "default" / "recover_checkpoint"))
    assert [(p.kind, p.path) for p in result.problems] == [(ProblemKind.MISSING_FILE, "../../recover_info/")]


def test_an_export_not_renamed_yet_is_in_progress(fsdp_runs: WrittenFsdpRuns, tmp_path: Path) -> None:
    trial = _trial(fsdp_runs, tmp_path)
    export = trial / "default" / "epoch0epochstep1globalstep1"
    for path in export.iterdir():
        _touch(path, time.time())  # being written right now
    export.rename(export.with_name(export.name + ".tmp"))
    refs = {io.name_of(r.url): r for r in scan_run(str(trial))}
    tmp = refs["epoch0epochstep1globalstep1.tmp"]
    assert (tmp.layout, tmp.step, tmp.state) == ("areal", 1, CheckpointState.IN_PROGRESS)


def test_resume_plan_skips_a_torn_save_by_the_layouts_rule(fsdp_runs: WrittenFsdpRuns, tmp_path: Path) -> None:
    trial = _trial(fsdp_runs, tmp_path)
    slot = trial / "default" / "recover_checkpoint"
    plan = plan_resume(str(trial))
    assert plan.checkpoint is not None and plan.checkpoint.url == str(slot)
    assert plan.framework == "AReaL" and not any("torn" in w for w in plan.warnings)

    # The slot rewritten 1.5 s after its info files: past the rule's 1 s slack (resume-plan's own copy of
    # the rule used 2 s, so it disagreed with the layout between the two).
    then = _age(trial)
    for path in (trial / "recover_info").iterdir():
        _touch(path, then)
    for path in slot.iterdir():
        _touch(path, then + 1.5)
    plan = plan_resume(str(trial))
    assert plan.checkpoint is None
    reasons = {s.url: s.reason for s in plan.skipped}
    assert reasons[str(slot)].startswith("broken: recover_info/")
    assert "the save was torn between the slot and its info files" in reasons[str(slot)]
    # The profile's warning applies the same rule to the same files.
    checkpoint = open_checkpoint(str(slot))
    ctx = PlanContext(str(trial), checkpoint, (checkpoint.ref,), (), None, layout_of=get_layout)
    (note,) = profile_for("areal").notes(ctx)
    assert "step_info.json" in note and "older than the recover checkpoint's .metadata" in note


def test_convert_without_config_takes_the_savers_export_beside_the_slot(
    areal_run: WrittenAreal, run_cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """On a trial AReaL's own code wrote (tests.writers.areal_writer): the recover slot holds weights only;
    AReaL's Saver writes the config and tokenizer into its exports in the same model folder
    (areal/utils/saver.py `Saver.save` → areal/engine/fsdp_engine.py `FSDPEngine._save_model_to_hf`:
    `save_pretrained`, `model_config.save_pretrained`, `tokenizer.save_pretrained`)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trial = areal_run.trial
    found = sorted((io.relative_to(r.url, str(trial)), r.step, r.state, r.latest) for r in scan_run(str(trial)))
    complete = CheckpointState.COMPLETE
    assert found == [
        ("default/epoch0epochstep0globalstep0", 0, complete, False),
        ("default/epoch0epochstep1globalstep1", 1, complete, False),
        ("default/recover_checkpoint", 1, complete, True),
    ]
    assert verify_run(str(trial)).ok

    result = run_cli("convert", areal_run.slot, tmp_path / "hf", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert f"config.json taken from {areal_run.export(1)}" in doc["warnings"]  # the export of the slot's step
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(doc["copied"])
    dcp_to_torch_save(areal_run.slot, tmp_path / "source.pt")  # torch's own reading of the slot
    source = torch.load(tmp_path / "source.pt", weights_only=True)["dcp"]["model"]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    state = model.state_dict()
    assert sorted(state) == sorted(source)
    for name, tensor in source.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf")).vocab_size == model.config.vocab_size

    # Without an export of the slot's own step (the Saver's frequency differs), the latest one serves.
    copy = copy_tree(trial, tmp_path / "checkpoints" / "tester" / "tiny-sft" / "trial0")
    shutil.rmtree(copy / "default" / "epoch0epochstep1globalstep1")
    other = run_cli("convert", copy / "default" / "recover_checkpoint", tmp_path / "hf-0", "--json")
    assert other.exit_code == 0, other.stderr
    assert f"config.json taken from {copy / 'default' / 'epoch0epochstep0globalstep0'}" in other.json["warnings"]
