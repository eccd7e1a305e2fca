"""`resume-plan` on real runs with the traps of each framework added: what it picks, skips and warns about."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Component
from ckptctl.contract.base import Layout
from ckptctl.contract.resume import PlanContext
from ckptctl.errors import CheckpointNotFound, CkptctlError, UnknownLayout
from ckptctl.layouts import get_layout, layout_names
from ckptctl.ops.resume_plan import plan_resume, profile_for
from tests.conftest import copy_tree
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.rl_runs import arrange_open_instruct, arrange_openrlhf
from tests.writers.trainer_writer import WrittenTrainerRun


@pytest.fixture
def zero2(deepspeed_runs: dict[int, WrittenDeepSpeed]) -> WrittenDeepSpeed:
    """The session's DeepSpeed ZeRO-2 run (2 CPU ranks, bf16): `global_step2/`, `global_step4/`, `latest`."""
    return deepspeed_runs[2]


@pytest.fixture
def trainer(trainer_run: WrittenTrainerRun) -> WrittenTrainerRun:
    """The session's transformers.Trainer run: `checkpoint-2/` and `checkpoint-4/`."""
    return trainer_run


def _age(path: Path, seconds: float) -> None:
    """Make every file below `path` look `seconds` old (as if written by an earlier process)."""
    when = time.time() - seconds
    for item in [path, *path.rglob("*")]:
        os.utime(item, (when, when))


def _name(url: str | None) -> str | None:
    return None if url is None else io.name_of(url)


# --- ckptctl's own runs ----------------------------------------------------------------------------


def test_native_run_on_one_and_four_ranks(demo_dir: Path) -> None:
    run = str(demo_dir / "native")
    plan = plan_resume(run, cuda=True)
    assert plan.checkpoint is not None and _name(plan.checkpoint.url) == "step-30"
    assert plan.framework == "ckptctl" and not plan.skipped
    assert plan.resume_hint == f"CheckpointManager({str(run)!r}).restore(state)"
    assert plan.restores == ("model", "optimizer", "scheduler", "rng", "trainer_state")
    assert plan.missing == ("dataloader",) and "sampler" in plan.impacts["dataloader"]
    assert plan.continues_from == {"step": 30, "epoch": None}
    assert plan.world_size is not None and plan.world_size.ok is True and plan.world_size.target == 1
    on_disk = sum(f.stat().st_size for f in (demo_dir / "native" / "step-30").iterdir())
    assert 0 < (plan.world_size.bytes_per_rank or 0) <= on_disk
    assert any("no CUDA generators" in w for w in plan.warnings)

    four = plan_resume(run, world_size=4)
    assert four.world_size is not None and four.world_size.ok is True and four.world_size.target == 4
    assert four.world_size.bytes_per_rank == plan.world_size.bytes_per_rank  # every rank reads it all
    assert "identical random numbers" in four.world_size.note
    doc = four.to_json()
    assert doc["world_size_ok"] is True and doc["checkpoint"]["layout"] == "native"


def test_dcp_backed_native_run_reshards(demo_dir: Path) -> None:
    one = plan_resume(str(demo_dir / "distributed"), world_size=1)
    four = plan_resume(str(demo_dir / "distributed"), world_size=4)
    assert one.world_size and four.world_size and one.world_size.saved == 2
    assert four.world_size.ok is True and "reshard" in four.world_size.note
    assert (four.world_size.bytes_per_rank or 0) < (one.world_size.bytes_per_rank or 0)
    assert "ranks 2..3 find no RNG state" in four.world_size.note


def test_broken_newest_native_step_is_skipped_and_the_hint_names_the_step(demo_dir: Path, tmp_path: Path) -> None:
    run = copy_tree(demo_dir / "native", tmp_path / "native")
    (run / "step-30" / "model.safetensors").unlink()
    # The newest step also recorded a CUDA generator that the older ones lack.
    rng = run / "step-30" / "rng.json"
    doc = json.loads(rng.read_text())
    doc["tree"]["cuda"] = []
    rng.write_text(json.dumps(doc))

    plan = plan_resume(str(run))
    assert plan.checkpoint is not None and _name(plan.checkpoint.url) == "step-20"
    (skipped,) = plan.skipped
    assert _name(skipped.url) == "step-30" and skipped.step == 30
    assert skipped.reason.startswith("fails verify: model.safetensors")
    assert plan.resume_hint == f"CheckpointManager({str(run)!r}).restore(state, step=20)"
    assert any("step-20 lacks RNG state cuda that step-30 has" in w for w in plan.warnings)


# --- torch DCP ----------------------------------------------------------------------------------------


