"""`slim` on real runs: what is dropped, what stays (convert of a slim checkpoint writes the same bytes), what
is never slimmed, and what a kill at any moment leaves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from ckptctl import CheckpointManager
from ckptctl.checkpoint import CheckpointState
from ckptctl.core.retention import RetentionPolicy
from ckptctl.errors import CkptctlError, UnsafePath
from ckptctl.families.zero_tag.kept_masters import KEPT_MASTERS
from ckptctl.formats.slim_marker import SLIM_MARKER, read_slim_marker
from ckptctl.io.trash import TRASH_NAME
from ckptctl.layouts import detect, open_checkpoint, scan_run
from ckptctl.layouts.slimming import slim_checkpoint
from ckptctl.ops.convert import ConvertOptions, convert
from ckptctl.ops.prune import prune
from ckptctl.ops.resume_plan import plan_resume
from ckptctl.ops.slim import KILL_AT_ENV, RESUME_TARGET, plan_slim, slim
from ckptctl.ops.verification import VerifyOptions, verify_checkpoint, verify_path
from tests.conftest import copy_tree
from tests.ops.test_prune import tree
from tests.writers.accelerate_writer import WrittenAccelerate
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.openrlhf_writer import WrittenOpenRlhf
from tests.writers.trainer_writer import WrittenTrainerRun
from tests.writers.verl_writer import WrittenVerl

NO_GRACE = timedelta(0)
REPO = Path(__file__).resolve().parents[2]


def write_adamw_run(root: Path, steps: tuple[int, ...] = (10, 20, 30)) -> Path:
    """A native run of a model trained with fp32 AdamW and a scheduler, by `CheckpointManager`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)
    manager = CheckpointManager(root)
    for step in steps:
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        manager.save(
            step, {"model": model, "optimizer": optimizer, "scheduler": scheduler}, metrics={"loss": loss.item()}
        )
    return root


@pytest.fixture(scope="module")
def adamw_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_adamw_run(tmp_path_factory.mktemp("native") / "run")


def states(run: Path) -> dict[str, CheckpointState]:
    return {Path(r.url).name: r.state for r in scan_run(str(run))}


def converted(src: Path, dst: Path, options: ConvertOptions | None = None) -> dict[str, bytes]:
    """The files `convert --to hf` writes for `src`, by name (the digests' time of writing left out)."""
    convert(str(src), str(dst), options)
    files = {p.name: p.read_bytes() for p in dst.iterdir()}
    if "ckptctl-digests.json" in files:
        doc = json.loads(files["ckptctl-digests.json"])
        doc.pop("created", None)
        files["ckptctl-digests.json"] = json.dumps(doc, sort_keys=True).encode()
    return files


def test_native_run_slims_all_but_the_resume_target_and_converts_the_same(adamw_run: Path, tmp_path: Path) -> None:
    run = copy_tree(adamw_run, tmp_path / "run")
    plan = plan_slim(str(run), grace=NO_GRACE)
    assert [(Path(i.url).name, i.slim) for i in plan.items] == [
        ("step-10", True),
        ("step-20", True),
        ("step-30", False),
    ]
    assert plan.items[2].reasons[0] == RESUME_TARGET
    assert (
        plan.items[0].dropped == ("optimizer", "rng", "scheduler")
        and "optimizer.safetensors" in plan.items[0].drop_files
    )

    report = slim(str(run), grace=NO_GRACE)
    assert [Path(i.url).name for i in report.slimmed] == ["step-10", "step-20"] and not report.skipped
    assert states(run) == {"step-10": CheckpointState.SLIM, "step-20": CheckpointState.SLIM, "step-30": "complete"}
    for name in ("step-10", "step-20"):
        before = sum(f.stat().st_size for f in (adamw_run / name).iterdir())
        after = sum(f.stat().st_size for f in (run / name).iterdir())
        item = next(i for i in report.slimmed if i.url.endswith(name))
        assert item.freed_bytes == before - after > 0.6 * before  # fp32 AdamW: two moments per weight
        assert not (run / name / "optimizer.safetensors").exists() and (run / name / "model.safetensors").exists()
        marker = read_slim_marker(str(run / name))
        assert marker is not None and set(marker.dropped_files) == set(item.drop_files)
        assert converted(run / name, tmp_path / f"{name}-slim") == converted(
            adamw_run / name, tmp_path / f"{name}-full"
        )
        assert verify_checkpoint(str(run / name)).ok
    assert not (run / TRASH_NAME).exists()
    # A resume never picks a slim checkpoint, and says why.
    (run / "step-30" / "model.safetensors").write_bytes(b"torn")
    resume = plan_resume(str(run))
    assert resume.checkpoint is None
    assert [s.reason for s in resume.skipped[1:]] == ["slim: training-only state dropped"] * 2


