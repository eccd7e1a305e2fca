"""`inspect`, `verify` and `diff` of single weights files (issue 11): a `*.safetensors` file and a torch.save
zip (`*.pt`, `*.bin`, `*.pth`), both read without running anything in them."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CliResult
from tests.writers.trainer_writer import WrittenTrainerRun

Cli = Callable[..., CliResult]


@pytest.fixture
def files(hf_model_dirs: dict[str, Path], tmp_path: Path) -> dict[str, Path]:
    """The tiny Llama as transformers saved it (`model.safetensors`) and as `torch.save(state_dict)` wrote it,
    under the names people give such files."""
    bin_file = tmp_path / "pytorch_model.bin"
    shutil.copyfile(hf_model_dirs["reference"], bin_file)
    return {"safetensors": hf_model_dirs["single"] / "model.safetensors", "bin": bin_file}


@pytest.mark.parametrize(("kind", "layout"), [("safetensors", "safetensors"), ("bin", "torch")])
def test_inspect_a_single_file(run_cli: Cli, files: dict[str, Path], kind: str, layout: str) -> None:
    reference = torch.load(files["bin"], weights_only=True)
    result = run_cli("inspect", files[kind], "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert doc["url"] == str(files[kind]) and doc["layout"] == layout and doc["components"] == ["model"]
    assert {t["name"]: t["shape"] for t in doc["tensors"]} == {k: list(v.shape) for k, v in reference.items()}
    assert doc["totals"]["parameters"] == sum(v.numel() for v in reference.values())
    assert doc["size_bytes"] == files[kind].stat().st_size
    human = run_cli("inspect", files[kind], "--filter", "embed_tokens")
    assert human.exit_code == 0 and "model.embed_tokens.weight" in human.stdout


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_verify_a_single_file_deeply(run_cli: Cli, files: dict[str, Path], kind: str) -> None:
    result = run_cli("verify", files[kind], "--deep", "--check-finite", "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["ok"] is True and result.json["tensors_read"] == len(load_file(files["safetensors"]))


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_verify_a_truncated_file_fails(run_cli: Cli, files: dict[str, Path], tmp_path: Path, kind: str) -> None:
    cut = tmp_path / f"cut-{files[kind].name}"
    data = files[kind].read_bytes()
    cut.write_bytes(data[: len(data) // 2] if kind == "safetensors" else data[:-4096] + data[-22:])
    result = run_cli("verify", cut, "--json")
    assert result.exit_code == 1, result.stdout
    assert result.json["ok"] is False and result.json["problems"][0]["kind"] in ("truncated", "bad_metadata")


class _Touch:
    """Pickles as a call of `subprocess.Popen` that would create a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        import subprocess

        return subprocess.Popen, (["touch", str(self.marker)],)


def test_a_pickle_with_a_code_running_global_is_refused_not_run(run_cli: Cli, tmp_path: Path) -> None:
    evil = tmp_path / "model.pt"
    marker = tmp_path / "pwned"
    torch.save({"weight": torch.ones(2), "args": _Touch(marker)}, evil)
    verified = run_cli("verify", evil, "--json")
    assert verified.exit_code == 1 and verified.json["problems"][0]["kind"] == "unsafe_pickle"
    assert "subprocess.Popen" in verified.json["problems"][0]["message"]
    inspected = run_cli("inspect", evil)
    assert inspected.exit_code == 2 and "Traceback" not in inspected.stderr
    assert "not what it claims to be" in inspected.stderr
    assert not marker.exists()


def test_a_path_in_a_pickle_is_read_as_its_string(run_cli: Cli, tmp_path: Path) -> None:
    saved = tmp_path / "model.pt"
    torch.save({"weight": torch.ones(2), "args": Path("/etc")}, saved)  # PosixPath: a plain value
    verified = run_cli("verify", saved, "--json")
    assert verified.exit_code == 0 and verified.json["problems"] == [], verified.stdout


def test_diff_a_file_against_a_file_and_a_folder(
    run_cli: Cli, files: dict[str, Path], hf_model_dirs: dict[str, Path]
) -> None:
    same = run_cli("diff", files["safetensors"], files["bin"], "--json")
    assert same.exit_code == 0, same.stderr
    assert same.json["equal"] is True and same.json["only_in_a"] == [] and same.json["only_in_b"] == []
    folder = run_cli("diff", hf_model_dirs["sharded"], files["bin"])
    assert folder.exit_code == 0 and folder.stdout.rstrip().endswith("equal")


def test_diff_finds_a_changed_tensor_in_a_torch_file(run_cli: Cli, files: dict[str, Path], tmp_path: Path) -> None:
    state = torch.load(files["bin"], weights_only=True)
    state["model.norm.weight"] = state["model.norm.weight"] + 1
    changed = tmp_path / "changed.pth"
    torch.save(state, changed)
    result = run_cli("diff", files["safetensors"], changed, "--json")
    assert result.exit_code == 1
    assert [(c["name"], c["kind"], c["max_abs_diff"]) for c in result.json["changed"]] == [
        ("model.norm.weight", "values", pytest.approx(1.0))
    ]


def test_convert_a_torch_file_to_safetensors(run_cli: Cli, files: dict[str, Path], tmp_path: Path) -> None:
    # A lone file has no config beside it: the model's, given, proves the output is the Llama.
    config = files["safetensors"].parent
    result = run_cli("convert", files["bin"], tmp_path / "export", "--config", config, "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["model_check"]["architecture"] == "LlamaForCausalLM"
    converted = load_file(tmp_path / "export" / "model.safetensors")
    reference = torch.load(files["bin"], weights_only=True)
    assert sorted(converted) == sorted(reference)  # transformers' own names (model.layers.*, lm_head.*)
    assert all(torch.equal(converted[k], v) for k, v in reference.items())
    assert run_cli("verify", tmp_path / "export").exit_code == 0


def test_a_trainer_optimizer_file_is_an_optimizer(run_cli: Cli, trainer_run: WrittenTrainerRun) -> None:
    result = run_cli("inspect", trainer_run.checkpoints[-1] / "optimizer.pt", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["components"] == ["optimizer"] and result.json["totals"]["parameters"] == 0
    assert {t["component"] for t in result.json["tensors"]} == {"optimizer"}


def test_a_dcp_shard_or_another_file_says_what_to_pass(run_cli: Cli, demo_dir: Path) -> None:
    shard = next((demo_dir / "dcp" / "step-30").glob("*.distcp"))
    for command in ("inspect", "verify"):
        result = run_cli(command, shard)
        assert result.exit_code == 2 and "one file of a torch DCP checkpoint" in result.stderr
        assert "hint: pass the folder that holds it" in result.stderr
    other = run_cli("inspect", demo_dir / "hf" / "config.json")
    assert other.exit_code == 2 and "is a file, not a checkpoint folder" in other.stderr
    forced = run_cli("inspect", demo_dir / "hf" / "model.safetensors", "--layout", "hf")
    assert forced.exit_code == 2 and "leave out --layout" in forced.stderr
