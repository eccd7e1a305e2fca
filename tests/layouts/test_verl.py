"""The verl layout on a run verl 0.9.1's own FSDPCheckpointManager wrote on 2 CPU ranks (tests.writers.verl_writer):
list, inspect, verify, prune, resume-plan, diff and convert, the latter proven against verl's own merger."""

from __future__ import annotations

import os
import pickletools
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from ckptctl import io
from ckptctl.checkpoint import CheckpointState, Component, ProblemKind
from ckptctl.errors import CkptctlError
from ckptctl.formats.dtensor import dtensor_facts, state_tensors
from ckptctl.formats.dtensor_classes import DTENSOR_PICKLE_GLOBALS, DTensorRef
from ckptctl.formats.torch_pickle import open_torch_pickle
from ckptctl.layouts import open_checkpoint, scan_run
from ckptctl.ops.verification import verify_checkpoint
from tests.conftest import CliResult, copy_tree
from tests.writers.verl_writer import TRACKER, WrittenVerl

Cli = Callable[..., CliResult]


def _run(verl_run: WrittenVerl, tmp_path: Path) -> Path:
    return copy_tree(verl_run.run, tmp_path / "checkpoints" / "proj" / "exp")


def test_list_shows_the_steps_and_the_trackers_step_as_latest(verl_run: WrittenVerl, run_cli: Cli) -> None:
    result = run_cli("list", verl_run.run, "--json")
    assert result.exit_code == 0, result.stderr
    found = [
        (io.name_of(c["url"]), c["layout"], c["step"], c["state"], c["latest"], c["roles"])
        for c in result.json["checkpoints"]
    ]
    assert found == [
        ("global_step_1", "verl", 1, "complete", False, ["actor", "critic"]),
        ("global_step_2", "verl", 2, "complete", True, ["actor", "critic"]),
    ]
    human = run_cli("list", verl_run.run)
    assert human.stdout.split("\n")[0].split() == [
        "path",
        "step",
        "state",
        "layout",
        "roles",
        "size",
        "created",
        "latest",
    ]
    assert human.stdout.split("\n")[2].split()[:5] == ["global_step_2", "2", "complete", "verl", "actor,critic"]


def test_inspect_names_roles_world_size_and_components(verl_run: WrittenVerl) -> None:
    ckpt = open_checkpoint(str(verl_run.step(2)))
    assert ckpt.world_size == 2
    assert ckpt.metadata["roles"] == ["actor", "critic"]
    assert ckpt.metadata["role_world_sizes"] == {"actor": 2, "critic": 2}
    assert ckpt.metadata["fsdp_versions"] == {"actor": 2, "critic": 2}
    assert ckpt.metadata["tensors_of"] == "actor"
    assert {Component.MODEL, Component.OPTIMIZER, Component.SCHEDULER, Component.RNG, Component.DATALOADER} <= set(
        ckpt.components
    )
    # The optimizer's states are DTensors merged like the weights; its `step` counters (plain tensors on every
    # rank) are taken once.
    optimizer = {t.name: t for t in ckpt.tensors(Component.OPTIMIZER)}
    assert optimizer["optimizer.state.0.exp_avg"].shape == (128, 32)
    assert [c.file for c in optimizer["optimizer.state.0.exp_avg"].chunks] == [
        "actor/optim_world_size_2_rank_0.pt",
        "actor/optim_world_size_2_rank_1.pt",
    ]
    # A plain tensor that every rank holds whole (here the optimizer's `step` counters; verl's merger
    # concatenated such tensors, verl PR#7610) is taken from rank 0 only and keeps its shape.
    assert optimizer["optimizer.state.0.step"].shape == ()
    assert [c.file for c in optimizer["optimizer.state.0.step"].chunks] == ["actor/optim_world_size_2_rank_0.pt"]