def test_slim_of_a_slim_run_changes_nothing_and_prune_treats_slim_like_complete(
    adamw_run: Path, tmp_path: Path
) -> None:
    run = copy_tree(adamw_run, tmp_path / "run")
    slim(str(run), grace=NO_GRACE)
    before = tree(run)
    again = slim(str(run), grace=NO_GRACE)
    assert not again.slimmed and [i.reasons[0] for i in again.plan.keep][:2] == ["already slim"] * 2
    assert tree(run) == before
    kept = prune(str(run), RetentionPolicy(keep_last=3), grace=NO_GRACE)
    assert not kept.deleted  # slim checkpoints count for keep_last like complete ones, not as broken
    pruned = prune(str(run), RetentionPolicy(keep_last=1), grace=NO_GRACE)
    assert [Path(i.url).name for i in pruned.deleted] == ["step-10", "step-20"]


def test_dry_run_changes_nothing(adamw_run: Path, tmp_path: Path) -> None:
    run = copy_tree(adamw_run, tmp_path / "run")
    before = tree(run)
    report = slim(str(run), grace=NO_GRACE, dry_run=True)
    assert report.dry_run and len(report.slimmed) == 2 and report.freed_bytes > 0
    assert tree(run) == before


def test_keep_full_and_older_than_and_one_checkpoint(adamw_run: Path, tmp_path: Path) -> None:
    run = copy_tree(adamw_run, tmp_path / "run")
    assert [Path(i.url).name for i in plan_slim(str(run), keep_full=2, grace=NO_GRACE).slim] == ["step-10"]
    assert not plan_slim(str(run), older_than=timedelta(days=3650), grace=NO_GRACE).slim
    one = slim(str(run / "step-20"), grace=NO_GRACE)
    assert [Path(i.url).name for i in one.slimmed] == ["step-20"] and one.plan.run == str(run)
    assert states(run)["step-10"] is CheckpointState.COMPLETE
    resumed = slim(str(run / "step-30"), grace=NO_GRACE)
    assert not resumed.slimmed and resumed.plan.items[0].reasons[0] == RESUME_TARGET


def test_trainer_checkpoint_drops_optimizer_scheduler_rng_and_converts_the_same(
    trainer_run: WrittenTrainerRun, tmp_path: Path
) -> None:
    run = copy_tree(trainer_run.output_dir, tmp_path / "out")
    report = slim(str(run), grace=NO_GRACE)
    assert [Path(i.url).name for i in report.slimmed] == ["checkpoint-2"]
    assert report.slimmed[0].drop_files == ("optimizer.pt", "rng_state.pth", "scheduler.pt")
    slimmed = run / "checkpoint-2"
    assert sorted(p.name for p in slimmed.iterdir()) == sorted(
        {p.name for p in trainer_run.checkpoints[0].iterdir()} - {"optimizer.pt", "rng_state.pth", "scheduler.pt"}
        | {SLIM_MARKER}
    )
    assert states(run)["checkpoint-2"] is CheckpointState.SLIM
    assert verify_path(str(run)).ok
    original = converted(trainer_run.checkpoints[0], tmp_path / "full")
    assert converted(slimmed, tmp_path / "slim") == original and "model.safetensors" in original


def test_the_checkpoint_a_resume_loads_is_never_slimmed(trainer_run: WrittenTrainerRun, tmp_path: Path) -> None:
    run = copy_tree(trainer_run.output_dir, tmp_path / "out")
    (run / "checkpoint-4" / "model.safetensors").write_bytes(b"torn")  # the newest fails verify
    assert plan_resume(str(run)).checkpoint is not None
    assert Path(plan_resume(str(run)).checkpoint.url).name == "checkpoint-2"  # type: ignore[union-attr]
    report = slim(str(run), grace=NO_GRACE)
    assert not report.slimmed
    assert [(Path(i.url).name, i.reasons[0]) for i in report.plan.items] == [
        ("checkpoint-2", RESUME_TARGET),
        ("checkpoint-4", "newest complete"),
    ]


