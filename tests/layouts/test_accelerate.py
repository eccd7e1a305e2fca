"""The accelerate layout on folders written by accelerate 1.15's own `save_state` (tests/writers/accelerate_writer.py):
every command's exit code and JSON on the plain, DeepSpeed, FSDP and user-named `.bin` variants."""

from __future__ import annotations

import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl.checkpoint import CheckpointState
from tests.conftest import CliResult, copy_tree
from tests.writers.accelerate_writer import WrittenAccelerate

Cli = Callable[..., CliResult]

#: (variant, the folder, the run whose reference weights it holds, its plugin)
VARIANTS = ("plain", "deepspeed", "fsdp", "named")


def _folder(runs: WrittenAccelerate, variant: str) -> Path:
    return {
        "plain": runs.plain_checkpoints()[-1],
        "deepspeed": runs.deepspeed_checkpoints()[-1],
        "fsdp": runs.fsdp,
        "named": runs.named,
    }[variant]


def _reference_run(variant: str) -> str:
    return "plain" if variant == "named" else variant


def test_list_shows_each_save_state_folder_once_with_its_save_count(
    accelerate_runs: WrittenAccelerate, run_cli: Cli
) -> None:
    """`checkpoints/checkpoint_N` folders are the checkpoints (a DeepSpeed tag inside is part of one, not a
    checkpoint of its own), N is their step and the note says it counts saves; no `latest` pointer."""
    for project, folders in (
        (accelerate_runs.plain, accelerate_runs.plain_checkpoints()),
        (accelerate_runs.deepspeed, accelerate_runs.deepspeed_checkpoints()),
    ):
        result = run_cli("list", project, "--json")
        assert result.exit_code == 0, result.stderr
        rows = result.json["checkpoints"]
        assert [(r["url"], r["layout"], r["step"], r["state"], r["latest"]) for r in rows] == [
            (str(f), "accelerate", int(f.name.rpartition("_")[2]), "complete", False) for f in folders
        ]
        assert all("counts saves, not training steps" in r["note"] for r in rows)
    # accelerate's own total_limit=2 rotation deleted checkpoint_0 of the DeepSpeed run before its third save.
    assert [f.name for f in accelerate_runs.deepspeed_checkpoints()] == ["checkpoint_1", "checkpoint_2"]
    assert not (accelerate_runs.deepspeed / "checkpoints" / "checkpoint_0").exists()


@pytest.mark.parametrize("variant", VARIANTS)
def test_inspect_and_verify(accelerate_runs: WrittenAccelerate, run_cli: Cli, variant: str) -> None:
    folder = _folder(accelerate_runs, variant)
    result = run_cli("inspect", folder, "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert (doc["url"], doc["layout"], doc["world_size"]) == (str(folder), "accelerate", 1)
    assert doc["totals"]["parameters"] == accelerate_runs.model_parameters
    expected = {"model", "optimizer", "scheduler", "rng"} | ({"dataloader"} if variant == "named" else set())
    assert set(doc["components"]) == expected
    model = {t["name"] for t in doc["tensors"] if t["component"] == "model"}
    assert len(model) == len(accelerate_runs.reference(_reference_run(variant)))
    assert any(t["component"] == "optimizer" for t in doc["tensors"])

    verified = run_cli("verify", folder, "--json")
    assert verified.exit_code == 0, verified.stdout
    assert verified.json["ok"] is True and verified.json["problems"] == []


def test_inspect_reads_the_counters_the_files_hold(accelerate_runs: WrittenAccelerate, run_cli: Cli) -> None:
    """The save count of the folder's name, `accelerator.step` from random_states_0.pkl (6 micro-batches under
    `accumulate`) and, under DeepSpeed, the engine's own counters from the tag inside."""
    plain = run_cli("inspect", accelerate_runs.plain_checkpoints()[-1], "--json").json
    assert (plain["step"], plain["metadata"]["plugin"]) == (2, "none")
    assert plain["metadata"]["progress"] == {"save_iteration": 2, "accelerator_step": 6}
    ds = run_cli("inspect", accelerate_runs.deepspeed_checkpoints()[-1], "--json").json
    assert ds["metadata"]["plugin"] == "deepspeed"
    assert ds["metadata"]["deepspeed"]["zero_stage"] == 2 and ds["metadata"]["deepspeed"]["tag"] == "pytorch_model"
    assert ds["metadata"]["progress"]["global_steps"] == 6
    assert run_cli("inspect", accelerate_runs.fsdp, "--json").json["metadata"]["plugin"] == "fsdp"


@pytest.mark.parametrize("variant", VARIANTS)
def test_convert_to_hf_equals_the_trained_model(
    accelerate_runs: WrittenAccelerate, run_cli: Cli, tmp_path: Path, variant: str
) -> None:
    """Through the safetensors file, the safe reading of pytorch_model.bin, the DeepSpeed tag's fp32 partitions
    and the FSDP DCP folder: transformers loads the output and every tensor equals the run's final weights."""
    from transformers import AutoModelForCausalLM

    result = run_cli(
        "convert", _folder(accelerate_runs, variant), tmp_path / "hf", "--config", accelerate_runs.config_dir, "--json"
    )
    assert result.exit_code == 0, result.stderr
    assert result.json["layout"] == "accelerate" and result.json["to"] == "hf"
    reference = accelerate_runs.reference(_reference_run(variant))
    state = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).state_dict()
    assert sorted(state) == sorted(reference)
    for name, tensor in reference.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name


