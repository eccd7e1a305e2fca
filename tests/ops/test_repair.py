"""`repair` on the suite's real runs with their newest save torn: each framework's own resume code picks the
repaired step afterwards, quarantined checkpoints come back byte for byte, and bad input changes nothing."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from ckptctl.core.lock import RunLock, RunLocked
from ckptctl.errors import CkptctlError, UnknownLayout, UnsafePath
from ckptctl.io import trash
from ckptctl.ops.repair import POINTER, QUARANTINE, RunBusy, plan_repair, plan_undo, repair
from tests.conftest import copy_tree
from tests.writers.areal_writer import WrittenAreal
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.lightning_writer import WrittenLightning
from tests.writers.megatron_writer import WrittenMegatron
from tests.writers.rl_runs import arrange_open_instruct, arrange_openrlhf
from tests.writers.stand_ins import StandIns
from tests.writers.torchtitan_writer import _STOOD_IN as TORCHTITAN_STOOD_IN
from tests.writers.torchtitan_writer import WrittenTorchtitan
from tests.writers.torchtitan_writer import _stand_in as torchtitan_stand_in
from tests.writers.trainer_writer import WrittenTrainerRun
from tests.writers.verl_writer import WrittenVerl


def _tree_digest(root: Path) -> dict[str, str]:
    """Every file below `root` (links as their target) -> its sha256: what "byte-identical" compares."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = "link:" + os.readlink(path)
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _age(path: Path, seconds: float = 3600) -> None:
    """Make every file below `path` look `seconds` old: a torn save that stopped, not one still being written."""
    when = time.time() - seconds
    for item in [path, *path.rglob("*")]:
        os.utime(item, (when, when))


def _unchanged(run: Path, before: dict[str, str]) -> None:
    assert _tree_digest(run) == before


@pytest.fixture
def zero2(deepspeed_runs: dict[int, WrittenDeepSpeed]) -> WrittenDeepSpeed:
    return deepspeed_runs[2]


# --- pointers ------------------------------------------------------------------------------------


def test_native_latest_is_rewritten_and_the_manager_follows_it(demo_dir: Path, tmp_path: Path) -> None:
    from ckptctl.core.manager import CheckpointManager

    run = copy_tree(demo_dir / "native", tmp_path / "native")
    (run / "step-30" / "model.safetensors").unlink()
    before = _tree_digest(run)
    plan = plan_repair(str(run))
    assert plan.needed and plan.target is not None and plan.target.step == 20
    (action,) = plan.actions
    assert (action.kind, action.path, action.before, action.after) == (
        POINTER,
        str(run / "latest"),
        "step-30\n",
        "step-20\n",
    )
    doc = plan.to_json()
    assert doc["dry_run"] is True and doc["needed"] is True and doc["target"]["step"] == 20
    _unchanged(run, before)  # planning changes nothing

    done = repair(str(run))
    assert not done.dry_run and (run / "latest").read_text() == "step-20\n"
    manager = CheckpointManager(str(run))
    assert manager.pointer() == "step-20" and manager.latest_step() == 20
    again = plan_repair(str(run))
    assert not again.needed and not again.actions


def test_deepspeed_latest_is_rewritten_and_deepspeed_loads_the_tag_it_names(
    zero2: WrittenDeepSpeed, tmp_path: Path
) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    save_dir = copy_tree(zero2.save_dir, tmp_path / "ds")
    next((save_dir / "global_step4").glob("*zero_pp_rank_1_*optim_states.pt")).unlink()
    with pytest.raises(Exception):  # DeepSpeed follows `latest` into the torn tag
        get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag=None)
    plan = repair(str(save_dir))
    (action,) = plan.actions
    assert (action.before, action.after) == ("global_step4", "global_step2")
    assert (save_dir / "latest").read_text() == "global_step2"
    # DeepSpeed's own reader of `latest` (what `load_checkpoint(dir, tag=None)` reads) now loads global_step2.
    state = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag=None)
    assert state and not plan_repair(str(save_dir)).needed


