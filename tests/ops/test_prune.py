"""`prune` on real runs: what it keeps and why, how it deletes, what it never touches."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from ckptctl import io
from ckptctl.core import CheckpointManager, KeepBest, RetentionPolicy
from ckptctl.core.lock import LOCK_NAME
from ckptctl.errors import CkptctlError
from ckptctl.io import trash
from ckptctl.layouts import scan_run
from ckptctl.ops.prune import PrunePlan, load_policy_file, plan_prune, prune
from ckptctl.ops.verification import verify_checkpoint
from tests.conftest import copy_tree

NO_GRACE = timedelta(0)
LOSSES = {10: 0.9, 20: 0.3, 30: 0.5, 40: 0.6, 50: 0.7, 60: 0.8}


def write_run(root: Path, steps: list[int] | None = None, losses: dict[int, float] | None = None) -> Path:
    """A native run written by `CheckpointManager` (a tiny model, loss metrics)."""
    losses = LOSSES if losses is None else losses
    manager = CheckpointManager(root)
    model = torch.nn.Linear(8, 8)
    for step in steps or list(losses):
        manager.save(step, {"model": model, "step": step}, metrics={"loss": losses.get(step, 1.0)})
    return root


def names(plan: PrunePlan, keep: bool) -> list[str]:
    return [io.relative_to(i.url, plan.run) for i in plan.items if i.keep == keep]


def reasons(plan: PrunePlan) -> dict[str, tuple[str, ...]]:
    return {io.relative_to(i.url, plan.run): i.reasons for i in plan.items}


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path below root (links not followed) with its size and mtime."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run")


def test_native_run_keeps_the_last_and_the_best_and_deletes_the_rest(run: Path) -> None:
    policy = RetentionPolicy(keep_last=2, keep_best=(KeepBest.parse("loss"),))
    plan = plan_prune(str(run), policy, grace=NO_GRACE)
    assert names(plan, keep=True) == ["step-20", "step-50", "step-60"]
    assert names(plan, keep=False) == ["step-10", "step-30", "step-40"]
    assert reasons(plan)["step-20"] == ("best loss (min) = 0.3",)
    assert reasons(plan)["step-60"] == ("newest complete", "named by the run's latest pointer", "keep_last=2")
    assert plan.freed_bytes == sum(f.stat().st_size for s in (10, 30, 40) for f in (run / f"step-{s}").iterdir())

    report = prune(str(run), policy, grace=NO_GRACE)
    assert [io.name_of(i.url) for i in report.deleted] == ["step-10", "step-30", "step-40"]
    assert report.freed_bytes == plan.freed_bytes and not report.skipped and not report.unmet
    assert sorted(os.listdir(run)) == ["latest", "step-20", "step-50", "step-60"]  # the emptied trash goes too
    for step in (20, 50, 60):
        assert verify_checkpoint(str(run / f"step-{step}")).ok
    assert CheckpointManager(run).latest_step() == 60

    again = prune(str(run), policy, grace=NO_GRACE)
    assert not again.deleted and not again.unmet


def test_staging_folders_and_fresh_checkpoints_are_in_progress(run: Path) -> None:
    staging = run / ".step-70.staging-1a2b"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"partial")
    copy_tree(run / "step-10", run / "step-10.tmp")  # committed, but under a name that says it is not done
    plan = plan_prune(str(run), RetentionPolicy(keep_last=1))  # default grace: every checkpoint is fresh
    assert not plan.delete and not plan.unmet
    why = reasons(plan)
    assert why[".step-70.staging-1a2b"][0].startswith("in progress: being written")
    assert why["step-10"][0].startswith("modified ") and "within grace 10m" in why["step-10"][0]
    assert why["step-10.tmp"] == ("in progress (staging name 'step-10.tmp')",)
    with_no_grace = plan_prune(str(run), RetentionPolicy(keep_last=1), grace=NO_GRACE)
    assert ".step-70.staging-1a2b" in names(with_no_grace, keep=True)
    assert "step-10" in names(with_no_grace, keep=False)


def test_a_rewound_latest_pointer_is_protected_and_reported(run: Path) -> None:
    (run / "latest").write_text("step-20\n")
    plan = plan_prune(str(run), RetentionPolicy(keep_last=1), grace=NO_GRACE)
    item = next(i for i in plan.items if i.url.endswith("step-20"))
    assert item.keep and item.blocked and item.reasons == ("named by the run's latest pointer",)
    # A pointer naming a whole checkpoint is the run's own choice: a note, not a problem.
    assert plan.protected_notes == (
        "step-20 is protected (named by the run's latest pointer) although no rule keeps it",
    )
    assert plan.unmet == ()
    report = prune(str(run), RetentionPolicy(keep_last=1), grace=NO_GRACE)
    assert sorted(os.listdir(run)) == ["latest", "step-20", "step-60"]
    assert report.unmet == () and report.to_json()["notes"] == list(plan.protected_notes)


def test_pins_and_the_trainers_best_and_best_folders(run: Path) -> None:
    (run / "step-30" / "trainer_state.json").write_text("{}")  # a stale one: only the newest counts
    (run / "step-60" / "trainer_state.json").write_text(json.dumps({"best_model_checkpoint": "out/step-40"}))
    write_run(run / "_actor", [1, 2])
    os.rename(run / "_actor" / "step-1", run / "_actor" / "best_step-1")
    plan = plan_prune(str(run), RetentionPolicy(keep_last=1, pin=frozenset({10})), grace=NO_GRACE)
    why = reasons(plan)
    assert why["step-10"] == ("pinned",)
    assert why["step-40"] == ("the Trainer's best_model_checkpoint",)
    assert why["_actor/best_step-1"] == ("a best checkpoint (best* folders are kept, as OpenRLHF does)",)
    assert names(plan, keep=False) == ["step-20", "step-30", "step-50"]


def test_symlinks_are_never_followed(tmp_path: Path, run: Path) -> None:
    """A checkpoint reached through a symlink is kept ("outside the run", or a pointer to one inside); a
    link inside a deleted checkpoint is removed as a link. Its target is never touched."""
    elsewhere = write_run(tmp_path / "elsewhere", [99])
    (run / "step-99").symlink_to(elsewhere / "step-99", target_is_directory=True)
    (run / "best").symlink_to("step-30", target_is_directory=True)
    shared = tmp_path / "shared-tokenizer.json"
    shared.write_text("{}")
    (run / "step-10" / "tokenizer.json").symlink_to(shared)

    policy = RetentionPolicy(keep_last=1)
    plan = plan_prune(str(run), policy, grace=NO_GRACE)
    why = reasons(plan)
    assert why["step-99"] == (f"outside the run (symbolic link to {elsewhere / 'step-99'})",)
    assert why["best"] == (f"symbolic link to {run / 'step-30'}, never followed",)
    assert why["step-30"] == ("named by the symbolic link best",)
    assert why["step-60"][0] == "newest complete"  # the link to step-99 does not count as the run's newest
    assert next(i for i in plan.items if i.url.endswith("step-99")).size_bytes == 0

    report = prune(str(run), policy, grace=NO_GRACE)
    assert [io.name_of(i.url) for i in report.deleted] == ["step-10", "step-20", "step-40", "step-50"]
    assert (run / "step-99").is_symlink() and verify_checkpoint(str(elsewhere / "step-99")).ok
    assert (run / "best").is_symlink() and (run / "step-30").is_dir()
    assert shared.read_text() == "{}"


def test_a_live_writer_lock_marks_a_checkpoint_in_progress(run: Path) -> None:
    host = socket.gethostname()
    live = {"host": host, "pid": os.getpid(), "token": "x", "started": "2026-01-01T00:00:00+00:00"}
    (run / "step-20.lock").write_text(json.dumps(live))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run / "step-30" / "writer.lock").write_text(json.dumps({**live, "pid": int(dead.stdout)}))
    plan = plan_prune(str(run), RetentionPolicy(keep_last=1), grace=NO_GRACE)
    assert reasons(plan)["step-20"] == (f"in progress (locked by pid {os.getpid()} on {host} since {live['started']})",)
    assert "step-30" in names(plan, keep=False)


def test_a_crash_mid_deletion_leaves_trash_that_the_next_prune_empties(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(*args: object) -> None:
        raise KeyboardInterrupt  # killed right after the first checkpoint was moved into the trash

    monkeypatch.setattr(trash, "remove_entry", crash)
    with pytest.raises(KeyboardInterrupt):
        prune(str(run), RetentionPolicy(keep_last=5), grace=NO_GRACE)
    monkeypatch.undo()
    assert not (run / "step-10").exists() and not (run / LOCK_NAME).exists()
    (leftover,) = (run / ".ckptctl-trash").iterdir()
    assert leftover.name.startswith("step-10.")
    assert [io.name_of(r.url) for r in scan_run(str(run))] == [f"step-{s}" for s in (20, 30, 40, 50, 60)]

    report = prune(str(run), RetentionPolicy(keep_last=5), grace=NO_GRACE)
    assert report.trash_freed_bytes > 0 and not report.deleted
    assert not (run / ".ckptctl-trash").exists()


def test_demo_runs(demo_dir: Path, tmp_path: Path) -> None:
    demo = copy_tree(demo_dir, tmp_path / "demo")
    policy = RetentionPolicy(keep_last=1)
    plan = plan_prune(str(demo), policy, grace=NO_GRACE)
    assert names(plan, keep=True) == ["hf", "dcp/step-30", "distributed/step-30", "native/step-30"]
    assert reasons(plan)["hf"] == ("no step (cannot be ordered)",)
    report = prune(str(demo), policy, grace=NO_GRACE)
    assert len(report.deleted) == 6 and report.freed_bytes == plan.freed_bytes
    for kept in ("hf", "dcp/step-30", "distributed/step-30", "native/step-30"):
        assert verify_checkpoint(str(demo / kept)).ok, kept
    assert sorted(p.name for p in (demo / "dcp").iterdir()) == ["step-30"]


def test_policy_file(run: Path) -> None:
    assert load_policy_file(str(run)) is None
    (run / "ckptctl.toml").write_text('[retention]\nkeep_last = 2\nkeep_best = "loss"\npin = [10]\ngrace = "1h"\n')
    policy, grace = load_policy_file(str(run)) or (None, None)
    assert policy == RetentionPolicy(keep_last=2, keep_best=(KeepBest("loss", "min"),), pin=frozenset({10}))
    assert grace == timedelta(hours=1)
    for text in (
        "keep_last = 2\n",
        "[retention]\nkeep_lsat = 2\n",
        "[retention\n",
        '[retention]\nmax_total_size = "lots"\n',
    ):
        (run / "ckptctl.toml").write_text(text)
        with pytest.raises(CkptctlError):
            load_policy_file(str(run))


@pytest.fixture
def memory_run(run: Path) -> Iterator[str]:
    import fsspec

    fs = fsspec.filesystem("memory")
    root = "/prune-test-run"
    for path in run.rglob("*"):
        if path.is_file():
            fs.pipe_file(f"{root}/{path.relative_to(run)}", path.read_bytes())
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


def test_object_stores_delete_completion_markers_first(memory_run: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    delete_file, delete_tree = io.delete_file, io.delete_tree
    monkeypatch.setattr(io, "delete_file", lambda url: (calls.append(("file", url)), delete_file(url))[1])
    monkeypatch.setattr(io, "delete_tree", lambda url: (calls.append(("tree", url)), delete_tree(url))[1])
    report = prune(memory_run, RetentionPolicy(keep_last=4), grace=NO_GRACE)
    assert [io.name_of(i.url) for i in report.deleted] == ["step-10", "step-20"]
    step_calls = [c for c in calls if "step-" in c[1]]
    assert step_calls == [
        ("file", f"{memory_run}/step-10/ckptctl-manifest.json"),
        ("tree", f"{memory_run}/step-10"),
        ("file", f"{memory_run}/step-20/ckptctl-manifest.json"),
        ("tree", f"{memory_run}/step-20"),
    ]
    assert [io.name_of(r.url) for r in scan_run(memory_run)] == ["step-30", "step-40", "step-50", "step-60"]
    assert not io.exists(f"{memory_run}/{LOCK_NAME}")


def test_hf_trainer_run(tmp_path: Path) -> None:
    from ckptctl.layouts import layout_names

    if "hf_trainer" not in layout_names():
        pytest.skip("the hf_trainer layout is not registered")
    from safetensors.torch import save_file

    out = tmp_path / "out"
    evals = {100: 0.8, 200: 0.4, 300: 0.6, 400: 0.7}
    for step in evals:
        folder = out / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        save_file({"w": torch.zeros(4)}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text('{"model_type": "llama"}')
        torch.save({}, folder / "training_args.bin")  # Trainer._save writes it with every checkpoint
        history = [{"step": s, "loss": 1.0, "epoch": s / 400} for s in evals if s <= step]
        history += [{"step": s, "eval_loss": evals[s]} for s in evals if s <= step]
        best = f"{out}/checkpoint-{100 if step == 100 else 200}"
        state = {"global_step": step, "epoch": step / 400, "log_history": history, "best_model_checkpoint": best}
        (folder / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    plan = plan_prune(str(out), RetentionPolicy(keep_last=1, keep_best=(KeepBest.parse("eval_loss"),)), grace=NO_GRACE)
    assert {i.ref.layout for i in plan.items} == {"hf_trainer"}
    why = reasons(plan)
    assert why["checkpoint-200"] == ("the Trainer's best_model_checkpoint", "best eval_loss (min) = 0.4")
    assert names(plan, keep=False) == ["checkpoint-100", "checkpoint-300"]


def test_deepspeed_latest_is_protected(tmp_path: Path) -> None:
    from ckptctl.layouts import layout_names

    if "deepspeed" not in layout_names():
        pytest.skip("the deepspeed layout is not registered")
    save = tmp_path / "ds"
    for step in (10, 20, 30):
        tag = save / f"global_step{step}"
        tag.mkdir(parents=True)
        for rank in (0, 1):
            (tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"m" * 10)
            (tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"o" * 100)
    (save / "latest").write_text("global_step20")
    (save / "zero_to_fp32.py").write_text("")
    plan = plan_prune(str(save), RetentionPolicy(keep_last=1), grace=NO_GRACE)
    assert {i.ref.layout for i in plan.items} == {"deepspeed"}
    assert reasons(plan)["global_step20"] == ("named by the run's latest pointer",)
    report = prune(str(save), RetentionPolicy(keep_last=1), grace=NO_GRACE)
    assert [io.name_of(i.url) for i in report.deleted] == ["global_step10"] and report.freed_bytes == 220
    assert sorted(p.name for p in save.iterdir()) == [
        "global_step20",
        "global_step30",
        "latest",
        "zero_to_fp32.py",
    ]


def test_object_stores_delete_each_layouts_markers_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Trainer checkpoint on an object store loses `trainer_state.json` (written last) and its weights file,
    the markers its layout names, before anything else, so that an interrupted deletion never lists as
    complete."""
    import fsspec
    from safetensors.torch import save_file

    out = tmp_path / "out"
    for step in (100, 200):
        folder = out / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        save_file({"w": torch.zeros(4)}, str(folder / "model.safetensors"))
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"):  # what the Trainer writes
            (folder / name).write_bytes(b"o" * 64)
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    fs = fsspec.filesystem("memory")
    root = "/prune-trainer-run"
    for path in out.rglob("*"):
        if path.is_file():
            fs.pipe_file(f"{root}/{path.relative_to(out)}", path.read_bytes())
    run = f"memory://{root}"
    calls: list[tuple[str, str]] = []
    delete_file, delete_tree = io.delete_file, io.delete_tree
    monkeypatch.setattr(io, "delete_file", lambda url: (calls.append(("file", url)), delete_file(url))[1])
    monkeypatch.setattr(io, "delete_tree", lambda url: (calls.append(("tree", url)), delete_tree(url))[1])
    try:
        report = prune(run, RetentionPolicy(keep_last=1), grace=NO_GRACE)
        assert [(i.ref.layout, io.name_of(i.url)) for i in report.deleted] == [("hf_trainer", "checkpoint-100")]
        assert [c for c in calls if "checkpoint-" in c[1]] == [
            ("file", f"{run}/checkpoint-100/trainer_state.json"),
            ("file", f"{run}/checkpoint-100/model.safetensors"),
            ("tree", f"{run}/checkpoint-100"),
        ]
        assert [io.name_of(r.url) for r in scan_run(run)] == ["checkpoint-200"]
    finally:
        fs.rm(root, recursive=True)