def test_convert_finds_the_config_in_the_project_folder(
    accelerate_runs: WrittenAccelerate, run_cli: Cli, tmp_path: Path
) -> None:
    """A script that `save_pretrained`s its model into the project folder: convert of `checkpoints/checkpoint_N`
    takes the config from there, two levels up."""
    project = copy_tree(accelerate_runs.plain, tmp_path / "project")
    shutil.copyfile(accelerate_runs.config_dir / "config.json", project / "config.json")
    result = run_cli("convert", project / "checkpoints" / "checkpoint_2", tmp_path / "hf", "--json")
    assert result.exit_code == 0, result.stderr
    assert "config.json" in result.json["copied"]


def test_resume_plan_gives_load_state_and_what_it_restores(accelerate_runs: WrittenAccelerate, run_cli: Cli) -> None:
    for project in (accelerate_runs.plain, accelerate_runs.deepspeed):
        result = run_cli("resume-plan", project, "--json")
        assert result.exit_code == 0, result.stderr
        doc = result.json
        newest = str(project / "checkpoints" / "checkpoint_2")
        assert (doc["checkpoint"]["url"], doc["checkpoint"]["layout"]) == (newest, "accelerate")
        assert doc["resume_hint"] == f"accelerator.load_state({newest!r})"
        assert doc["restores"] == ["model", "optimizer", "scheduler", "rng"]
        assert doc["missing"] == ["dataloader", "trainer_state"]
        assert "skip_first_batches" in doc["impacts"]["dataloader"]
        assert doc["world_size_ok"] is True
        assert any("project_configuration.iteration = 3" in w for w in doc["warnings"])
    named = run_cli("resume-plan", accelerate_runs.named.parent, "--json").json
    assert named["restores"] == ["model", "optimizer", "scheduler", "rng", "dataloader"]
    assert named["resume_hint"] == f"accelerator.load_state({str(accelerate_runs.named)!r})"


def test_a_resume_that_restarted_the_numbering(accelerate_runs: WrittenAccelerate, run_cli: Cli) -> None:
    """accelerate's own resume (load_state() of checkpoint_2, then save_state with total_limit=3) rotated out
    checkpoint_0 and saved the newer state there: prune keeps both that save and checkpoint_2 (which
    load_state() without a path loads), and resume-plan says the newer state is in checkpoint_0."""
    checkpoints = accelerate_runs.resumed / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    plan = run_cli("prune", accelerate_runs.resumed, "--keep-last", "1", "--grace", "0s", "--dry-run", "--json")
    # 0: a protection (accelerate's own resume) kept a checkpoint no rule keeps, which a note says.
    assert plan.exit_code == 0, plan.stderr
    assert "note: checkpoints/checkpoint_0 is protected" in plan.stderr
    keep = {Path(k["url"]).name: k["reasons"] for k in plan.json["keep"]}
    assert [Path(d["url"]).name for d in plan.json["delete"]] == ["checkpoint_1"]
    assert any("numbering restarted" in r for r in keep["checkpoint_0"])
    assert any("load_state() without a path" in r for r in keep["checkpoint_2"])

    resume = run_cli("resume-plan", accelerate_runs.resumed, "--json").json
    assert any(w.startswith("checkpoint_0 was saved after checkpoint_2") for w in resume["warnings"])