def test_openrlhf_rewrites_both_roles_to_a_step_whose_actor_and_critic_verify(
    zero2: WrittenDeepSpeed, hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    ckpt = arrange_openrlhf(tmp_path / "ckpt", zero2, zero2, hf_model_dirs["single"])
    # The critic's best tag is torn: the actor's best_global_step4 verifies, but the step does not.
    next((ckpt / "_critic" / "best_global_step4").glob("*zero_pp_rank_0_*optim_states.pt")).unlink()
    plan = plan_repair(str(ckpt))
    assert plan.target is not None and plan.target.url == str(ckpt / "_actor" / "global_step4")
    assert any("_critic/best_global_step4 fails verify" in s.reason for s in plan.skipped)
    assert [(a.path, a.before, a.after) for a in plan.actions] == [
        (str(ckpt / "_actor" / "latest"), "best_global_step4", "global_step4"),
        (str(ckpt / "_critic" / "latest"), "best_global_step4", "global_step4"),
    ]
    repair(str(ckpt))
    assert (ckpt / "_actor" / "latest").read_text() == (ckpt / "_critic" / "latest").read_text() == "global_step4"


def _verl_find_latest_ckpt_path() -> Callable[[str], str | None]:
    """verl's own `find_latest_ckpt_path` and `get_checkpoint_tracker_filename`, their source taken from the
    installed verl/utils/checkpoint/checkpoint_manager.py and run as they are: importing the module imports
    verl's trainer stack (ray, omegaconf, transformers: seconds), which these two functions never use."""
    import ast
    import importlib.util

    import torch

    spec = importlib.util.find_spec("verl")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).parent / "utils" / "checkpoint" / "checkpoint_manager.py"
    tree = ast.parse(source.read_text())
    wanted = {"find_latest_ckpt_path", "get_checkpoint_tracker_filename"}
    module = ast.Module([n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted], [])
    assert len(module.body) == 2
    namespace: dict[str, Any] = {"os": os, "torch": torch}
    exec(compile(module, str(source), "exec"), namespace)
    return cast(Callable[[str], "str | None"], namespace["find_latest_ckpt_path"])


def test_open_instruct_latest_is_rewritten(
    zero2: WrittenDeepSpeed, hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = arrange_open_instruct(tmp_path / "state", tmp_path / "out", zero2, hf_model_dirs["single"])
    (state / "global_step4" / "driver_state.pt").unlink()
    _age(state / "global_step4")
    (action,) = repair(str(state)).actions
    assert (action.before, action.after) == ("global_step4", "global_step2")
    # `--checkpoint_state_dir` loads through DeepSpeed's `latest`: its reader now opens global_step2.
    assert get_fp32_state_dict_from_zero_checkpoint(str(state), tag=None)


def test_verl_tracker_is_rewritten_and_verl_finds_the_step(verl_run: WrittenVerl, tmp_path: Path) -> None:
    find_latest_ckpt_path = _verl_find_latest_ckpt_path()

    run = copy_tree(verl_run.run, tmp_path / "verl")
    newest, older = (f"global_step_{s}" for s in sorted(verl_run.steps, reverse=True)[:2])
    assert find_latest_ckpt_path(str(run)) == str(run / newest)
    # Only the critic of the newest step is torn: the step as a whole is not resumable.
    role = run / newest / "critic" if (run / newest / "critic").is_dir() else run / newest / "actor"
    next(role.glob("optim_world_size_*_rank_1.pt")).unlink()
    _age(run / newest)
    plan = repair(str(run))
    (action,) = plan.actions
    assert action.kind == POINTER and action.after == older.removeprefix("global_step_")
    assert find_latest_ckpt_path(str(run)) == str(run / older)


def test_megatron_tracker_is_rewritten(megatron_runs: WrittenMegatron, tmp_path: Path) -> None:
    save = copy_tree(megatron_runs.save, tmp_path / "megatron")
    newest = save / f"iter_{max(megatron_runs.iterations):07d}"
    next(newest.glob("*.distcp")).unlink()
    plan = repair(str(save))
    (action,) = plan.actions
    older = sorted(megatron_runs.iterations)[-2]
    assert (action.before or "").strip() == str(max(megatron_runs.iterations)) and action.after == str(older)
    # Megatron-LM's `read_metadata` (megatron/training/checkpointing.py): int(tracker) or 'release', then
    # `get_checkpoint_name` joins iter_{:07d}; megatron-core alone does not ship it, so parse it as it does.
    iteration = int((save / "latest_checkpointed_iteration.txt").read_text().strip())
    assert (save / f"iter_{iteration:07d}").is_dir() and iteration == older


def _truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)


