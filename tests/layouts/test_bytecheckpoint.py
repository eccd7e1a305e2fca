"""The ByteCheckpoint layout on saves ByteCheckpoint 0.0.2's own `bcp.save` wrote on 2 CPU ranks
(tests.writers.bytecheckpoint_writer): list, inspect, verify, convert (proven against ByteCheckpoint's own merge
tool), resume-plan, prune and diff; a torn save (rank 1's optimizer data lost, the tracker not moved on) is
never complete; the DCP reader no longer takes its `model/` and `optimizer/` for DCP checkpoints."""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from ckptctl import io
from ckptctl.checkpoint import CheckpointState, Component
from ckptctl.formats.chunks import read_tensor
from ckptctl.layouts import detect, open_checkpoint, scan_run
from tests.conftest import CliResult, copy_tree
from tests.writers.bytecheckpoint_writer import TRACKER, WrittenBytecheckpoint

Cli = Callable[..., CliResult]


def _listed(result: CliResult) -> list[tuple[str, str, int | None, str, bool]]:
    return [(io.name_of(c["url"]), c["layout"], c["step"], c["state"], c["latest"]) for c in result.json["checkpoints"]]


def _torn(written: WrittenBytecheckpoint, tmp_path: Path, *, age_s: float = 0) -> Path:
    """A copy of the run as a save killed half-way through step 2 leaves it: rank 1's optimizer data never
    written, the tracker still at step 1; `age_s` seconds ago."""
    run = copy_tree(written.run, tmp_path / "run")
    (run / "global_step_2" / "optimizer" / "__1_0.distcp").unlink()
    (run / TRACKER).write_text("1")
    if age_s:
        then = time.time() - age_s
        for path in [run, *run.rglob("*")]:
            os.utime(path, (then, then))
    return run


def test_list_shows_the_steps_and_the_trackers_step_as_latest(
    bytecheckpoint_run: WrittenBytecheckpoint, run_cli: Cli
) -> None:
    result = run_cli("list", bytecheckpoint_run.run, "--json")
    assert result.exit_code == 0, result.stderr
    assert _listed(result) == [
        ("global_step_1", "bytecheckpoint", 1, "complete", False),
        ("global_step_2", "bytecheckpoint", 2, "complete", True),
    ]


def test_its_model_and_optimizer_folders_are_no_dcp_checkpoints(
    bytecheckpoint_run: WrittenBytecheckpoint, run_cli: Cli
) -> None:
    """They are shaped like DCP folders, but their `.metadata` pickles ByteCheckpoint's class: the DCP reader
    leaves them alone, so nothing lists them on their own; given directly, each is that part of the save."""
    assert [ref.layout for ref in scan_run(str(bytecheckpoint_run.run))] == ["bytecheckpoint"] * 2
    for folder, component in (("model", Component.MODEL), ("optimizer", Component.OPTIMIZER)):
        url = bytecheckpoint_run.step(2) / folder
        layout, ref = detect(str(url))
        assert (layout.name, ref.step, ref.state) == ("bytecheckpoint", 2, CheckpointState.COMPLETE)
        assert {t.component for t in open_checkpoint(str(url)).tensors()} == {component}
        assert run_cli("verify", url).exit_code == 0


def test_a_step_of_several_roles_is_one_checkpoint_naming_them(
    bytecheckpoint_run: WrittenBytecheckpoint, run_cli: Cli
) -> None:
    result = run_cli("list", bytecheckpoint_run.roles, "--json")
    assert result.exit_code == 0, result.stderr
    assert _listed(result) == [("global_step_1", "bytecheckpoint", 1, "complete", False)]
    assert result.json["checkpoints"][0]["note"] == "roles: actor, critic"
    ckpt = open_checkpoint(str(bytecheckpoint_run.roles / "global_step_1"))
    assert ckpt.metadata["roles"] == ["actor", "critic"]
    assert ckpt.metadata["tensors_of"] == "actor"
    assert sum(t.numel for t in ckpt.tensors(Component.MODEL)) == bytecheckpoint_run.model_parameters
    assert {c.file.partition("/")[0] for t in ckpt.tensors() for c in t.chunks} == {"actor"}
    assert run_cli("verify", bytecheckpoint_run.roles).exit_code == 0