def test_an_unfinished_save_is_not_complete(accelerate_runs: WrittenAccelerate, run_cli: Cli, tmp_path: Path) -> None:
    """save_state writes random_states_{i}.pkl after everything else: without it the folder is an unfinished
    save, which resume-plan skips for the one before it."""
    project = copy_tree(accelerate_runs.plain, tmp_path / "project")
    (project / "checkpoints" / "checkpoint_2" / "random_states_0.pkl").unlink()
    rows = run_cli("list", project, "--json").json["checkpoints"]
    assert [r["state"] for r in rows] == ["complete", "complete", CheckpointState.IN_PROGRESS]
    verified = run_cli("verify", project / "checkpoints" / "checkpoint_2", "--json")
    assert verified.exit_code == 1
    assert [p["kind"] for p in verified.json["problems"]] == ["in_progress"]  # its files are fresh
    plan = run_cli("resume-plan", project, "--json").json
    assert plan["checkpoint"]["url"] == str(project / "checkpoints" / "checkpoint_1")
    assert any(
        "load_state() without a path loads the highest-numbered folder, checkpoint_2" in w for w in plan["warnings"]
    )


def test_an_entry_without_a_number_breaks_load_state(
    accelerate_runs: WrittenAccelerate, run_cli: Cli, tmp_path: Path
) -> None:
    """load_state() without a path sorts every entry of checkpoints/ by its number: one without raises IndexError."""
    project = copy_tree(accelerate_runs.plain, tmp_path / "project")
    (project / "checkpoints" / "notes.txt").write_text("lr 1e-3\n")
    plan = run_cli("resume-plan", project, "--json").json
    assert any("notes.txt" in w and "IndexError" in w for w in plan["warnings"])


class _Payload:
    """Pickles as `func(*args)`: what a malicious checkpoint carries."""

    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


def _replace_data_pkl(path: Path, payload: Any) -> None:
    """Rewrite the `data.pkl` record of a torch.save zip (keeping every other record)."""
    with zipfile.ZipFile(path) as source:
        records = {info.filename: source.read(info) for info in source.infolist()}
    name = next(n for n in records if n.endswith("/data.pkl"))
    records[name] = pickle.dumps(payload, protocol=2)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as target:
        for record, data in records.items():
            target.writestr(record, data)


def test_a_random_states_pickle_with_a_payload_is_refused(
    accelerate_runs: WrittenAccelerate, run_cli: Cli, tmp_path: Path
) -> None:
    folder = copy_tree(accelerate_runs.plain_checkpoints()[-1], tmp_path / "checkpoint_2")
    marker = tmp_path / "ran"
    _replace_data_pkl(folder / "random_states_0.pkl", {"step": _Payload(marker.touch)})
    result = run_cli("verify", folder, "--json")
    assert result.exit_code == 1
    assert [(p["kind"], p["path"]) for p in result.json["problems"]] == [("unsafe_pickle", "random_states_0.pkl")]
    assert run_cli("inspect", folder, "--json").exit_code == 0  # the listing still says what it is
    assert not marker.exists()


def test_a_random_states_file_without_the_rng_states_fails(
    accelerate_runs: WrittenAccelerate, run_cli: Cli, tmp_path: Path
) -> None:
    """load_state catches any error of the RNG restore and only logs it: a file without the states would
    silently restore nothing."""
    folder = copy_tree(accelerate_runs.plain_checkpoints()[-1], tmp_path / "checkpoint_2")
    _replace_data_pkl(folder / "random_states_0.pkl", {"step": 6})
    result = run_cli("verify", folder, "--json")
    assert result.exit_code == 1
    (problem,) = result.json["problems"]
    assert problem["kind"] == "bad_metadata" and "random_state" in problem["message"]


def test_per_process_fsdp_files_are_checked_not_read(
    accelerate_runs: WrittenAccelerate, run_cli: Cli, tmp_path: Path
) -> None:
    """`save_fsdp_model`/`save_fsdp_optimizer(..., use_dcp=False)`: per-process DTensor pickles that ckptctl does
    not read. The folder verifies by its files, says so, loads only on the same processes, and not with
    load_state (which reads the DCP folders)."""
    folder = accelerate_runs.fsdp_no_dcp
    assert sorted(p.name for p in folder.iterdir() if "_rank" in p.name) == [
        "optimizer_0_rank0.bin",
        "pytorch_model_fsdp_0_rank0.bin",
    ]
    doc = run_cli("inspect", folder, "--json").json
    assert {"model", "optimizer"} <= set(doc["components"]) and doc["tensors"] == []
    assert "does not read" in doc["metadata"]["note"]
    assert run_cli("verify", folder, "--json").exit_code == 0
    plan = run_cli("resume-plan", folder.parent, "--world-size", "2", "--json").json
    assert plan["world_size_ok"] is False
    assert plan["resume_hint"].startswith("load_fsdp_model(") and "use_dcp=False" in plan["resume_hint"]
    converted = run_cli("convert", folder, tmp_path / "never", "--json")
    assert converted.exit_code == 2 and "holds no model tensors" in converted.json["error"]["message"]