def test_lightning_last_link_is_pointed_at_the_good_file(lightning_run: WrittenLightning, tmp_path: Path) -> None:
    linked = copy_tree(lightning_run.linked, tmp_path / "linked")
    newest = os.readlink(linked / "last.ckpt")
    _truncate(linked / newest)
    _age(linked)
    plan = repair(str(linked))
    (action,) = plan.actions
    assert action.to_json() == {
        "kind": "pointer",
        "path": str(linked / "last.ckpt"),
        "before": newest,
        "after": "epoch=0-step=2.ckpt",
        "link": True,
    }
    assert (linked / "last.ckpt").is_symlink() and os.readlink(linked / "last.ckpt") == "epoch=0-step=2.ckpt"
    # `ckpt_path="last"` opens last.ckpt through the OS: it now reads the step-2 file's bytes.
    assert (linked / "last.ckpt").read_bytes() == (lightning_run.linked / "epoch=0-step=2.ckpt").read_bytes()


def test_lightning_last_copy_is_reported_not_changed(lightning_run: WrittenLightning, tmp_path: Path) -> None:
    folder = copy_tree(lightning_run.checkpoints, tmp_path / "checkpoints")
    for name in ("epoch=0-step=4.ckpt", "last.ckpt"):
        _truncate(folder / name)
    _age(folder)
    before = _tree_digest(folder)
    plan = plan_repair(str(folder))
    assert plan.needed and plan.target is not None and plan.target.step == 2 and not plan.actions
    assert plan.refusal is not None and plan.notes == (plan.refusal,)
    assert "is a copy (save_last=True)" in plan.refusal and "ckpt_path=" in plan.refusal
    repair(str(folder))
    _unchanged(folder, before)


# --- quarantine ----------------------------------------------------------------------------------


def test_trainer_torn_checkpoint_is_quarantined_and_undo_brings_it_back(
    trainer_run: WrittenTrainerRun, tmp_path: Path
) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    out = copy_tree(trainer_run.output_dir, tmp_path / "out")
    weights = out / "checkpoint-4" / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    torn = _tree_digest(out / "checkpoint-4")
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-4")
    plan = plan_repair(str(out))
    (action,) = plan.actions
    assert action.kind == QUARANTINE and action.path == str(out / "checkpoint-4")

    done = repair(str(out))
    box = out / trash.TRASH_NAME / trash.QUARANTINE_NAME
    assert done.actions[0].after == str(box / "checkpoint-4")
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    record = json.loads((box / "checkpoint-4.origin.json").read_text())
    assert record["origin"] == "checkpoint-4" and record["resume_target"] == str(out / "checkpoint-2")

    # Neither trash clean-up nor prune empties the quarantine.
    assert trash.empty(str(out / trash.TRASH_NAME)) == 0 and _tree_digest(box / "checkpoint-4") == torn

    undo = plan_undo(str(out))
    assert [a.after for a in undo.actions] == [str(out / "checkpoint-4")]
    repair(str(out), undo=True)
    assert _tree_digest(out / "checkpoint-4") == torn and not (box / "checkpoint-4.origin.json").exists()
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-4")


