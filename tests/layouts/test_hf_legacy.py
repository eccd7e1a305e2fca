"""Legacy `pytorch_model.bin` model folders (one file, and shards with their index) and a lone weights file:
indexed through the torch-zip reader (nothing unpickled with code), inspected, verified and diffed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptctl.checkpoint import CheckpointState, Component, ProblemKind
from ckptctl.formats.chunks import read_tensor
from ckptctl.layouts import detect, open_checkpoint
from ckptctl.ops.verification import verify_checkpoint
from tests.conftest import CliResult, copy_tree
from tests.writers.hf_legacy_writer import WrittenLegacy

Cli = Callable[..., CliResult]


def _unique(reference: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """The tensors a tied model holds once: transformers' own safetensors save leaves `lm_head.weight` out."""
    return {k: v for k, v in reference.items() if not (tied and k == "lm_head.weight")}


@pytest.mark.parametrize("variant", ["single", "sharded"])
def test_every_tensor_is_indexed_where_torch_save_put_it(legacy_models: WrittenLegacy, variant: str) -> None:
    folder = getattr(legacy_models, variant)
    reference = legacy_models.reference(folder)
    checkpoint = open_checkpoint(str(folder))
    assert checkpoint.layout == "hf" and {Component.MODEL, Component.CONFIG} <= checkpoint.components
    index = {t.name: t for t in checkpoint.tensor_index()}
    want = _unique(reference, tied=variant == "sharded")
    assert sorted(index) == sorted(want)
    for name, tensor in want.items():
        assert (index[name].dtype, index[name].shape) == ("float32", tuple(tensor.shape)), name
        assert torch.equal(read_tensor(checkpoint.url, index[name]), tensor), name
    assert checkpoint.metadata["weight_files"] == len(list(folder.glob("pytorch_model*.bin")))
    assert "not indexed" not in json.dumps(checkpoint.metadata)
    if variant == "sharded":
        assert checkpoint.metadata["weight_files"] >= 4


@pytest.mark.parametrize("variant", ["single", "sharded"])
def test_inspect_counts_the_parameters_once(run_cli: Cli, legacy_models: WrittenLegacy, variant: str) -> None:
    folder = getattr(legacy_models, variant)
    want = _unique(legacy_models.reference(folder), tied=variant == "sharded")
    result = run_cli("inspect", folder, "--json")
    assert result.exit_code == 0, result.stderr
    totals = result.json["totals"]
    assert totals["parameters"] == sum(t.numel() for t in want.values())
    assert totals["bytes"] == sum(t.numel() * 4 for t in want.values())


def test_a_lone_bin_file_inspects_and_diffs_equal_to_its_folder(run_cli: Cli, legacy_models: WrittenLegacy) -> None:
    lone = legacy_models.single / "pytorch_model.bin"
    reference = legacy_models.reference(legacy_models.single)
    inspected = run_cli("inspect", lone, "--json")
    assert inspected.exit_code == 0 and inspected.json["layout"] == "torch"
    assert inspected.json["totals"]["parameters"] == sum(t.numel() for t in reference.values())
    diffed = run_cli("diff", lone, legacy_models.single, "--json")
    assert diffed.exit_code == 0, diffed.stderr
    assert diffed.json["equal"] and not diffed.json["only_in_a"] and not diffed.json["only_in_b"]


def test_clean_folders_verify(legacy_models: WrittenLegacy) -> None:
    for folder in (legacy_models.single, legacy_models.sharded):
        result = verify_checkpoint(str(folder))
        assert result.ok, result.problems


@pytest.mark.parametrize(("variant", "keep"), [("single", 1000), ("sharded", -300)])
def test_a_truncated_bin_fails_verify(
    run_cli: Cli, legacy_models: WrittenLegacy, tmp_path: Path, variant: str, keep: int
) -> None:
    folder = copy_tree(getattr(legacy_models, variant), tmp_path / "m")
    victim = sorted(folder.glob("pytorch_model*.bin"))[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[:keep])
    for deep in ((), ("--deep",)):
        result = run_cli("verify", folder, "--json", *deep)
        assert result.exit_code == 1, (deep, result.stdout, result.stderr)
        problems = result.json["problems"]
        assert any(p["kind"] == ProblemKind.TRUNCATED and p["path"] == victim.name for p in problems), problems


def test_a_missing_legacy_shard_is_broken(legacy_models: WrittenLegacy, tmp_path: Path) -> None:
    folder = copy_tree(legacy_models.sharded, tmp_path / "m")
    victim = sorted(folder.glob("pytorch_model-*.bin"))[1]
    victim.unlink()
    _, ref = detect(str(folder))
    assert ref.state is CheckpointState.BROKEN and victim.name in ref.note
    result = verify_checkpoint(str(folder))
    assert any(p.kind == ProblemKind.MISSING_FILE and p.path == victim.name for p in result.problems)


def test_the_index_must_match_the_shards(legacy_models: WrittenLegacy, tmp_path: Path) -> None:
    folder = copy_tree(legacy_models.sharded, tmp_path / "m")
    index_file = folder / "pytorch_model.bin.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][name] = shards[1]
    index_file.write_text(json.dumps(index))
    result = verify_checkpoint(str(folder))
    assert not result.ok
    assert any(p.path == shards[1] and name in p.message for p in result.problems), result.problems


def test_a_folder_with_both_formats_reads_the_safetensors(legacy_models: WrittenLegacy, tmp_path: Path) -> None:
    """As transformers does: safetensors win. The bins are still verified (a hub repo often has both)."""
    folder = copy_tree(legacy_models.tied, tmp_path / "both")
    (folder / "pytorch_model.bin").write_bytes((legacy_models.single / "pytorch_model.bin").read_bytes()[:2000])
    checkpoint = open_checkpoint(str(folder))
    assert "lm_head.weight" not in {t.name for t in checkpoint.tensor_index()}  # the tied export's own tensors
    result = verify_checkpoint(str(folder))
    assert [p.path for p in result.problems] == ["pytorch_model.bin"]
