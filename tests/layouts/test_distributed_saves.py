"""Per-rank saves without a global index, as transformers and torch write them (tests/writers/distributed_save_writer.py):
`save_pretrained(distributed_checkpoint=True)` read by the hf layout, `dcp.save(use_collectives=False)` by the
dcp layout, each as whole tensors equal to the model that was saved."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import CliResult, copy_tree
from tests.writers.distributed_save_writer import WORLD_SIZE, WrittenDistributedSaves

Cli = Callable[..., CliResult]


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("variant", ["hf", "dcp"])
def test_list_inspect_verify_see_whole_tensors(
    distributed_saves: WrittenDistributedSaves, run_cli: Cli, variant: str
) -> None:
    folder = distributed_saves.hf if variant == "hf" else distributed_saves.dcp
    rows = run_cli("list", folder, "--json").json["checkpoints"]
    assert [(r["url"], r["layout"], r["state"]) for r in rows] == [(str(folder), variant, "complete")]

    doc = run_cli("inspect", folder, "--json").json
    assert doc["world_size"] == WORLD_SIZE
    assert doc["totals"]["parameters"] == distributed_saves.model_parameters
    reference = distributed_saves.reference()
    prefix = "model." if variant == "dcp" else ""  # the key the DCP state dict was saved under
    shapes = {t["name"].removeprefix(prefix): tuple(t["shape"]) for t in doc["tensors"]}
    assert shapes == {name: tuple(t.shape) for name, t in reference.items()}

    verified = run_cli("verify", folder, "--json")
    assert verified.exit_code == 0 and verified.json["ok"] is True, verified.stdout


@pytest.mark.parametrize("variant", ["hf", "dcp"])
def test_convert_to_hf_equals_the_saved_model(
    distributed_saves: WrittenDistributedSaves, run_cli: Cli, tmp_path: Path, variant: str
) -> None:
    from transformers import AutoModelForCausalLM

    folder = distributed_saves.hf if variant == "hf" else distributed_saves.dcp
    result = run_cli("convert", folder, tmp_path / "out", "--config", distributed_saves.source, "--json")
    assert result.exit_code == 0, result.stderr
    _assert_equal(
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).state_dict(), distributed_saves.reference()
    )
    assert run_cli("diff", folder, distributed_saves.source, "--json").json["equal"] is True


def test_a_lost_rank_of_the_hf_shards_fails_verify(
    distributed_saves: WrittenDistributedSaves, run_cli: Cli, tmp_path: Path
) -> None:
    folder = copy_tree(distributed_saves.hf, tmp_path / "hf")
    (folder / "shard-00001-model-00001-of-00001.safetensors").unlink()
    result = run_cli("verify", folder, "--json")
    assert result.exit_code == 1
    kinds = {(p["kind"], p["path"]) for p in result.json["problems"]}
    assert ("missing_file", "shard-00001-model-00001-of-00001.safetensors") in kinds
    assert any(kind == "coverage" for kind, _ in kinds)  # rank 2's pieces start half-way


def test_a_lost_last_rank_is_a_missing_file_and_never_half_a_model(
    distributed_saves: WrittenDistributedSaves, run_cli: Cli, tmp_path: Path
) -> None:
    """Rank 1's pieces alone tile a model of half the rows; config.json (vocab_size, hidden_size) and the
    embeddings' width against the norms' length show what is missing: list says broken and names the file,
    verify names it (exit 1), inspect gives the whole shapes, and convert refuses."""
    folder = copy_tree(distributed_saves.hf, tmp_path / "hf")
    lost = "shard-00002-model-00001-of-00001.safetensors"
    (folder / lost).unlink()
    (row,) = run_cli("list", folder, "--json").json["checkpoints"]
    assert row["state"] == "broken" and lost in row["note"]

    result = run_cli("verify", folder, "--json")
    assert result.exit_code == 1
    problems = {(p["kind"], p["path"]): p["message"] for p in result.json["problems"]}
    assert problems[("missing_file", lost)] == f"{lost} is missing: the pieces of rank plan 2"
    assert "lm_head.weight [128, 32] (config.json's shape" in problems[("coverage", "lm_head.weight")]

    doc = run_cli("inspect", folder, "--json").json
    shapes = {t["name"]: tuple(t["shape"]) for t in doc["tensors"]}
    assert shapes["lm_head.weight"] == (128, 32) and shapes["model.norm.weight"] == (32,)
    refused = run_cli("convert", folder, tmp_path / "out")
    assert refused.exit_code == 2 and lost in refused.stderr and not (tmp_path / "out").exists()

    # Without config.json the norms are held against the embeddings' width.
    (folder / "config.json").unlink()
    (row,) = run_cli("list", folder, "--json").json["checkpoints"]
    assert row["state"] == "broken" and lost in row["note"]


def test_a_rank_without_its_metadata_is_an_unfinished_dcp_save(
    distributed_saves: WrittenDistributedSaves, run_cli: Cli, tmp_path: Path
) -> None:
    """Each rank writes its `__{rank}.metadata` after its data: rank 1's data without it is a save under way."""
    folder = copy_tree(distributed_saves.dcp, tmp_path / "dcp")
    (folder / "__1.metadata").unlink()
    assert [r["state"] for r in run_cli("list", folder, "--json").json["checkpoints"]] == ["in_progress"]
    result = run_cli("verify", folder, "--json")
    assert result.exit_code == 1
    (problem,) = result.json["problems"]  # its files are fresh: a save under way
    assert problem["kind"] == "in_progress" and "__1.metadata not written yet" in problem["message"]


def test_a_dcp_save_without_collectives_loads_only_on_its_ranks(
    distributed_saves: WrittenDistributedSaves, run_cli: Cli
) -> None:
    same = run_cli("resume-plan", distributed_saves.dcp, "--json").json
    assert same["world_size_ok"] is True
    other = run_cli("resume-plan", distributed_saves.dcp, "--world-size", "4", "--json").json
    assert other["world_size_ok"] is False
    assert "--to dcp" in other["world_size"]["fix"]