def test_torchtitan_newer_steps_are_quarantined(torchtitan_run: WrittenTorchtitan, tmp_path: Path) -> None:
    with StandIns("torchtitan", TORCHTITAN_STOOD_IN, torchtitan_stand_in).serving():
        from torchtitan.components.checkpointer.dcp import CheckpointManager

    folder = copy_tree(torchtitan_run.dump_folder, tmp_path / "dump") / "checkpoint"
    steps = sorted(int(p.name.removeprefix("step-")) for p in folder.glob("step-*"))

    def find_load_step() -> int:
        # torchtitan's own step selection; it reads nothing of the manager but the folder it is given.
        return CheckpointManager._find_load_step(None, str(folder))  # type: ignore[arg-type]

    assert find_load_step() == steps[-1]
    next((folder / "step-2").glob("*.distcp")).unlink()
    plan = repair(str(folder.parent))
    assert plan.target is not None and plan.target.step == 1
    assert sorted(a.path for a in plan.actions) == [str(folder / f"step-{s}") for s in steps if s > 1]
    assert find_load_step() == 1


def test_prune_and_the_managers_retention_keep_the_quarantine(demo_dir: Path, tmp_path: Path) -> None:
    import torch

    from ckptctl.core.manager import CheckpointManager
    from ckptctl.core.retention import RetentionPolicy
    from ckptctl.ops.prune import plan_prune, prune

    run = copy_tree(demo_dir / "native", tmp_path / "native")
    box = run / trash.TRASH_NAME / trash.QUARANTINE_NAME
    box.mkdir(parents=True)
    (box / "step-99").mkdir()
    (box / "step-99" / "x.bin").write_bytes(b"kept")
    (box / "step-99.origin.json").write_text('{"origin": "step-99"}')
    (run / trash.TRASH_NAME / "leftover.1234").mkdir()  # an interrupted deletion's: emptied
    (run / trash.TRASH_NAME / "leftover.1234" / "y.bin").write_bytes(b"12345")
    assert plan_prune(str(run), RetentionPolicy(keep_last=1)).trash_bytes == 5  # the quarantine frees nothing
    prune(str(run), RetentionPolicy(keep_last=1))
    assert (box / "step-99" / "x.bin").read_bytes() == b"kept"
    assert not (run / trash.TRASH_NAME / "leftover.1234").exists()

    # The manager's retention empties the trash's leftovers after a save: never the quarantine.
    (run / trash.TRASH_NAME / "leftover.5678").mkdir()
    manager = CheckpointManager(str(run), policy=RetentionPolicy(keep_last=1))
    manager.save(40, {"model": torch.nn.Linear(2, 2)})
    manager.close()
    assert (box / "step-99" / "x.bin").read_bytes() == b"kept"
    assert not (run / trash.TRASH_NAME / "leftover.5678").exists()


# --- what must change nothing --------------------------------------------------------------------


def test_a_link_where_the_pointer_is_is_refused(zero2: WrittenDeepSpeed, tmp_path: Path) -> None:
    save_dir = copy_tree(zero2.save_dir, tmp_path / "ds")
    next((save_dir / "global_step4").glob("*zero_pp_rank_1_*optim_states.pt")).unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("global_step4")
    (save_dir / "latest").unlink()
    (save_dir / "latest").symlink_to(elsewhere)
    before = _tree_digest(save_dir)
    with pytest.raises(UnsafePath, match="symbolic link"):
        repair(str(save_dir))
    _unchanged(save_dir, before)
    assert elsewhere.read_text() == "global_step4"


def test_a_held_lock_is_refused(demo_dir: Path, tmp_path: Path) -> None:
    run = copy_tree(demo_dir / "native", tmp_path / "native")
    (run / "step-30" / "model.safetensors").unlink()
    with RunLock(str(run)), pytest.raises(RunLocked):
        repair(str(run), wait=0)
    assert (run / "latest").read_text() == "step-30\n"


def test_a_save_being_written_is_refused(trainer_run: WrittenTrainerRun, tmp_path: Path) -> None:
    out = copy_tree(trainer_run.output_dir, tmp_path / "out")
    pending = copy_tree(out / "checkpoint-4", out / "checkpoint-6")
    (pending / "trainer_state.json").unlink()  # the Trainer writes it last: this save is still going on
    plan = plan_repair(str(out))
    assert any("checkpoint-6 is being written" in n for n in plan.notes)
    before = _tree_digest(out)
    with pytest.raises(RunBusy, match="being written"):
        repair(str(out))
    _unchanged(out, before)