def test_inspect_names_components_world_size_and_parameters(bytecheckpoint_run: WrittenBytecheckpoint) -> None:
    ckpt = open_checkpoint(str(bytecheckpoint_run.step(2)))
    assert ckpt.layout == "bytecheckpoint"
    assert ckpt.world_size == 2
    assert {Component.MODEL, Component.OPTIMIZER, Component.RNG, Component.TRAINER_STATE} == set(ckpt.components)
    assert sum(t.numel for t in ckpt.tensors(Component.MODEL)) == bytecheckpoint_run.model_parameters
    assert ckpt.metadata["bytecheckpoint_version"] == "0.0.2"
    assert ckpt.metadata["extra_state_keys"] == ["global_step", "rng"]
    assert ckpt.metadata["tracker_step"] == 2
    assert dict(ckpt.progress) == {"global_step": 2}


def test_every_tensor_reads_back_exactly_as_the_ranks_held_it(bytecheckpoint_run: WrittenBytecheckpoint) -> None:
    """Model and optimizer, from the raw byte ranges of both ranks' files, equal the full state rank 0 gathered."""
    ckpt = open_checkpoint(str(bytecheckpoint_run.step(2)))
    reference = load_file(str(bytecheckpoint_run.reference))
    entries = {e.name: e for e in ckpt.tensors()}
    assert set(entries) == set(reference)
    for name, expected in reference.items():
        assert torch.equal(read_tensor(ckpt.url, entries[name]), expected), name


def test_verify_passes_the_run(bytecheckpoint_run: WrittenBytecheckpoint, run_cli: Cli) -> None:
    result = run_cli("verify", bytecheckpoint_run.run, "--json")
    assert result.exit_code == 0, result.stdout


def test_convert_to_hf_equals_bytecheckpoints_own_merge(
    bytecheckpoint_run: WrittenBytecheckpoint, run_cli: Cli, tmp_path: Path
) -> None:
    out = tmp_path / "hf"
    result = run_cli("convert", bytecheckpoint_run.step(2), out, "--to", "hf", "--config", bytecheckpoint_run.config)
    assert result.exit_code == 0, result.stderr
    converted = load_file(str(out / "model.safetensors"))
    merged = load_file(str(bytecheckpoint_run.merged))
    assert set(converted) == set(merged)
    for name, tensor in merged.items():
        assert torch.equal(converted[name], tensor), name
    assert (out / "config.json").read_bytes() == (bytecheckpoint_run.config / "config.json").read_bytes()


def test_resume_plan_loads_the_trackers_step_and_says_it_reshards(
    bytecheckpoint_run: WrittenBytecheckpoint, run_cli: Cli
) -> None:
    result = run_cli("resume-plan", bytecheckpoint_run.run, "--world-size", "4", "--json")
    assert result.exit_code == 0, result.stdout
    plan = result.json
    assert plan["checkpoint"]["url"] == str(bytecheckpoint_run.step(2))
    assert plan["resume_hint"].startswith(f"bcp.load({str(bytecheckpoint_run.step(2))!r}, {{'model': model")
    assert plan["world_size"]["ok"] is True
    assert "reshards" in plan["world_size"]["note"] and "extra state does not reshard" in plan["world_size"]["note"]
    assert plan["continues_from"]["global_step"] == 2


def test_diff_of_two_steps_reads_the_changed_tensors(bytecheckpoint_run: WrittenBytecheckpoint, run_cli: Cli) -> None:
    result = run_cli("diff", bytecheckpoint_run.step(1), bytecheckpoint_run.step(2), "--json")
    assert result.exit_code == 1, result.stdout
    changed = {c["name"] for c in result.json["changed"] if c["kind"] == "values"}
    assert "lm_head.weight" in changed and "model.embed_tokens.weight" in changed
    assert result.json["only_in_a"] == [] and result.json["only_in_b"] == []


