"""verl W -> W' (`ckptctl.frameworks.verl.reshard.WRITER`): verl 0.9.1's own `FSDPCheckpointManager.load_checkpoint`
loads what it wrote on 1 rank (from verl's 2-rank save) and on 2 ranks (from verl's 1-rank save), and the state it
then holds equals the source's exactly (`tests.writers.verl_reshard_proof`); torn sources and world sizes that
would leave ranks without a piece of a tensor are refused by name before anything is written."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import TRAINING_STATE_WRITER
from ckptctl.formats.dtensor import state_tensors
from ckptctl.formats.dtensor_classes import DTENSOR_PICKLE_GLOBALS, DTensorRef
from ckptctl.formats.torch_pickle import open_torch_pickle
from ckptctl.frameworks.verl.layout import VerlLayout
from ckptctl.frameworks.verl.reshard import WRITER
from ckptctl.layouts import capability, open_checkpoint
from tests.conftest import CliResult, build_once
from tests.ops.same_state import assert_same_state as _assert_same
from tests.writers.verl_reshard_proof import ROLES, VerlReshardProof, prove_verl_reshard
from tests.writers.verl_writer import WrittenVerl

Cli = Callable[..., CliResult]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def verl_reshard(tmp_path_factory: pytest.TempPathFactory, verl_run: WrittenVerl) -> VerlReshardProof:
    return build_once(tmp_path_factory, "verl-reshard", lambda root: prove_verl_reshard(root, verl_run))


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=False)  # written by the proof's own ranks, not a user file


@pytest.mark.parametrize(("loaded", "source"), [("loaded_1", "source_2"), ("loaded_2", "source_1")])
def test_verl_loads_the_resharded_state_equal_to_the_source(
    verl_reshard: VerlReshardProof, loaded: str, source: str
) -> None:
    got, want = _load(verl_reshard.states[loaded]), _load(verl_reshard.states[source])
    assert list(got) == list(want) == list(ROLES)
    for role in ROLES:
        assert got[role]["model"] and got[role]["optim"]["state"]
        _assert_same(got[role], want[role], role)


def test_each_rank_resumes_with_its_rng_and_new_ranks_with_rank_0s(
    verl_reshard: VerlReshardProof, verl_run: WrittenVerl
) -> None:
    # 2 -> 1: rank 0 keeps its own extra state; 1 -> 2: rank 0 its own, rank 1 rank 0's (verl seeds all ranks
    # alike), byte for byte, and verl restores the RNG from it.
    cases = (
        (verl_reshard.to_one[0], verl_run.step(2), 2, {0: 0}),
        (verl_reshard.to_two[0], verl_reshard.one_rank_run / "global_step_2", 1, {0: 0, 1: 0}),
    )
    for folder, source, world, origins in cases:
        for role in ROLES:
            for rank, origin in origins.items():
                got = folder / "global_step_2" / role / f"extra_state_world_size_{len(origins)}_rank_{rank}.pt"
                want = source / role / f"extra_state_world_size_{world}_rank_{origin}.pt"
                assert got.read_bytes() == want.read_bytes()
    states = verl_reshard.states["source_1"].parent
    assert torch.equal(_load(states / "loaded_1_rng_rank0.pt"), _load(states / "source_2_rng_rank0.pt"))
    for rank in (0, 1):
        assert torch.equal(_load(states / f"loaded_2_rng_rank{rank}.pt"), _load(states / "source_1_rng_rank0.pt"))


def test_the_written_run_is_a_whole_verl_save_with_the_tracker_last(verl_reshard: VerlReshardProof) -> None:
    for folder, written in (verl_reshard.to_one, verl_reshard.to_two):
        world = written.world_size
        assert world in (1, 2)
        files = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
        assert set(written.files) == files
        assert written.files[-1] == "latest_checkpointed_iteration.txt"
        assert (folder / "latest_checkpointed_iteration.txt").read_text() == "2"
        for role in ROLES:
            role_files = [f for f in written.files if f.startswith(f"global_step_2/{role}/")]
            assert role_files[-1] == f"global_step_2/{role}/fsdp_config.json"  # after its rank files, as verl
            config = json.loads((folder / "global_step_2" / role / "fsdp_config.json").read_text())
            assert config == {"FSDP_version": 2, "world_size": world}
            for kind in ("model", "optim", "extra_state"):
                assert {f"{kind}_world_size_{world}_rank_{r}.pt" for r in range(world)} <= {
                    Path(f).name for f in role_files
                }
            assert (folder / "global_step_2" / role / "huggingface" / "config.json").is_file()
        assert (folder / "global_step_2" / "data.pt").is_file()
        # ckptctl's own reader takes what it wrote: every shard placed, nothing missing.
        checkpoint = open_checkpoint(str(folder / "global_step_2"))
        assert checkpoint.world_size == world
        assert VerlLayout().verify(checkpoint) == []
        assert written.tensors == sum(1 for _ in checkpoint.tensor_index()) + sum(1 for _ in _critic_index(folder))


def _critic_index(folder: Path) -> Any:
    return open_checkpoint(str(folder / "global_step_2" / "critic")).tensor_index()


def test_not_carried_and_the_hint_name_the_rng_and_the_meshes(verl_reshard: VerlReshardProof) -> None:
    _, to_one = verl_reshard.to_one
    _, to_two = verl_reshard.to_two
    assert [n.what for n in to_one.not_carried] == [f"global_step_2/{role}/extra_state.rng" for role in ROLES]
    assert "rank 1 is dropped" in to_one.not_carried[0].why
    assert "rank 1 has no RNG state of its own" in to_two.not_carried[0].why
    assert to_one.resume_hint is not None and "on 1 rank" in to_one.resume_hint
    assert to_two.resume_hint is not None and "actor fsdp_size=-1, critic fsdp_size=-1" in to_two.resume_hint


def test_the_writer_is_verls_training_state_writer(verl_run: WrittenVerl) -> None:
    checkpoint = open_checkpoint(str(verl_run.step(2)))
    assert capability(checkpoint.ref.layout, TRAINING_STATE_WRITER) is WRITER
    assert WRITER.refusal(checkpoint, 1) is None
    assert WRITER.refusal(checkpoint, 2) is None


def _copy_step(verl_run: WrittenVerl, tmp_path: Path) -> Path:
    step = tmp_path / "run" / "global_step_2"
    shutil.copytree(verl_run.step(2), step)
    return step


def _refusal(step: Path, world: int) -> str | None:
    checkpoint: Checkpoint = open_checkpoint(str(step))
    return WRITER.refusal(checkpoint, world)


def test_a_torn_source_is_refused_naming_the_missing_file(verl_run: WrittenVerl, tmp_path: Path) -> None:
    step = _copy_step(verl_run, tmp_path)
    (step / "critic" / "optim_world_size_2_rank_1.pt").unlink()
    refused = _refusal(step, 1)
    assert refused is not None and refused.endswith("critic/optim_world_size_2_rank_1.pt is missing: the save is torn")


def test_a_dimension_shorter_than_the_ranks_is_cut_as_fsdp2_cuts_it(verl_reshard: VerlReshardProof) -> None:
    # The critic's value head (1, hidden) on 2 ranks: FSDP2 leaves rank 1 an empty piece, and verl loads that
    # (test_verl_loads_the_resharded_state_equal_to_the_source[loaded_2-source_1]), so it is written, not refused.
    folder, _ = verl_reshard.to_two
    critic = folder / "global_step_2" / "critic"
    opened = open_torch_pickle(str(critic / "model_world_size_2_rank_1.pt"), None, DTENSOR_PICKLE_GLOBALS)
    head = dict(state_tensors(opened.root))["score.weight"]
    assert isinstance(head, DTensorRef) and head.shape == (1, 32) and head.local.shape == (0, 32)
    assert WRITER.refusal(open_checkpoint(str(verl_reshard.one_rank_run / "global_step_2")), 64) is None


def test_a_world_size_below_one_is_refused(verl_run: WrittenVerl) -> None:
    assert WRITER.refusal(open_checkpoint(str(verl_run.step(2))), 0) == "world size 0: a verl run has at least one rank"


def test_the_command_reshards_a_verl_step_and_the_result_lists_and_verifies(
    run_cli: Cli, verl_run: WrittenVerl, tmp_path: Path
) -> None:
    dst = tmp_path / "resharded"
    before = run_cli("resume-plan", verl_run.step(2), "--world-size", "1", "--json").json
    assert before["world_size_ok"] is False
    assert before["world_size"]["fix"].startswith(f"ckptctl reshard {verl_run.step(2)} NEW_RUN_DIR --world-size 1")
    result = run_cli("reshard", verl_run.step(2), dst, "--world-size", "1", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["to"] == "verl" and result.json["world_size"] == 1
    assert {c["what"] for c in result.json["not_carried"]} == {f"global_step_2/{r}/extra_state.rng" for r in ROLES}
    assert sorted(p.name for p in (dst / "global_step_2" / "actor").glob("*_world_size_*")) == [
        "extra_state_world_size_1_rank_0.pt",
        "model_world_size_1_rank_0.pt",
        "optim_world_size_1_rank_0.pt",
    ]
    listed = run_cli("list", dst, "--json").json["checkpoints"]
    assert [(c["step"], c["state"], c["roles"]) for c in listed] == [(2, "complete", ["actor", "critic"])]
    assert run_cli("verify", dst).exit_code == 0
    after = run_cli("resume-plan", dst, "--world-size", "1", "--json").json
    assert after["checkpoint"]["step"] == 2 and after["world_size_ok"] is True
    again = run_cli("reshard", verl_run.step(2), dst, "--world-size", "1")
    assert again.exit_code == 2  # DST is not empty
