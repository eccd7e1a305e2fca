"""`reshard --to dcp` (`ckptctl.frameworks.dcp.reshard.WRITER`): a DCP save of FSDP2 + AdamW and ckptctl's own
multi-rank checkpoint of the same state, written as `get_state_dict`-shaped DCP folders, load on 1 and on 2 gloo
ranks with `dcp.load` + `set_state_dict` into a full state equal to the source's own resume's, exactly, and one
training step from them gives the same losses (`tests.writers.reshard_dcp_proof`); torn sources and states
whose optimizer is keyed by index are refused before anything is written."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptctl.contract.capabilities import TRAINING_STATE_SOURCE, TRAINING_STATE_WRITER
from ckptctl.errors import CkptctlError
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import FileRecord
from ckptctl.frameworks.dcp.reshard import WRITER
from ckptctl.layouts import capability, open_checkpoint
from ckptctl.ops import commit
from tests.conftest import CliResult, build_once
from tests.ops.same_state import assert_same_state as _assert_same
from tests.writers.reshard_dcp_proof import DcpReshardProof, VerlToDcpProof, prove_dcp_reshard, prove_verl_to_dcp
from tests.writers.verl_writer import WrittenVerl

pytestmark = pytest.mark.slow


Cli = Callable[..., CliResult]


@pytest.fixture(scope="session")
def dcp_reshard(tmp_path_factory: pytest.TempPathFactory) -> DcpReshardProof:
    return build_once(tmp_path_factory, "dcp-reshard", prove_dcp_reshard)


@pytest.fixture(scope="session")
def verl_to_dcp(tmp_path_factory: pytest.TempPathFactory, verl_run: WrittenVerl) -> VerlToDcpProof:
    actor = verl_run.step(2) / "actor"
    return build_once(tmp_path_factory, "verl-to-dcp", lambda root: prove_verl_to_dcp(root, verl_run.base_model, actor))


def test_the_dcp_writer_is_registered_with_sources_for_dcp_and_native() -> None:
    assert capability("dcp", TRAINING_STATE_WRITER) is WRITER
    assert WRITER.target == "dcp"
    assert capability("dcp", TRAINING_STATE_SOURCE) is not None
    assert capability("native", TRAINING_STATE_SOURCE) is not None
    assert capability("verl", TRAINING_STATE_SOURCE) is not None


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(
    ("resharded", "source"), [("resharded-dcp", "source-dcp"), ("resharded-native", "source-native")]
)
def test_fsdp2_loads_the_resharded_state_equal_to_the_sources_own_resume(
    dcp_reshard: DcpReshardProof, world_size: int, resharded: str, source: str
) -> None:
    results = dcp_reshard.results(world_size)
    got, want = results[resharded], results[source]
    assert want["optim"]["state"] and len(want["optim"]["param_groups"]) == 2
    assert want["optim"]["param_groups"][0]["weight_decay"] == 0.1
    assert {k: v for k, v in want["optim"]["param_groups"][0].items() if k != "params"}["betas"] == (0.8, 0.95)
    _assert_same(got["model"], want["model"], "model")
    _assert_same(got["optim"], want["optim"], "optim")
    # One step from each: the same losses, to the bit (same world size, same reduction order).
    assert got["losses"] == want["losses"]


def test_both_sources_give_the_same_state(dcp_reshard: DcpReshardProof) -> None:
    results = dcp_reshard.results(2)
    _assert_same(results["resharded-native"]["model"], results["resharded-dcp"]["model"], "model")
    _assert_same(results["resharded-native"]["optim"], results["resharded-dcp"]["optim"], "optim")


def test_the_keys_and_nested_paths_are_torchs_own(dcp_reshard: DcpReshardProof) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    source = FileSystemReader(str(dcp_reshard.root / "dcp")).read_metadata()
    written = FileSystemReader(str(dcp_reshard.root / "out-dcp")).read_metadata()
    kept = {k: v for k, v in source.planner_data.items() if not k.startswith("trainer_state.")}
    assert written.planner_data == kept
    assert sorted(written.state_dict_metadata) == sorted(kept)


def test_not_carried_names_what_the_output_leaves_out(dcp_reshard: DcpReshardProof) -> None:
    assert [what for what, _ in dcp_reshard.written["dcp"]["not_carried"]] == ["trainer_state"]
    native = dict(dcp_reshard.written["native/step-2"]["not_carried"])
    assert set(native) == {"scheduler", "rng", "step"}
    assert "scheduler.json" in native["scheduler"] and "(2)" in native["step"]
    assert dcp_reshard.written["dcp"]["files"] == ("__0_0.distcp", ".metadata")


@pytest.mark.parametrize("source", ["dcp", "native/step-2"])
def test_a_torn_source_is_refused_naming_the_file(dcp_reshard: DcpReshardProof, tmp_path: Path, source: str) -> None:
    torn = tmp_path / "torn"
    shutil.copytree(dcp_reshard.root / source, torn)
    data = torn / ("dcp" if source.startswith("native") else "") / "__1_0.distcp"
    data.unlink()
    reason = WRITER.refusal(open_checkpoint(str(torn)), None)
    assert reason is not None and str(data) in reason and "missing" in reason


def test_a_truncated_data_file_is_refused_naming_it(dcp_reshard: DcpReshardProof, tmp_path: Path) -> None:
    torn = tmp_path / "torn"
    shutil.copytree(dcp_reshard.root / "dcp", torn)
    data = torn / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-10])
    reason = WRITER.refusal(open_checkpoint(str(torn)), None)
    assert reason is not None and str(data) in reason and "truncated" in reason


def test_a_single_process_native_save_is_refused_its_optimizer_keyed_by_index(tmp_path: Path) -> None:
    from ckptctl import CheckpointManager

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(str(tmp_path / "run"))
    manager.save(1, {"model": model, "optimizer": optimizer})
    manager.close()
    reason = WRITER.refusal(open_checkpoint(str(tmp_path / "run" / "step-1")), None)
    assert reason is not None and "keyed by parameter index" in reason


def test_a_layout_without_a_source_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "hf").mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "config.json").write_text("{}")
    checkpoint = open_checkpoint(str(tmp_path / "hf"))
    reason = WRITER.refusal(checkpoint, None)
    assert reason is not None and checkpoint.layout in reason


def test_verls_actor_resharded_to_dcp_resumes_on_1_and_2_ranks_as_verl_resumes_it(verl_to_dcp: VerlToDcpProof) -> None:
    # verl's own load of its 2-rank save, on 2 ranks, is the reference; the DCP output loaded on 2 ranks and on 1
    # holds the same full state, and one step gives the same losses to the bit (each rank's batch is the same, and
    # FSDP2's halved gradients of 2 ranks sum to the 1-rank gradient exactly).
    want = verl_to_dcp.results(2)["verl"]
    assert want["optim"]["state"] and len(want["optim"]["param_groups"]) == 1
    for world_size in (1, 2):
        got = verl_to_dcp.results(world_size)["dcp"]
        _assert_same(got["model"], want["model"], f"model@{world_size}")
        _assert_same(got["optim"], want["optim"], f"optim@{world_size}")
        assert got["losses"] == want["losses"]
    assert {what for what, _ in verl_to_dcp.written["not_carried"]} == {
        "extra_state.lr_scheduler",
        "extra_state.rng",
        "huggingface/",
        "data.pt",
    }


def test_a_verl_step_folder_is_refused_naming_its_roles(verl_run: WrittenVerl) -> None:
    reason = WRITER.refusal(open_checkpoint(str(verl_run.step(2))), None)
    assert reason is not None and "actor, critic" in reason


def test_a_torn_verl_role_is_refused_naming_the_file(verl_run: WrittenVerl, tmp_path: Path) -> None:
    torn = tmp_path / "actor"
    shutil.copytree(verl_run.step(2) / "actor", torn)
    (torn / "optim_world_size_2_rank_1.pt").unlink()
    reason = WRITER.refusal(open_checkpoint(str(torn)), None)
    assert reason is not None and str(torn / "optim_world_size_2_rank_1.pt") in reason


def test_a_verl_optimizer_that_cannot_be_matched_to_the_model_by_order_is_refused(tmp_path: Path) -> None:
    from ckptctl.contract.capabilities import StateTensor
    from ckptctl.families.param_state import name_indexed_state

    def tensor(*shape: int) -> StateTensor:
        return StateTensor("float32", shape, lambda: None)

    model = [("a.weight", tensor(2, 3)), ("b.weight", tensor(3, 2))]
    group = {"lr": 1.0, "params": [0, 1]}
    swapped = {0: {"exp_avg": tensor(3, 2)}, 1: {"exp_avg": tensor(2, 3)}}
    with pytest.raises(CkptctlError, match="not the model's"):
        name_indexed_state(model, swapped, [group], "optim.pt", "built")
    with pytest.raises(CkptctlError, match="2 parameter groups"):
        name_indexed_state(model, {}, [{"params": [0]}, {"params": [1]}], "optim.pt", "built")
    with pytest.raises(CkptctlError, match="buffers or tied copies"):
        name_indexed_state([*model, ("c", tensor(1))], {}, [group], "optim.pt", "built")
    named, groups = name_indexed_state(model, {0: {"exp_avg": tensor(2, 3), "step": 3}}, [group], "optim.pt", "built")
    assert list(named) == ["a.weight"] and groups == ({"lr": 1.0, "params": ["a.weight", "b.weight"]},)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_rows_split_over_files_load_the_same(
    dcp_reshard: DcpReshardProof, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One parameter row (the parameter, its moments and step) per data file: memory holds one row at a time, and
    # dcp.load reads the same state as from the one-file output.
    import torch.distributed.checkpoint as dcp

    from ckptctl.contract.capabilities import ReshardRequest
    from ckptctl.frameworks.dcp import reshard

    monkeypatch.setattr(reshard, "FILE_BYTES", 1)
    advanced: list[int] = []
    state = WRITER.write(
        ReshardRequest(open_checkpoint(str(dcp_reshard.root / "dcp")), str(tmp_path), None), advanced.append
    )
    model_rows = 9  # TinyNet's 8 parameters and its buffer
    assert state.files == (*(f"__0_{k}.distcp" for k in range(model_rows)), ".metadata")
    # Every file hashed while written, as the bytes on disk are.
    assert state.digests == {
        name: FileRecord((tmp_path / name).stat().st_size, file_digest(str(tmp_path / name))) for name in state.files
    }
    assert sum(advanced) == state.bytes and len(advanced) == model_rows
    reader = dcp.FileSystemReader(str(dcp_reshard.root / "out-dcp"))
    want = {
        key: torch.zeros(item.size, dtype=item.properties.dtype)
        for key, item in reader.read_metadata().state_dict_metadata.items()
        if hasattr(item, "size")
    }
    got = {key: torch.zeros_like(value) for key, value in want.items()}
    dcp.load(want, checkpoint_id=str(dcp_reshard.root / "out-dcp"), no_dist=True)
    dcp.load(got, checkpoint_id=str(tmp_path), no_dist=True)
    _assert_same(got, want, "state")


def test_the_command_writes_dcp_from_a_verl_role_and_says_what_it_did_not_carry(
    run_cli: Cli, verl_run: WrittenVerl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_back: list[str] = []
    monkeypatch.setattr(commit, "file_digest", lambda path: read_back.append(path) or file_digest(path))
    dst = tmp_path / "actor-dcp"
    result = run_cli("reshard", verl_run.step(2) / "actor", dst, "--to", "dcp", "--json")
    assert result.exit_code == 0, result.stderr
    assert read_back == []  # the digests file took what the writer hashed while writing: no file read back
    assert result.json["to"] == "dcp" and result.json["world_size"] is None
    assert {"extra_state.rng", "data.pt"} <= {c["what"] for c in result.json["not_carried"]}
    assert (dst / ".metadata").is_file()
    listed = run_cli("list", dst, "--json").json["checkpoints"]
    assert [(c["layout"], c["state"]) for c in listed] == [("dcp", "complete")]
    assert run_cli("verify", dst, "--deep").exit_code == 0
    refused = run_cli("reshard", verl_run.step(2), tmp_path / "other", "--to", "dcp")
    assert refused.exit_code == 2 and "actor" in refused.stderr and not (tmp_path / "other").exists()