def test_a_torn_save_is_never_complete_and_verify_names_the_missing_file(
    bytecheckpoint_run: WrittenBytecheckpoint, run_cli: Cli, tmp_path: Path
) -> None:
    fresh = _torn(bytecheckpoint_run, tmp_path / "fresh")
    assert _listed(run_cli("list", fresh, "--json")) == [
        ("global_step_1", "bytecheckpoint", 1, "complete", True),
        ("global_step_2", "bytecheckpoint", 2, "in_progress", False),
    ]
    old = _torn(bytecheckpoint_run, tmp_path / "old", age_s=3600)
    listed = run_cli("list", old, "--json")
    assert _listed(listed)[1] == ("global_step_2", "bytecheckpoint", 2, "broken", False)
    assert "newer than the tracker's step 1" in listed.json["checkpoints"][1]["note"]
    result = run_cli("verify", old / "global_step_2", "--json")
    assert result.exit_code == 1, result.stdout
    problems = {(p["kind"], p["path"]) for p in result.json["problems"]}
    assert ("missing_file", "optimizer/__1_0.distcp") in problems
    assert run_cli("verify", old).exit_code == 1
    plan = run_cli("resume-plan", old, "--json")
    assert plan.json["checkpoint"]["url"] == str(old / "global_step_1")


def test_a_short_data_file_is_named(bytecheckpoint_run: WrittenBytecheckpoint, run_cli: Cli, tmp_path: Path) -> None:
    step = copy_tree(bytecheckpoint_run.step(2), tmp_path / "run" / "global_step_2")
    victim = step / "optimizer" / "__1_0.distcp"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    result = run_cli("verify", step, "--json")
    assert result.exit_code == 1
    assert ("truncated", "optimizer/__1_0.distcp") in {(p["kind"], p["path"]) for p in result.json["problems"]}


def test_prune_never_deletes_the_trackers_step(
    bytecheckpoint_run: WrittenBytecheckpoint, run_cli: Cli, tmp_path: Path
) -> None:
    run = copy_tree(bytecheckpoint_run.run, tmp_path / "run")
    (run / TRACKER).write_text("1")  # a run that went back to step 1: its tracker names it
    result = run_cli("prune", run, "--keep-last", "1", "--grace", "0s", "--yes", "--json")
    assert result.exit_code == 0, result.stdout
    assert sorted(p.name for p in run.iterdir()) == ["global_step_1", "global_step_2", TRACKER]
    kept = {io.name_of(k["url"]): k["reasons"] for k in result.json["keep"]}
    assert any("latest pointer" in reason for reason in kept["global_step_1"])


def test_a_metadata_that_runs_code_is_refused(
    bytecheckpoint_run: WrittenBytecheckpoint, run_cli: Cli, tmp_path: Path
) -> None:
    class RunsCode:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    step = copy_tree(bytecheckpoint_run.step(2), tmp_path / "run" / "global_step_2")
    (step / "model" / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    _, ref = detect(str(step))
    assert ref.layout == "bytecheckpoint" and ref.state is CheckpointState.COMPLETE  # judged from the listing
    result = run_cli("verify", step, "--json")
    assert result.exit_code == 1
    assert ("unsafe_pickle", "model/.metadata") in {(p["kind"], p["path"]) for p in result.json["problems"]}


def test_a_save_that_has_written_data_but_no_metadata_yet_is_in_progress(
    bytecheckpoint_run: WrittenBytecheckpoint, run_cli: Cli, tmp_path: Path
) -> None:
    """What a step folder holds before the coordinator writes `.metadata`: ByteCheckpoint's folders and data
    files, nothing that names the class; it is still ByteCheckpoint's, and not complete."""
    run = copy_tree(bytecheckpoint_run.run, tmp_path / "run")
    for folder in ("model", "optimizer"):
        (run / "global_step_2" / folder / ".metadata").unlink()
    (run / TRACKER).write_text("1")
    assert _listed(run_cli("list", run, "--json"))[1] == ("global_step_2", "bytecheckpoint", 2, "in_progress", False)
