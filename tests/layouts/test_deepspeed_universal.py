"""The DeepSpeed universal layout on `ds_to_universal`'s own output (`tests.writers.universal_writer`), damaged
the ways a conversion or a copy of one goes wrong. The shared contract is in test_contract.py; the commands
end to end in tests/cli/test_deepspeed_universal_cli.py."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptctl.checkpoint import CheckpointState, ProblemKind
from ckptctl.contract.base import list_files
from ckptctl.errors import UnknownLayout
from ckptctl.layouts import detect, get_layout, open_checkpoint, resolve, scan_run
from ckptctl.ops.verification import verify_checkpoint
from tests.conftest import CliResult, copy_tree
from tests.writers.universal_writer import UNIVERSAL_TAG, WrittenUniversal

Cli = Callable[..., CliResult]
PARAM = "model.layers.0.mlp.up_proj.weight"


class Payload:
    """Pickles as `func(*args)`: what a malicious checkpoint carries."""

    def __init__(self, func: object, *args: object) -> None:
        self.func = func
        self.args = args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


@pytest.fixture
def save_dir(deepspeed_universal: WrittenUniversal, tmp_path: Path) -> Path:
    """A private copy of the ZeRO-2 save folder holding `global_step4_universal`."""
    return copy_tree(deepspeed_universal.save_dirs[2], tmp_path / "ds")


def _age(folder: Path, seconds: float) -> None:
    old = time.time() - seconds
    for path in [folder, *folder.rglob("*")]:
        os.utime(path, (old, old))


def _state(save_dir: Path) -> tuple[CheckpointState, str]:
    (ref,) = [r for r in scan_run(str(save_dir)) if r.url.endswith(UNIVERSAL_TAG)]
    return ref.state, ref.note


def test_a_conversion_that_stopped_before_copying_the_model_states(save_dir: Path) -> None:
    universal = save_dir / UNIVERSAL_TAG
    (universal / "mp_rank_00_model_states.pt").unlink()
    _age(universal, 0)  # written just now, however long ago the cached writer ran
    state, note = _state(save_dir)
    assert state is CheckpointState.IN_PROGRESS and "ds_to_universal copies them from the tag last" in note
    _age(universal, 3600)
    assert _state(save_dir)[0] is CheckpointState.BROKEN
    assert not verify_checkpoint(str(universal)).ok


def test_a_conversion_that_stopped_before_the_optimizer_state(save_dir: Path) -> None:
    universal = save_dir / UNIVERSAL_TAG
    (universal / "zero" / "optimizer_state.pt").unlink()
    _age(universal, 3600)
    state, note = _state(save_dir)
    assert state is CheckpointState.BROKEN and note.startswith("no zero/optimizer_state.pt")
    problems = verify_checkpoint(str(universal)).problems
    assert [(p.kind, p.path) for p in problems] == [(ProblemKind.MISSING_FILE, "zero/optimizer_state.pt")]


def test_a_leftover_tmp_folder_is_a_warning(save_dir: Path) -> None:
    universal = save_dir / UNIVERSAL_TAG
    (universal / "tmp" / PARAM / "0").mkdir(parents=True)
    (universal / "tmp" / PARAM / "0" / "fp32.00").write_bytes(b"x" * 16)
    result = verify_checkpoint(str(universal))
    assert result.ok
    (problem,) = result.problems
    assert (problem.kind, problem.path, problem.severity) == (ProblemKind.UNEXPECTED_FILE, "tmp", "warning")
    # The fragments are part of the conversion: not a checkpoint of their own, counted in its size.
    (ref,) = [r for r in scan_run(str(save_dir)) if "universal" in r.url]
    assert ref.size_bytes == sum(list_files(str(universal)).values())


def test_a_state_of_another_parameter_fails_verify(save_dir: Path) -> None:
    zero = save_dir / UNIVERSAL_TAG / "zero"
    shutil.copy(zero / "model.norm.weight" / "exp_avg.pt", zero / PARAM / "exp_avg.pt")
    problems = verify_checkpoint(str(save_dir / UNIVERSAL_TAG)).problems
    assert [(p.kind, p.path) for p in problems] == [(ProblemKind.SIZE_MISMATCH, f"zero/{PARAM}/exp_avg.pt")]
    assert "shape [32], not the parameter's [64, 32]" in problems[0].message


def test_a_missing_step_is_an_error_when_the_others_have_one(save_dir: Path) -> None:
    (save_dir / UNIVERSAL_TAG / "zero" / PARAM / "step.pt").unlink()
    problems = verify_checkpoint(str(save_dir / UNIVERSAL_TAG)).problems
    assert [(p.kind, p.path) for p in problems] == [(ProblemKind.MISSING_FILE, f"zero/{PARAM}/step.pt")]


def test_a_truncated_state_file_fails_verify(save_dir: Path) -> None:
    victim = save_dir / UNIVERSAL_TAG / "zero" / PARAM / "exp_avg_sq.pt"
    victim.write_bytes(victim.read_bytes()[:-200])
    problems = verify_checkpoint(str(save_dir / UNIVERSAL_TAG)).problems
    assert [p.path for p in problems] == [f"zero/{PARAM}/exp_avg_sq.pt"]


def test_latest_universal_naming_a_missing_folder(save_dir: Path) -> None:
    (save_dir / "latest_universal").write_text("global_step9_universal")
    assert not any(r.latest for r in scan_run(str(save_dir)) if r.layout == "deepspeed_universal")
    problems = verify_checkpoint(str(save_dir / UNIVERSAL_TAG)).problems
    assert [(p.kind, p.path) for p in problems] == [(ProblemKind.MISSING_FILE, "../latest_universal")]


def test_a_hostile_state_file_is_refused_and_nothing_runs(save_dir: Path, tmp_path: Path, run_cli: Cli) -> None:
    marker = tmp_path / "pwned"
    victim = save_dir / UNIVERSAL_TAG / "zero" / PARAM / "fp32.pt"
    state = torch.load(victim, map_location="cpu", weights_only=True)
    state["note"] = Payload(os.system, f"touch {marker}")
    torch.save(state, victim)
    result = run_cli("verify", save_dir / UNIVERSAL_TAG, "--json")
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    (problem,) = result.json["problems"]
    assert (problem["kind"], problem["path"]) == ("unsafe_pickle", f"zero/{PARAM}/fp32.pt")
    assert "posix.system" in problem["message"]
    converted = run_cli("convert", save_dir / UNIVERSAL_TAG, tmp_path / "hf", "--to", "hf")
    assert converted.exit_code != 0 and not (tmp_path / "hf").exists()
    assert not marker.exists()


def test_completion_markers_are_written_last(deepspeed_universal: WrittenUniversal) -> None:
    universal = deepspeed_universal.universal(3)
    markers = get_layout("deepspeed_universal").completion_markers(list_files(str(universal)))
    assert markers == ("zero/optimizer_state.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def test_away_from_its_tag_it_counts_deepspeeds_steps(deepspeed_universal: WrittenUniversal, tmp_path: Path) -> None:
    """Beside its tag an open-instruct conversion has the tag's training step; alone, DeepSpeed's count."""
    name = "ds_universal_global_step4"
    alone = copy_tree(deepspeed_universal.open_instruct / name, tmp_path / "state" / name)
    assert detect(str(alone))[1].step == 4  # the number of the DeepSpeed tag in its name
    ckpt = open_checkpoint(str(alone))
    assert ckpt.ref.step == 4 and ckpt.metadata["converted_from"] is None  # the model states' global_steps
    assert ckpt.progress["training_step"] == 2  # the client state travels with the model states
    renamed = alone.rename(alone.with_name("universal"))
    assert detect(str(renamed))[1].step is None and open_checkpoint(str(renamed)).ref.step == 4


def test_a_save_folder_with_two_pointers_names_both(deepspeed_universal: WrittenUniversal) -> None:
    with pytest.raises(UnknownLayout, match="pointers in it name global_step4 \\(deepspeed\\), global_step4_universal"):
        resolve(str(deepspeed_universal.save_dirs[2]))