def test_dcp_run_skips_a_save_in_progress_and_warns_about_an_overwrite(demo_dir: Path, tmp_path: Path) -> None:
    run = copy_tree(demo_dir / "dcp", tmp_path / "dcp")
    pending = run / "step-40"
    pending.mkdir()
    for data in (run / "step-30").glob("*.distcp"):
        shutil.copy2(data, pending / data.name)  # ranks wrote their data; the coordinator not yet .metadata
    plan = plan_resume(str(run), world_size=3)
    assert plan.checkpoint is not None and _name(plan.checkpoint.url) == "step-30"
    (skipped,) = plan.skipped
    assert (skipped.step, skipped.state) == (40, CheckpointState.IN_PROGRESS)
    assert skipped.reason.startswith("in progress: no .metadata")
    assert plan.resume_hint == f"dcp.load(state, checkpoint_id={str(run / 'step-30')!r})"
    assert plan.world_size is not None and plan.world_size.ok is True and plan.world_size.saved == 2
    tensor_bytes = 397_333 * 3  # model + optimizer of the demo, from its metadata
    assert plan.world_size.bytes_per_rank == pytest.approx(tensor_bytes / 3, rel=0.01)
    assert plan.restores == ("model", "optimizer")
    assert set(plan.missing) == {"scheduler", "rng", "dataloader", "trainer_state"}
    assert not plan.warnings

    # An in-place overwrite of step-30 that wrote new data but never its new .metadata.
    data = next((run / "step-30").glob("*.distcp"))
    later = (run / "step-30" / ".metadata").stat().st_mtime + 60
    os.utime(data, (later, later))
    (warning,) = plan_resume(str(run)).warnings
    assert ".metadata is older than its data files (60 s)" in warning


def test_nothing_resumable(demo_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "step-10").mkdir(parents=True)
    for data in (demo_dir / "dcp" / "step-10").glob("*.distcp"):
        shutil.copy2(data, run / "step-10" / data.name)
    plan = plan_resume(str(run))
    assert plan.checkpoint is None and not plan.resumable
    assert [s.step for s in plan.skipped] == [10]
    assert plan.to_json()["checkpoint"] is None and plan.to_json()["world_size_ok"] is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert plan_resume(str(empty)).checkpoint is None
    hf_only = plan_resume(str(demo_dir / "hf"))
    assert hf_only.checkpoint is None and "model weights only" in hf_only.skipped[0].reason


def test_folders_that_are_not_one_run(demo_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(CkptctlError, match=r"holds several runs \(dcp, distributed, native\)"):
        plan_resume(str(demo_dir))
    # --layout narrows it to the layout's runs (still two native ones here).
    with pytest.raises(CkptctlError, match=r"several runs \(distributed, native\)"):
        plan_resume(str(demo_dir), layout="native")
    assert plan_resume(str(demo_dir), layout="dcp").checkpoint is not None
    with pytest.raises(UnknownLayout):
        plan_resume(str(demo_dir), layout="nope")
    with pytest.raises(CheckpointNotFound):
        plan_resume(str(tmp_path / "missing"))
    with pytest.raises(CkptctlError, match="at least 1"):
        plan_resume(str(demo_dir / "native"), world_size=0)


# --- Hugging Face Trainer -------------------------------------------------------------------------


def test_truncated_newest_trainer_checkpoint(trainer: WrittenTrainerRun, tmp_path: Path) -> None:
    out = copy_tree(trainer.output_dir, tmp_path / "out")
    weights = out / "checkpoint-4" / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)

    plan = plan_resume(str(out), world_size=1, cuda=True)
    assert plan.checkpoint is not None and _name(plan.checkpoint.url) == "checkpoint-2"
    (skipped,) = plan.skipped
    assert _name(skipped.url) == "checkpoint-4" and "fails verify" in skipped.reason and "truncated" in skipped.reason
    assert plan.resume_hint == f"trainer.train(resume_from_checkpoint={str(out / 'checkpoint-2')!r})"
    assert plan.framework == "transformers Trainer"
    assert plan.continues_from == {"step": 2, "epoch": pytest.approx(0.25)}
    assert plan.restores == ("model", "optimizer", "scheduler", "rng", "trainer_state")
    assert plan.missing == ("dataloader",) and "skips the batches" in plan.impacts["dataloader"]
    highest = [w for w in plan.warnings if "resume_from_checkpoint=True" in w]
    assert len(highest) == 1 and "would load checkpoint-4 (fails verify" in highest[0]
    # The Trainer saves CUDA generator states wherever CUDA is available (a GPU machine), even with use_cpu.
    assert any("no CUDA generators" in w for w in plan.warnings) == (not torch.cuda.is_available())
    assert plan.world_size is not None and plan.world_size.ok is True