def test_real_rank_files_name_only_the_dtensor_globals_ckptctl_allows(verl_run: WrittenVerl) -> None:
    """What torch 2.13 pickles for verl's sharded state dicts (model, optimizer, extra state): all allowed, and
    the DTensor pieces exactly the stand-ins `formats.dtensor_classes` defines for them."""
    seen: set[tuple[str, str]] = set()
    for path in sorted((verl_run.step(2) / "critic").glob("*_world_size_2_rank_*.pt")):
        with zipfile.ZipFile(path) as z:
            data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
        assert data[:2] == b"\x80\x02"  # torch.save's protocol 2: every global is a GLOBAL opcode
        seen |= {tuple(arg.split(" ", 1)) for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}
        open_torch_pickle(str(path), None, DTENSOR_PICKLE_GLOBALS)  # and the whole file reads
    assert seen <= set(DTENSOR_PICKLE_GLOBALS)
    assert {g for g in seen if g[0].startswith("torch.distributed")} == {
        ("torch.distributed._mesh_layout", "_FlatLayout"),
        ("torch.distributed._mesh_layout", "_MeshLayout"),
        ("torch.distributed.device_mesh", "DeviceMesh"),
        ("torch.distributed.tensor", "DTensor"),
        ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
        ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"),
        ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
        ("torch.distributed.tensor.placement_types", "Replicate"),
        ("torch.distributed.tensor.placement_types", "Shard"),
    }


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_bit_flips_of_real_rank_files(verl_run: WrittenVerl, tmp_path: Path, data: st.DataObject) -> None:
    """Only ckptctl errors escape from reading a damaged rank file's DTensors (spec, mesh, placements, shard)."""
    files = sorted((verl_run.step(2) / "critic").glob("*_world_size_2_rank_*.pt"))
    files += sorted((verl_run.step(2) / "actor").glob("model_world_size_2_rank_*.pt"))
    blob = bytearray(data.draw(st.sampled_from(files)).read_bytes())
    for _ in range(data.draw(st.integers(1, 8))):
        where = data.draw(st.integers(0, min(len(blob), 12000) - 1))  # data.pkl comes first
        blob[where] ^= 1 << data.draw(st.integers(0, 7))
    target = tmp_path / "model_world_size_2_rank_0.pt"
    target.write_bytes(bytes(blob))
    try:
        opened = open_torch_pickle(str(target), None, DTENSOR_PICKLE_GLOBALS)
        for name, value in state_tensors(opened.root):
            if isinstance(value, DTensorRef):
                facts = dtensor_facts(value, name)
                facts.local_box(facts.coordinate or (0,) * len(facts.mesh_shape))
                value = facts.local
            opened.byte_range(value)
    except CkptctlError:
        pass


def test_a_missing_rank_file_breaks_the_step_and_verify_names_it(verl_run: WrittenVerl, tmp_path: Path) -> None:
    run = _run(verl_run, tmp_path)
    (run / "global_step_2" / "critic" / "optim_world_size_2_rank_1.pt").unlink()
    refs = {io.name_of(r.url): r for r in scan_run(str(run))}
    assert refs["global_step_2"].state is CheckpointState.IN_PROGRESS  # its files are fresh: a save may be at it
    for path in run.rglob("*"):  # a save that stopped an hour ago
        os.utime(path, (path.stat().st_mtime - 3600,) * 2)
    refs = {io.name_of(r.url): r for r in scan_run(str(run))}
    assert refs["global_step_2"].state is CheckpointState.BROKEN
    assert "critic/optim_world_size_2_rank_1.pt missing (1 of 2 optim rank files)" in refs["global_step_2"].note
    problems = verify_checkpoint(str(run / "global_step_2")).problems
    assert [(p.kind, p.path) for p in problems] == [(ProblemKind.MISSING_FILE, "critic/optim_world_size_2_rank_1.pt")]


def test_verify_of_a_role_names_its_missing_rank_file(verl_run: WrittenVerl, tmp_path: Path, run_cli: Cli) -> None:
    """A role given directly, its rank 1 model file deleted: verify names the file by its name (exit 1), as list
    does in its note."""
    critic = copy_tree(verl_run.step(2) / "critic", tmp_path / "global_step_2" / "critic")
    (critic / "model_world_size_2_rank_1.pt").unlink()
    result = run_cli("verify", critic)  # fresh files: a save may still be writing it
    assert result.exit_code == 1
    assert "in_progress critic/model_world_size_2_rank_1.pt missing (1 of 2 model rank files)" in result.stdout
    for path in critic.rglob("*"):  # a save that stopped an hour ago
        os.utime(path, (path.stat().st_mtime - 3600,) * 2)
    result = run_cli("verify", critic, "--json")
    assert result.exit_code == 1
    assert [(p["kind"], p["path"], p["message"]) for p in result.json["problems"]] == [
        (
            "missing_file",
            "model_world_size_2_rank_1.pt",
            "model_world_size_2_rank_1.pt is missing (rank 1 of 2 wrote no model file): verl cannot load this role "
            "on any rank",
        )
    ]