def test_verify_checks_the_kept_model_of_a_slim_checkpoint(adamw_run: Path, tmp_path: Path) -> None:
    run = copy_tree(adamw_run, tmp_path / "run")
    slim(str(run / "step-10"), grace=NO_GRACE)
    model = run / "step-10" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-8])
    result = verify_checkpoint(str(run / "step-10"))
    assert not result.ok and any(p.path == "model.safetensors" for p in result.problems)


def test_unknown_layout_and_unslimmable_layouts_are_kept_with_the_reason(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (1, 2, 3):
        folder = run / f"step_{step}"
        folder.mkdir(parents=True)
        torch.save({"weights": torch.zeros(4)}, folder / "state.pt")
    before = tree(run)
    report = slim(str(run), grace=NO_GRACE)
    assert not report.slimmed and report.plan.items
    assert all(i.ref.state is CheckpointState.UNKNOWN for i in report.plan.items)
    assert all("unknown layout" in i.reasons[0] for i in report.plan.items[:2])
    assert tree(run) == before


def test_a_link_where_the_slim_version_is_built_is_refused(adamw_run: Path, tmp_path: Path) -> None:
    run = copy_tree(adamw_run, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / TRASH_NAME).symlink_to(elsewhere)
    before = tree(run)
    with pytest.raises(UnsafePath):
        slim(str(run), grace=NO_GRACE)
    assert tree(run) == before and not any(elsewhere.iterdir())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:took over a stale lock")  # the killed slim's
@pytest.mark.parametrize("point", ["staged", "marked", "installed"])
def test_a_kill_leaves_the_whole_original_or_the_whole_slim_checkpoint(
    adamw_run: Path, tmp_path: Path, point: str
) -> None:
    run = copy_tree(adamw_run, tmp_path / "run")
    env = {**os.environ, KILL_AT_ENV: point, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "ckptctl", "slim", str(run / "step-10"), "-y", "--grace", "0"]
    killed = subprocess.run(args, env=env, capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    expected = CheckpointState.SLIM if point == "installed" else CheckpointState.COMPLETE
    assert states(run) == {"step-10": expected, "step-20": "complete", "step-30": "complete"}
    assert verify_path(str(run)).ok
    assert (run / "step-10" / "optimizer.safetensors").exists() is (point != "installed")
    # What the kill left in the trash is out of sight, and the next slim finishes the job and empties it.
    done = slim(str(run), grace=NO_GRACE)
    assert states(run) == {"step-10": "slim", "step-20": "slim", "step-30": "complete"}
    assert not done.skipped
    prune(str(run), RetentionPolicy(keep_last=3), grace=NO_GRACE)
    assert not (run / TRASH_NAME).exists()


def _slim_and_compare(run: Path, original: Path, tmp_path: Path, expected: list[str]) -> None:
    """Slim `run` (a copy of `original`); the checkpoints slimmed are `expected` (relative paths), each is
    `slim`, verifies, and converts to the same files as its original."""
    report = slim(str(run), grace=NO_GRACE)
    assert [os.path.relpath(i.url, run) for i in report.slimmed] == expected and not report.skipped
    assert all(i.freed_bytes > 0 for i in report.slimmed)
    assert verify_path(str(run), VerifyOptions(deep=True)).ok  # every kept tensor read back
    listed = {os.path.relpath(r.url, run): r.state for r in scan_run(str(run))}
    for rel in expected:
        assert listed[rel] is CheckpointState.SLIM
        assert converted(run / rel, tmp_path / f"{rel}-slim") == converted(original / rel, tmp_path / f"{rel}-full")


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_tag_keeps_its_fp32_masters_as_a_model_file_and_converts_the_same(
    deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path: Path, stage: int
) -> None:
    original = deepspeed_runs[stage].save_dir
    run = copy_tree(original, tmp_path / "run")
    _slim_and_compare(run, original, tmp_path, ["global_step2"])
    tag = run / "global_step2"
    assert not list(tag.glob("*optim_states.pt")) and list(tag.glob("*model_states.pt"))
    assert (tag / KEPT_MASTERS).exists()
    assert Path(plan_resume(str(run)).checkpoint.url).name == "global_step4"  # type: ignore[union-attr]
    assert open_checkpoint(str(tag)).ref.state is CheckpointState.SLIM  # what inspect shows


def test_zero_0_keeps_its_optimizer_inside_the_model_states_and_is_kept(
    deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path: Path
) -> None:
    run = copy_tree(deepspeed_runs[0].save_dir, tmp_path / "run")
    before = tree(run)
    report = slim(str(run), grace=NO_GRACE)
    assert not report.slimmed
    assert "keeps the optimizer inside the model-states file" in report.plan.items[0].reasons[0]
    assert tree(run) == before


def test_openrlhf_actor_and_critic_tags_slim_and_best_stays(openrlhf_ppo: WrittenOpenRlhf, tmp_path: Path) -> None:
    original = openrlhf_ppo.ckpt_path
    # The critic's config lies beside the actor's output folder: copy both, so convert finds it in each.
    top = openrlhf_ppo.output_dir.parent
    run = copy_tree(top, tmp_path / "top") / original.relative_to(top)
    _slim_and_compare(run, original, tmp_path, ["_actor/global_step2", "_critic/global_step2"])
    reasons = {os.path.relpath(i.url, run): i.reasons for i in slim(str(run), grace=NO_GRACE).plan.keep}
    assert reasons["_actor/best_global_step2"][0].startswith("a best checkpoint")


def test_verl_step_drops_optimizer_extra_state_and_dataloader(verl_run: WrittenVerl, tmp_path: Path) -> None:
    run = copy_tree(verl_run.run, tmp_path / "run")
    first = f"global_step_{verl_run.steps[0]}"
    _slim_and_compare(run, verl_run.run, tmp_path, [first])
    left = sorted(p.name for p in (run / first / "actor").iterdir())
    assert not [n for n in left if n.startswith(("optim_", "extra_state_"))] and not (run / first / "data.pt").exists()
    assert [n for n in left if n.startswith("model_world_size_")]


def test_the_manager_keeps_older_steps_slim_with_keep_full_last(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(tmp_path / "run", policy=RetentionPolicy(keep_last=3, keep_full_last=1))
    for step in (1, 2, 3, 4):
        model(torch.randn(2, 16)).sum().backward()
        optimizer.step()
        manager.save(step, {"model": model, "optimizer": optimizer})
    manager.wait()
    assert states(tmp_path / "run") == {"step-2": "slim", "step-3": "slim", "step-4": "complete"}
    assert manager.latest_step() == 4
    (tmp_path / "run" / "step-4" / "model.safetensors").write_bytes(b"torn")
    assert manager.latest_step() is None  # slim steps are never resumed from
    with pytest.raises(CkptctlError, match="slim"):
        manager.restore({"model": model}, step=2)
    assert verify_path(str(tmp_path / "run" / "step-2")).ok


def test_accelerate_saves_drop_optimizer_and_scheduler_and_convert_the_same(
    accelerate_runs: WrittenAccelerate, tmp_path: Path
) -> None:
    plain = accelerate_runs.plain
    run = copy_tree(plain, tmp_path / "plain")
    _slim_and_compare(run, plain, tmp_path, ["checkpoints/checkpoint_0", "checkpoints/checkpoint_1"])
    assert (run / "checkpoints/checkpoint_0/random_states_0.pkl").exists()  # what marks the save finished
    # The DeepSpeed plugin's tag: its partitions go and its masters stay as a model file. (Both of that run's
    # saves are protected: one slimmed directly, as the manager's retention does.)
    ds = copy_tree(accelerate_runs.deepspeed, tmp_path / "ds")
    _, ref = detect(str(ds / "checkpoints/checkpoint_1"))
    assert slim_checkpoint(ref) > 0
    tag = ds / "checkpoints/checkpoint_1/pytorch_model"
    assert (tag / KEPT_MASTERS).exists() and not list(tag.glob("*optim_states.pt"))
    assert verify_path(str(ds), VerifyOptions(deep=True)).ok
    rel = "checkpoints/checkpoint_1"
    assert converted(ds / rel, tmp_path / "ds-slim") == converted(accelerate_runs.deepspeed / rel, tmp_path / "ds-full")