def test_trainer_on_more_ranks_than_rng_files(trainer: WrittenTrainerRun) -> None:
    plan = plan_resume(str(trainer.output_dir), world_size=2)
    assert plan.checkpoint is not None and _name(plan.checkpoint.url) == "checkpoint-4"
    assert not plan.skipped and not any("resume_from_checkpoint=True" in w for w in plan.warnings)
    assert plan.world_size is not None and "rng_state_{0..1}.pth" in plan.world_size.note


def test_trainer_output_folder_with_a_final_model_still_finds_its_checkpoints(
    trainer: WrittenTrainerRun, tmp_path: Path
) -> None:
    out = copy_tree(trainer.output_dir, tmp_path / "out")
    for name in ("model.safetensors", "config.json"):  # what trainer.save_model() writes at the end
        shutil.copy2(out / "checkpoint-4" / name, out / name)
    # An empty checkpoint-6 (a save that just began) is what transformers would resume from.
    (out / "checkpoint-6").mkdir()
    plan = plan_resume(str(out))
    assert plan.checkpoint is not None and _name(plan.checkpoint.url) == "checkpoint-4"
    assert any("would load checkpoint-6 (not a complete Trainer checkpoint)" in w for w in plan.warnings)


def test_interrupted_trainer_save(trainer: WrittenTrainerRun, tmp_path: Path) -> None:
    out = copy_tree(trainer.output_dir, tmp_path / "out")
    (out / "checkpoint-4" / "trainer_state.json").unlink()
    _age(out / "checkpoint-4", 3600)
    plan = plan_resume(str(out))
    assert plan.checkpoint is not None and _name(plan.checkpoint.url) == "checkpoint-2"
    assert plan.skipped[0].reason.startswith("broken: no trainer_state.json")


# --- DeepSpeed -------------------------------------------------------------------------------------


def test_deepspeed_on_its_own_world_size(zero2: WrittenDeepSpeed) -> None:
    plan = plan_resume(str(zero2.save_dir))
    assert plan.checkpoint is not None and _name(plan.checkpoint.url) == "global_step4"
    assert plan.resume_hint == f"engine.load_checkpoint({str(zero2.save_dir)!r}, tag='global_step4')"
    assert plan.continues_from["global_steps"] == 4
    assert plan.continues_from["consumed_samples"] == zero2.client_state["consumed_samples"]
    assert plan.restores == ("model", "optimizer", "scheduler", "trainer_state")
    assert "DeepSpeed saves no RNG state" in plan.impacts["rng"]
    check = plan.world_size
    assert check is not None and check.ok is True and check.saved == 2 and not check.fix
    rank_files = [p.stat().st_size for p in (zero2.latest).iterdir()]
    assert 0 < (check.bytes_per_rank or 0) < sum(rank_files)


def test_deepspeed_on_another_world_size_needs_a_universal_checkpoint(zero2: WrittenDeepSpeed) -> None:
    plan = plan_resume(str(zero2.save_dir), world_size=4)
    check = plan.world_size
    assert check is not None and check.ok is False and (check.saved, check.target) == (2, 4)
    assert "ZeRO-2" in check.note and check.bytes_per_rank is None
    tag = zero2.save_dir / "global_step4"
    assert check.fix.startswith(
        f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {tag} --output_folder {tag}_universal"
    )
    assert '"load_universal": true' in check.fix
    # the same files without DeepSpeed: ckptctl's own reshard, into a folder of their own
    assert f"ckptctl reshard {tag} NEW_DIR --to deepspeed-universal, then load_checkpoint(NEW_DIR)" in check.fix
    assert plan.resume_hint is not None and "tag='global_step4_universal'" in plan.resume_hint
    doc = plan.to_json()
    assert doc["world_size_ok"] is False and doc["world_size"]["fix"] == check.fix


def test_latest_naming_a_tag_with_missing_rank_files(zero2: WrittenDeepSpeed, tmp_path: Path) -> None:
    save_dir = copy_tree(zero2.save_dir, tmp_path / "ds")
    next((save_dir / "global_step4").glob("*zero_pp_rank_1_*optim_states.pt")).unlink()
    plan = plan_resume(str(save_dir))
    assert plan.checkpoint is not None and _name(plan.checkpoint.url) == "global_step2"
    (skipped,) = plan.skipped
    assert _name(skipped.url) == "global_step4" and "optim_states" in skipped.reason
    assert plan.resume_hint == f"engine.load_checkpoint({str(save_dir)!r}, tag='global_step2')"
    (pointer,) = [w for w in plan.warnings if "`latest` names" in w]
    assert pointer.startswith("`latest` names global_step4 (") and "load global_step2 by name" in pointer