def test_a_rank_file_copied_over_another_leaves_half_of_each_tensor_missing(
    verl_run: WrittenVerl, tmp_path: Path
) -> None:
    """Rank 1's model file replaced by rank 0's: every shard records mesh coordinate 0, so the two halves of
    each tensor are the same half. Their element count is the tensor's; structural verify still names the gap
    (before, only convert and `verify --deep` found it)."""
    run = _run(verl_run, tmp_path)
    actor = run / "global_step_2" / "actor"
    shutil.copyfile(actor / "model_world_size_2_rank_0.pt", actor / "model_world_size_2_rank_1.pt")
    problems = verify_checkpoint(str(run / "global_step_2")).problems
    assert [(p.kind, p.path) for p in problems] == [(ProblemKind.COVERAGE, "actor/")]
    assert "overlap" in problems[0].message


def _poison(victim: Path) -> None:
    """Replace the torch.save file's data.pkl with a pickle that would run `posix.system`."""
    with zipfile.ZipFile(victim) as z:
        members = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in members if n.endswith("/data.pkl"))
    members[pkl] = b"\x80\x02cposix\nsystem\nX\x05\x00\x00\x00touch\x85R."
    with zipfile.ZipFile(victim, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)


@pytest.mark.parametrize(
    "victim", ["actor/model_world_size_2_rank_0.pt", "critic/extra_state_world_size_2_rank_1.pt", "data.pt"]
)
def test_a_hostile_file_is_refused_and_not_run(verl_run: WrittenVerl, tmp_path: Path, victim: str) -> None:
    run = _run(verl_run, tmp_path)
    _poison(run / "global_step_2" / victim)
    problems = verify_checkpoint(str(run / "global_step_2")).problems
    assert (ProblemKind.UNSAFE_PICKLE, victim) in [(p.kind, p.path) for p in problems]


def test_prune_keeps_the_trackers_step(verl_run: WrittenVerl, tmp_path: Path, run_cli: Cli) -> None:
    run = _run(verl_run, tmp_path)
    (run / TRACKER).write_text("1")  # the tracker names the older step (a resume that saved nothing yet)
    result = run_cli("prune", run, "--keep-last", "1", "--grace", "0s", "--yes", "--json")
    assert result.exit_code == 0  # it notes that a pointer keeps a checkpoint no rule keeps
    assert "note: global_step_1 is protected (named by the run's latest pointer)" in result.stderr
    assert sorted(p.name for p in run.iterdir()) == ["global_step_1", "global_step_2", TRACKER]
    kept = {io.name_of(k["url"]): k["reasons"] for k in result.json["keep"]}
    assert "named by the run's latest pointer" in kept["global_step_1"]


def test_resume_plan_gives_verls_own_settings(verl_run: WrittenVerl, tmp_path: Path, run_cli: Cli) -> None:
    run = _run(verl_run, tmp_path)
    latest = run_cli("resume-plan", run, "--json")
    assert latest.exit_code == 0, latest.stderr
    assert latest.json["checkpoint"]["url"] == str(run / "global_step_2")
    assert latest.json["resume_hint"] == (
        f"trainer.resume_mode=auto trainer.default_local_dir={run}  # its {TRACKER} names global_step_2"
    )
    older = run_cli("resume-plan", run / "global_step_1", "--json")
    assert older.exit_code == 0, older.stderr
    assert older.json["resume_hint"] == (
        f"trainer.resume_mode=resume_path trainer.resume_from_path={run / 'global_step_1'}"
    )
    assert (
        f"{TRACKER} names global_step_2: resume_mode=auto would load that step, not this one" in older.json["warnings"]
    )
    other_world = run_cli("resume-plan", run, "--world-size", "4", "--json")
    assert other_world.json["world_size"]["ok"] is False


def test_diff_of_two_steps_reads_the_merged_tensors(verl_run: WrittenVerl, run_cli: Cli) -> None:
    result = run_cli("diff", verl_run.step(1), verl_run.step(2), "--json")
    assert result.json["only_in_a"] == [] and result.json["only_in_b"] == []
    assert {c["a"]["shape"][0] for c in result.json["changed"] if c["name"] == "model.embed_tokens.weight"} == {128}


def _assert_equal_to_merger(output: Path, merged: Path) -> dict[str, torch.Tensor]:
    ours = load_file(str(output / "model.safetensors"))
    theirs = load_file(str(merged / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        # verl's merger writes bfloat16 (it builds the model `torch_dtype=torch.bfloat16` and saves it with the
        # merged state dict, base_model_merger.py `save_hf_model_and_tokenizer`); ckptctl keeps the stored
        # float32: equal once rounded the same way.
        assert ours[name].dtype == torch.float32 and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name].to(tensor.dtype), tensor), name
    return ours