def test_unknown_layout_is_refused(tmp_path: Path) -> None:
    import torch

    run = tmp_path / "run"
    (run / "step-5").mkdir(parents=True)
    torch.save({"blob": torch.zeros(4)}, run / "step-5" / "train.pth")  # checkpoint-like, of no known layout
    with pytest.raises(UnknownLayout):
        plan_repair(str(run))


def test_areal_good_dump_needs_nothing_and_a_torn_one_says_what_to_do(areal_run: WrittenAreal, tmp_path: Path) -> None:
    trial = copy_tree(areal_run.trial, tmp_path / "trial")
    assert not plan_repair(str(trial)).needed
    slot = trial / "default" / "recover_checkpoint"
    next(slot.glob("*.distcp")).unlink()
    before = _tree_digest(trial)
    plan = plan_repair(str(trial))
    assert plan.needed and plan.target is None and not plan.actions and "start the run afresh" in plan.notes[0]
    _unchanged(trial, before)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any mode bits")
def test_an_unwritable_run_is_refused(demo_dir: Path, tmp_path: Path) -> None:
    run = copy_tree(demo_dir / "native", tmp_path / "native")
    (run / "step-30" / "model.safetensors").unlink()
    run.chmod(0o555)
    try:
        with pytest.raises(CkptctlError, match="not writable"):
            repair(str(run))
    finally:
        run.chmod(0o755)
    assert (run / "latest").read_text() == "step-30\n"


_KILLED_REPAIR = """
import os, signal, sys
from ckptctl.ops import repair
repair.after_action = lambda action: os.kill(os.getpid(), signal.SIGKILL)
repair.repair(sys.argv[1])
"""