def test_tags_newer_than_latest_are_unfinished_saves(zero2: WrittenDeepSpeed, tmp_path: Path) -> None:
    save_dir = copy_tree(zero2.save_dir, tmp_path / "ds")
    (save_dir / "latest").write_text("global_step2")
    plan = plan_resume(str(save_dir))
    assert plan.checkpoint is not None and _name(plan.checkpoint.url) == "global_step2"
    assert "newer than global_step2, which `latest` names" in plan.skipped[0].reason

    (save_dir / "latest").write_text("global_step9")  # names no tag: every load without tag= fails
    plan = plan_resume(str(save_dir))
    assert plan.checkpoint is not None and _name(plan.checkpoint.url) == "global_step4" and not plan.skipped
    assert any("names tag 'global_step9', which does not exist" in w for w in plan.warnings)


# --- OpenRLHF and open-instruct: real DeepSpeed tags arranged as the frameworks arrange them -------------


def test_openrlhf_run(zero2: WrittenDeepSpeed, hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    ckpt = arrange_openrlhf(tmp_path / "ckpt", zero2, zero2, hf_model_dirs["single"])
    plan = plan_resume(str(ckpt), world_size=2)
    # `latest` names the best tag, saved after the regular one of the same step; the critic and the HF
    # export are no candidates of their own.
    assert plan.checkpoint is not None and plan.checkpoint.url == str(ckpt / "_actor" / "best_global_step4")
    assert plan.framework == "OpenRLHF" and not plan.skipped
    assert plan.resume_hint == (
        f"--load_checkpoint --ckpt_path {ckpt}  # OpenRLHF >= 0.10.2: --ckpt.load_enable --ckpt.path {ckpt}"
    )
    assert plan.continues_from["total_consumed_prompts"] == 32
    assert plan.world_size is not None and plan.world_size.ok is True and not plan.warnings

    (ckpt / "_actor" / "latest").write_text("global_step2")
    plan = plan_resume(str(ckpt), world_size=4)
    assert plan.checkpoint is not None and plan.checkpoint.url == str(ckpt / "_actor" / "global_step2")
    assert [io.name_of(s.url) for s in plan.skipped] == ["best_global_step4", "global_step4", "global_step4_hf"]
    assert all("which `latest` names" in s.reason for s in plan.skipped[:2])
    assert "model weights only (an HF export)" in plan.skipped[2].reason
    assert any(
        "the critic resumes from best_global_step4 (step 4) and the actor from global_step2" in w for w in plan.warnings
    )
    assert plan.world_size is not None and plan.world_size.ok is False


def test_open_instruct_run(zero2: WrittenDeepSpeed, hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    state = arrange_open_instruct(tmp_path / "state", tmp_path / "out", zero2, hf_model_dirs["single"])
    plan = plan_resume(str(state))
    assert plan.checkpoint is not None and _name(plan.checkpoint.url) == "global_step4"
    assert plan.checkpoint.step == 2  # the training step, not the optimizer steps of the tag name
    assert plan.resume_hint == f"--checkpoint_state_dir {state}"
    assert {"rng", "dataloader"} <= set(plan.restores)
    assert plan.continues_from["training_step"] == 2

    # A tag that lost a file: open-instruct's start-up would delete it; the resume takes the one before.
    (state / "global_step4" / "driver_state.pt").unlink()
    plan = plan_resume(str(state))
    assert plan.checkpoint is not None and _name(plan.checkpoint.url) == "global_step2"
    assert (
        plan.resume_hint
        == f"--checkpoint_state_dir {state}  # it loads the tag `latest` names: write global_step2 into latest first"
    )
    assert any("it would delete global_step4;" in w for w in plan.warnings)
    assert any(w.startswith("`latest` names global_step4") for w in plan.warnings)
    # The HF snapshots are weights only.
    snapshots = plan_resume(str(tmp_path / "out"))
    assert snapshots.checkpoint is None


# --- profiles of the other frameworks (the layouts read them; the plan only needs the paths) ----------


def _checkpoint(url: Path, layout: str, step: int = 4, **metadata: object) -> Checkpoint:
    ref = CheckpointRef(str(url), layout, step, None, None, CheckpointState.COMPLETE, 0)
    return Checkpoint(ref, frozenset({Component.MODEL, Component.OPTIMIZER}), 2, metadata, tensor_index=tuple)


def _context(checkpoint: Checkpoint, target: int | None = None) -> PlanContext:
    return PlanContext(
        str(io.parent_of(checkpoint.url)), checkpoint, (checkpoint.ref,), (), target, layout_of=get_layout
    )


def test_every_registered_layout_has_a_profile() -> None:
    profiled = {name for name in layout_names() if type(get_layout(name)).resume_profile is not Layout.resume_profile}
    assert set(layout_names()) <= profiled
    assert {"openrlhf", "open_instruct", "areal", "roll"} <= profiled
    assert profile_for("somebody_elses").framework == "somebody_elses"


def test_openrlhf_profile(tmp_path: Path) -> None:
    actor = tmp_path / "ckpt" / "_actor" / "global_step4"
    actor.mkdir(parents=True)
    profile = profile_for("openrlhf")
    assert profile.run_of(str(actor)) == str(tmp_path / "ckpt")
    assert profile.run_of(str(tmp_path / "ckpt" / "_critic" / "global_step4")) == str(tmp_path / "ckpt")
    hint = profile.hint(_context(_checkpoint(actor, "openrlhf")))
    assert hint.startswith(
        f"--load_checkpoint --ckpt_path {tmp_path / 'ckpt'}  # OpenRLHF >= 0.10.2: --ckpt.load_enable"
    )
    assert "write global_step4 into _actor/latest first" in hint
    world = profile.world_size(_context(_checkpoint(actor, "openrlhf", zero_stage=3, dp_world_size=8), target=16))
    assert world.ok is False and "ds_to_universal" in world.fix
    # The critic is loaded along with the actor, from its own `latest`: it is no candidate of its own.
    critic = CheckpointRef(
        str(tmp_path / "ckpt" / "_critic" / "global_step2"),
        "openrlhf",
        2,
        None,
        None,
        CheckpointState.COMPLETE,
        0,
        True,
    )
    assert profile.companion(critic) and not profile.companion(_checkpoint(actor, "openrlhf").ref)
    checkpoint = _checkpoint(actor, "openrlhf")
    ctx = PlanContext(str(tmp_path / "ckpt"), checkpoint, (checkpoint.ref, critic), (), None, layout_of=get_layout)
    (note,) = profile.notes(ctx)
    assert "the critic resumes from global_step2 (step 2) and the actor from global_step4 (step 4)" in note


def test_open_instruct_startup_cleanup_warning(tmp_path: Path) -> None:
    save_dir = tmp_path / "state"
    for tag, files in (("global_step2", 4), ("global_step4", 3)):
        (save_dir / tag).mkdir(parents=True)
        for i in range(files):
            (save_dir / tag / f"f{i}").write_text("x")
    ctx = _context(_checkpoint(save_dir / "global_step4", "open_instruct"))
    (note,) = profile_for("open_instruct").notes(ctx)
    assert "would delete global_step4 (including global_step4, the one this plan resumes from)" in note
    assert profile_for("open_instruct").hint(ctx).startswith(f"--checkpoint_state_dir {save_dir}")


def test_areal_profile(tmp_path: Path) -> None:
    trial = tmp_path / "fileroot" / "checkpoints" / "me" / "gsm8k" / "trial0"
    (trial / "recover_info").mkdir(parents=True)
    (trial / "default" / "recover_checkpoint").mkdir(parents=True)
    (trial / "critic").mkdir()
    (trial / "recover_info" / "step_info.json").write_text('{"global_step": 9}')
    (trial / "default" / "recover_checkpoint" / ".metadata").write_bytes(b"x")
    ctx = _context(_checkpoint(trial / "default" / "recover_checkpoint", "areal"), target=16)
    profile = profile_for("areal")
    assert profile.hint(ctx).startswith(
        f"recover.mode=on experiment_name=gsm8k trial_name=trial0 cluster.fileroot={tmp_path / 'fileroot'}"
    )
    assert profile.world_size(ctx).ok is False
    assert "critic" in profile.extras(ctx)
    assert profile.notes(ctx) == []
    old = time.time() - 600
    os.utime(trial / "recover_info" / "step_info.json", (old, old))
    (note,) = profile.notes(ctx)
    assert "step_info.json is older than the recover checkpoint's .metadata" in note


def test_roll_runs_span_launch_folders(tmp_path: Path) -> None:
    checkpoint = tmp_path / "out" / "20250101-120000" / "checkpoint-10"
    assert profile_for("roll").run_of(str(checkpoint)) == str(tmp_path / "out")
    ctx = _context(_checkpoint(checkpoint, "roll"))
    assert profile_for("roll").hint(ctx) == f'resume_from_checkpoint: "{checkpoint}"'
    assert profile_for("roll").world_size(ctx).ok is None