def test_convert_the_actor_equals_verls_own_merger(verl_run: WrittenVerl, tmp_path: Path, run_cli: Cli) -> None:
    """`convert` of a step writes its actor from the rank shards, with `huggingface/`'s config and tokenizer;
    transformers loads it and every tensor equals what verl's own merger (`verl.model_merger`) wrote."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = run_cli("convert", verl_run.step(2), tmp_path / "hf", "--to", "hf", "--json")
    assert result.exit_code == 0, result.stderr
    assert f"config.json taken from {verl_run.step(2) / 'actor' / 'huggingface'}" in result.json["warnings"]
    ours = _assert_equal_to_merger(tmp_path / "hf", verl_run.merged_actor)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ours[name]), name
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf")).vocab_size == model.config.vocab_size

    # Cast as verl's merger casts, the output is its output bit for bit.
    cast = run_cli("convert", verl_run.step(2), tmp_path / "bf16", "--to", "hf", "--dtype", "bf16", "--json")
    assert cast.exit_code == 0, cast.stderr
    theirs = load_file(str(verl_run.merged_actor / "model.safetensors"))
    assert load_file(str(tmp_path / "bf16" / "model.safetensors")).keys() == theirs.keys()
    for name, tensor in load_file(str(tmp_path / "bf16" / "model.safetensors")).items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name


def test_replicated_shards_are_taken_once(verl_run: WrittenVerl, tmp_path: Path, run_cli: Cli) -> None:
    """The critic was sharded on verl's HSDP mesh ("ddp", "fsdp") of shape (2, 1): every parameter is
    `(Replicate(), Shard(0))` and both rank files hold it whole. Each keeps its shape (never concatenated
    across the replicas, verl PR#7610) and equals verl's merger's output (checked against the model verl's critic
    is: tests/ops/test_convert_value_heads.py)."""
    critic = verl_run.step(2) / "critic"
    result = run_cli("convert", critic, tmp_path / "critic", "--to", "hf", "--json")
    assert result.exit_code == 0, result.stderr
    ours = _assert_equal_to_merger(tmp_path / "critic", verl_run.merged_critic)
    assert ours["score.bias"].shape == (1,)
    assert ours["model.embed_tokens.weight"].shape == (128, 32)
    index = {t.name: t for t in open_checkpoint(str(critic)).tensors(Component.MODEL)}
    assert [c.file for c in index["score.bias"].chunks] == ["model_world_size_2_rank_0.pt"]


@pytest.fixture
def skyrl_run(verl_run: WrittenVerl, tmp_path: Path) -> Path:
    """The same files in SkyRL's arrangement (skyrl/backends/skyrl_train/distributed/fsdp_strategy.py
    `save_checkpoint` writes verl's file names, `fsdp_config.json` and `huggingface/`; the trainer names the
    roles `policy/` and `critic/`, adds `trainer_state.pt` and writes `latest_ckpt_global_step.txt`,
    docs/content/docs/checkpointing-logging/checkpointing.mdx)."""
    run = tmp_path / "skyrl"
    for step in verl_run.steps:
        folder = copy_tree(verl_run.step(step), run / f"global_step_{step}")
        (folder / "actor").rename(folder / "policy")
        (folder / "data.pt").rename(folder / "trainer_state.pt")
    (run / "latest_ckpt_global_step.txt").write_text("1")
    return run


def test_skyrl_runs_list_and_convert_their_policy(skyrl_run: Path, tmp_path: Path, run_cli: Cli) -> None:
    refs = [(io.name_of(r.url), r.layout, r.state, r.latest) for r in scan_run(str(skyrl_run))]
    complete = CheckpointState.COMPLETE
    assert refs == [("global_step_1", "verl", complete, True), ("global_step_2", "verl", complete, False)]
    ckpt = open_checkpoint(str(skyrl_run))  # the step the tracker names
    assert ckpt.ref.step == 1 and ckpt.metadata["tensors_of"] == "policy"
    assert Component.TRAINER_STATE in ckpt.components
    result = run_cli("convert", skyrl_run / "global_step_1", tmp_path / "hf", "--to", "hf", "--json")
    assert result.exit_code == 0, result.stderr
    shutil.rmtree(tmp_path / "hf")