def test_sigkill_after_the_first_change_leaves_before_or_after(
    zero2: WrittenDeepSpeed, hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    ckpt = arrange_openrlhf(tmp_path / "ckpt", zero2, zero2, hf_model_dirs["single"])
    next((ckpt / "_critic" / "best_global_step4").glob("*zero_pp_rank_0_*optim_states.pt")).unlink()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    killed = subprocess.run([sys.executable, "-c", _KILLED_REPAIR, str(ckpt)], env=env, timeout=300, check=False)
    assert killed.returncode == -signal.SIGKILL
    # Each pointer holds its old content or its new one, never a mix, and no temporary file is left in sight.
    pointers = {(ckpt / role / "latest").read_text() for role in ("_actor", "_critic")}
    assert pointers <= {"best_global_step4", "global_step4"}
    assert (ckpt / "_actor" / "latest").read_text() == "global_step4"
    # A second repair finishes what the killed one began (the kill left the lock to be taken over).
    with pytest.warns(RuntimeWarning, match="stale|took over|taking over|lock"):
        repair(str(ckpt))
    assert (ckpt / "_critic" / "latest").read_text() == "global_step4"
    # The killed repair's record and the second one's together put both pointers back.
    repair(str(ckpt), undo=True)
    assert (ckpt / "_actor" / "latest").read_text() == (ckpt / "_critic" / "latest").read_text() == "best_global_step4"
    assert not (ckpt / trash.TRASH_NAME).exists()


def test_sigkill_between_quarantines_leaves_each_checkpoint_whole_and_undo_restores_it(
    torchtitan_run: WrittenTorchtitan, tmp_path: Path
) -> None:
    dump = copy_tree(torchtitan_run.dump_folder, tmp_path / "dump")
    folder = dump / "checkpoint"
    next((folder / "step-2").glob("*.distcp")).unlink()
    originals = {p.name: _tree_digest(p) for p in folder.glob("step-*")}
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    killed = subprocess.run([sys.executable, "-c", _KILLED_REPAIR, str(dump)], env=env, timeout=300, check=False)
    assert killed.returncode == -signal.SIGKILL
    box = dump / trash.TRASH_NAME / trash.QUARANTINE_NAME
    # One checkpoint went whole into quarantine with its record; the others are where they were, whole.
    (moved,) = [p for p in box.iterdir() if p.is_dir()]
    assert _tree_digest(moved) == originals[moved.name] and (box / f"{moved.name}.origin.json").is_file()
    assert all(_tree_digest(folder / n) == d for n, d in originals.items() if n != moved.name)
    with pytest.warns(RuntimeWarning):  # the killed repair's lock is taken over
        repair(str(dump), undo=True)
    assert {p.name: _tree_digest(p) for p in folder.glob("step-*")} == originals


# --- undo: the run as it was, pointers too --------------------------------------------------------


def _tree(root: Path) -> dict[str, str]:
    """Every path below `root` (folders too, ckptctl's own bookkeeping included) -> its sha256, `dir` or its
    link target: equal before a repair and after its undo means byte-identical, with nothing left behind."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = "link:" + os.readlink(path)
        elif path.is_dir():
            found[rel] = "dir"
        else:
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _deepspeed_latest(save_dir: Path) -> str:
    """The tag folder DeepSpeed's own reader of `latest` (zero_to_fp32's `get_fp32_state_dict_from_zero_checkpoint`,
    the same read as `engine.load_checkpoint(dir, tag=None)`) opens; its loading of that tag stubbed out."""
    from deepspeed.utils import zero_to_fp32

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(zero_to_fp32, "_get_fp32_state_dict_from_zero_checkpoint", lambda folder, *_: folder)
        return cast(str, zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(save_dir), lazy_mode=True))


def _undo_native(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Callable[[], object]]:
    from ckptctl.core.manager import CheckpointManager

    run = copy_tree(request.getfixturevalue("demo_dir") / "native", tmp_path / "native")
    (run / "step-30" / "model.safetensors").unlink()
    return run, lambda: CheckpointManager(str(run)).pointer()


def _undo_deepspeed(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Callable[[], object]]:
    save_dir = copy_tree(request.getfixturevalue("deepspeed_runs")[2].save_dir, tmp_path / "ds")
    next((save_dir / "global_step4").glob("*zero_pp_rank_1_*optim_states.pt")).unlink()
    return save_dir, lambda: _deepspeed_latest(save_dir)


def _undo_openrlhf(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Callable[[], object]]:
    zero2 = request.getfixturevalue("deepspeed_runs")[2]
    ckpt = arrange_openrlhf(tmp_path / "ckpt", zero2, zero2, request.getfixturevalue("hf_model_dirs")["single"])
    next((ckpt / "_critic" / "best_global_step4").glob("*zero_pp_rank_0_*optim_states.pt")).unlink()
    # `--load_checkpoint` loads each role through DeepSpeed's `load_checkpoint(save_dir)`: its `latest`.
    return ckpt, lambda: (_deepspeed_latest(ckpt / "_actor"), _deepspeed_latest(ckpt / "_critic"))


def _undo_open_instruct(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Callable[[], object]]:
    zero2 = request.getfixturevalue("deepspeed_runs")[2]
    hf_model = request.getfixturevalue("hf_model_dirs")["single"]
    state = arrange_open_instruct(tmp_path / "state", tmp_path / "out", zero2, hf_model)
    (state / "global_step4" / "driver_state.pt").unlink()
    _age(state / "global_step4")
    return state, lambda: _deepspeed_latest(state)


def _undo_verl(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Callable[[], object]]:
    written: WrittenVerl = request.getfixturevalue("verl_run")
    run = copy_tree(written.run, tmp_path / "verl")
    newest = run / f"global_step_{max(written.steps)}"
    role = newest / "critic" if (newest / "critic").is_dir() else newest / "actor"
    next(role.glob("optim_world_size_*_rank_1.pt")).unlink()
    _age(newest)
    find_latest_ckpt_path = _verl_find_latest_ckpt_path()
    return run, lambda: find_latest_ckpt_path(str(run))


def _undo_megatron(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Callable[[], object]]:
    written: WrittenMegatron = request.getfixturevalue("megatron_runs")
    save = copy_tree(written.save, tmp_path / "megatron")
    next((save / f"iter_{max(written.iterations):07d}").glob("*.distcp")).unlink()

    def iteration() -> int:  # Megatron-LM's `read_metadata`, as test_megatron_tracker_is_rewritten reads it
        return int((save / "latest_checkpointed_iteration.txt").read_text().strip())

    return save, iteration


def _undo_lightning(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Callable[[], object]]:
    linked = copy_tree(request.getfixturevalue("lightning_run").linked, tmp_path / "linked")
    _truncate(linked / os.readlink(linked / "last.ckpt"))
    _age(linked)
    # `ckpt_path="last"` opens last.ckpt through the OS: the file it reaches.
    return linked, lambda: os.path.realpath(linked / "last.ckpt")


def _undo_trainer(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Callable[[], object]]:
    from transformers.trainer_utils import get_last_checkpoint

    out = copy_tree(request.getfixturevalue("trainer_run").output_dir, tmp_path / "out")
    _truncate(out / "checkpoint-4" / "model.safetensors")
    return out, lambda: get_last_checkpoint(str(out))


UNDO_CASES = {
    "native": _undo_native,
    "deepspeed": _undo_deepspeed,
    "openrlhf": _undo_openrlhf,
    "open_instruct": _undo_open_instruct,
    "verl": _undo_verl,
    "megatron": _undo_megatron,
    "lightning": _undo_lightning,
    "hf_trainer": _undo_trainer,
}


@pytest.mark.parametrize("framework", sorted(UNDO_CASES))
def test_undo_restores_the_run_byte_for_byte_and_the_framework_resumes_where_it_did(
    framework: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    run, find_latest = UNDO_CASES[framework](request, tmp_path)
    before, picked = _tree(run), find_latest()
    done = repair(str(run))
    assert done.actions and find_latest() != picked  # the repair redirected the framework's resume
    undone = repair(str(run), undo=True)
    assert not undone.dry_run and not undone.notes
    assert _tree(run) == before
    assert find_latest() == picked
    assert not plan_undo(str(run)).actions  # nothing left to undo


def test_undo_of_stacked_repairs_ends_where_the_first_began(demo_dir: Path, tmp_path: Path) -> None:
    run = copy_tree(demo_dir / "native", tmp_path / "native")
    (run / "step-30" / "model.safetensors").unlink()
    before = _tree(run)
    repair(str(run))
    (run / "step-20" / "model.safetensors").unlink()
    between = _tree(run)
    repair(str(run))
    assert (run / "latest").read_text() == "step-10\n"
    plan = plan_undo(str(run))
    assert [(a.kind, a.before, a.after) for a in plan.actions] == [
        (POINTER, "step-10\n", "step-20\n"),
        (POINTER, "step-20\n", "step-30\n"),
    ]
    assert plan.to_json()["actions"][0] == {
        "kind": "pointer",
        "path": str(run / "latest"),
        "before": "step-10\n",
        "after": "step-20\n",
        "link": False,
    }
    repair(str(run), undo=True)
    assert _tree(run) == {k: v for k, v in before.items() if k in between}  # step-20's file stays deleted


def test_undo_removes_a_pointer_the_repair_created(zero2: WrittenDeepSpeed, tmp_path: Path) -> None:
    save_dir = copy_tree(zero2.save_dir, tmp_path / "ds")
    next((save_dir / "global_step4").glob("*zero_pp_rank_1_*optim_states.pt")).unlink()
    (save_dir / "latest").unlink()
    before = _tree(save_dir)
    (action,) = repair(str(save_dir)).actions
    assert action.before is None and (save_dir / "latest").read_text() == "global_step2"
    record = json.loads(next((save_dir / trash.TRASH_NAME / trash.QUARANTINE_NAME).glob("*.pointers.json")).read_text())
    assert record["pointers"] == [
        {
            "path": "latest",
            "link": False,
            "existed": False,
            "before": None,
            "before_base64": None,
            "after": "global_step2",
        }
    ]
    (undo,) = repair(str(save_dir), undo=True).actions
    assert (undo.kind, undo.before, undo.after) == (POINTER, "global_step2", None)
    assert _tree(save_dir) == before


def test_undo_puts_back_bytes_that_are_not_text(demo_dir: Path, tmp_path: Path) -> None:
    run = copy_tree(demo_dir / "native", tmp_path / "native")
    (run / "step-30" / "model.safetensors").unlink()
    (run / "latest").write_bytes(b"step-30\xff\x00\n")  # a pointer torn by a crash: garbage bytes
    before = _tree(run)
    repair(str(run))
    assert (run / "latest").read_text() == "step-20\n"
    repair(str(run), undo=True)
    assert _tree(run) == before


def test_undo_leaves_a_pointer_written_anew_since_the_repair(demo_dir: Path, tmp_path: Path) -> None:
    run = copy_tree(demo_dir / "native", tmp_path / "native")
    (run / "step-30" / "model.safetensors").unlink()
    repair(str(run))
    (run / "latest").write_text("step-10\n")  # the training went on (or a person chose) since the repair
    plan = repair(str(run), undo=True)
    assert not plan.actions and len(plan.left) == 1
    assert "'step-10\\n' now, not 'step-20\\n'" in plan.left[0] and "'step-30\\n'" in plan.left[0]
    assert (run / "latest").read_text() == "step-10\n" and not (run / trash.TRASH_NAME).exists()


def test_undo_refuses_a_link_where_the_pointer_was(zero2: WrittenDeepSpeed, tmp_path: Path) -> None:
    save_dir = copy_tree(zero2.save_dir, tmp_path / "ds")
    next((save_dir / "global_step4").glob("*zero_pp_rank_1_*optim_states.pt")).unlink()
    repair(str(save_dir))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("global_step2")
    (save_dir / "latest").unlink()
    (save_dir / "latest").symlink_to(elsewhere)
    before = _tree(save_dir)
    with pytest.raises(UnsafePath, match="symbolic link"):
        repair(str(save_dir), undo=True)
    assert _tree(save_dir) == before and elsewhere.read_text() == "global_step2"


def test_an_old_quarantine_record_without_pointers_still_undoes_with_a_note(
    trainer_run: WrittenTrainerRun, tmp_path: Path
) -> None:
    out = copy_tree(trainer_run.output_dir, tmp_path / "out")
    before = _tree(out)
    box = out / trash.TRASH_NAME / trash.QUARANTINE_NAME
    box.mkdir(parents=True)
    (out / "checkpoint-4").rename(box / "checkpoint-4")
    # What ckptctl wrote before it recorded pointers: no `repair` key.
    (box / "checkpoint-4.origin.json").write_text('{"schema_version": 1, "origin": "checkpoint-4"}')
    plan = repair(str(out), undo=True)
    assert [a.after for a in plan.actions] == [str(out / "checkpoint-4")] and not plan.left
    (note,) = plan.notes
    assert "older ckptctl" in note and "resume-plan" in note
    assert _tree(out) == before


def test_undo_puts_pointers_back_on_an_object_store(demo_dir: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    root = "/repair-undo-native"
    for path in (demo_dir / "native").rglob("*"):
        if path.is_file() and not (path.parent.name == "step-30" and path.name == "model.safetensors"):
            fs.pipe_file(f"{root}/{path.relative_to(demo_dir / 'native')}", path.read_bytes())
    run = f"memory://{root}"
    try:
        before = {p: fs.cat_file(p) for p in fs.find(root)}
        repair(run)
        assert fs.cat_file(f"{root}/latest") == b"step-20\n"
        (action,) = repair(run, undo=True).actions
        assert (action.before, action.after) == ("step-20\n", "step-30\n")
        assert {p: fs.cat_file(p) for p in fs.find(root)} == before
    finally:
        fs.rm(root, recursive=True)
