"""PEFT adapter folders written by peft 0.21.2 (`tests.writers.peft_writer`): detected ahead of the HF layout,
inspected with their LoRA settings, verified (factor pairs and ranks); and a PEFT-wrapped model saved whole,
which `inspect` says is one."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from ckptctl.checkpoint import CheckpointState, ProblemKind
from ckptctl.layouts import detect, scan_run
from tests.conftest import CliResult, copy_tree
from tests.writers.peft_writer import VARIANTS, WrittenPeft

Cli = Callable[..., CliResult]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_an_adapter_is_a_peft_checkpoint_with_its_settings(
    run_cli: Cli, peft_adapters: WrittenPeft, variant: str
) -> None:
    folder = peft_adapters.adapters[variant]
    stored = load_file(str(folder / "adapter_model.safetensors"))
    result = run_cli("inspect", folder, "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert doc["layout"] == "peft" and doc["state"] == "complete"
    assert doc["totals"]["parameters"] == sum(t.numel() for t in stored.values())
    settings = VARIANTS[variant]
    adapter = doc["metadata"]["adapter"]
    assert adapter["peft_type"] == "LORA"
    assert (adapter["r"], adapter["lora_alpha"]) == (settings["r"], settings["lora_alpha"])
    assert sorted(adapter["target_modules"]) == sorted(settings["target_modules"])
    assert adapter["use_rslora"] is settings.get("use_rslora", False)
    assert adapter["use_dora"] is settings.get("use_dora", False)
    assert adapter.get("modules_to_save") == settings.get("modules_to_save")
    assert adapter.get("rank_pattern") == settings.get("rank_pattern")
    assert adapter.get("alpha_pattern") == settings.get("alpha_pattern")
    assert adapter["base_model_name_or_path"] == str(peft_adapters.base)
    modules = {name.rsplit(".lora_", 1)[0] for name in stored if ".lora_" in name and "magnitude" not in name}
    assert doc["metadata"]["lora_modules"] == len(modules)
    verified = run_cli("verify", folder, "--json")
    assert verified.exit_code == 0 and verified.json["ok"], verified.stdout


def test_rank_pattern_gives_the_module_its_rank(run_cli: Cli, peft_adapters: WrittenPeft) -> None:
    doc = run_cli("inspect", peft_adapters.adapters["plain"], "--json", "--filter", "*layers.1.self_attn.q_proj*").json
    shapes = {t["name"].rsplit(".", 2)[-2]: t["shape"] for t in doc["tensors"]}
    assert shapes == {"lora_A": [2, 32], "lora_B": [32, 2]}
    assert doc["metadata"]["ranks"] == [2, 4]


def test_lora_alpha_zero_warns_in_inspect_and_verify(run_cli: Cli, peft_adapters: WrittenPeft) -> None:
    folder = peft_adapters.adapters["alpha0"]
    inspected = run_cli("inspect", folder)
    assert inspected.exit_code == 0
    assert "warning:" in inspected.stderr and "lora_alpha is 0" in inspected.stderr
    assert "no effect" in inspected.stderr
    verified = run_cli("verify", folder, "--json")
    assert verified.exit_code == 0 and verified.json["ok"]
    [problem] = verified.json["problems"]
    assert problem["path"] == "adapter_config.json" and problem["severity"] == "warning"
    assert "lora_alpha is 0" in problem["message"]
    quiet = run_cli("inspect", peft_adapters.adapters["plain"])
    assert "warning" not in quiet.stderr


def test_adapters_list_beside_their_base(peft_adapters: WrittenPeft) -> None:
    run = peft_adapters.base.parent
    refs = {Path(r.url).name: r.layout for r in scan_run(str(run))}
    # The writer's reference tensors (`*.merged.pt`, torch.save zips beside the adapters) are checkpoint-like
    # files no layout claims: their folders list as unknown, never as nothing.
    unknown = {run.name: "unknown", "wrapped": "unknown"}
    assert refs == {"base": "hf", **dict.fromkeys(VARIANTS, "peft"), "step-3": "dcp", **unknown}


def _rewrite_adapter(folder: Path, change: Callable[[dict], None]) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_a_lora_a_without_its_lora_b_fails_verify(run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path) -> None:
    folder = copy_tree(peft_adapters.adapters["rslora"], tmp_path / "adapter")
    victim = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    _rewrite_adapter(folder, lambda tensors: tensors.pop(victim))
    result = run_cli("verify", folder, "--json")
    assert result.exit_code == 1
    [problem] = result.json["problems"]
    assert problem["kind"] == ProblemKind.MISSING_FILE and "model.layers.1.self_attn.v_proj" in problem["message"]
    assert "no lora_B" in problem["message"]


def test_factors_of_another_rank_than_the_config_fail_verify(
    run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path
) -> None:
    folder = copy_tree(peft_adapters.adapters["plain"], tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    config["rank_pattern"] = {}  # layer 1's q_proj was trained with r=2, the rest r=4
    (folder / "adapter_config.json").write_text(json.dumps(config))
    result = run_cli("verify", folder, "--json")
    assert result.exit_code == 1
    problems = result.json["problems"]
    assert [p["kind"] for p in problems] == [ProblemKind.BAD_METADATA]
    assert "model.layers.1.self_attn.q_proj" in problems[0]["message"] and "r=4" in problems[0]["message"]


def test_factors_that_disagree_fail_verify(run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path) -> None:
    folder = copy_tree(peft_adapters.adapters["rslora"], tmp_path / "adapter")
    victim = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    _rewrite_adapter(folder, lambda tensors: tensors.update({victim: tensors[victim][:, :4].contiguous()}))
    result = run_cli("verify", folder, "--json")
    assert result.exit_code == 1
    assert any("ranks differ" in p["message"] for p in result.json["problems"]), result.json


def test_an_adapter_without_its_config_is_broken(run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path) -> None:
    folder = copy_tree(peft_adapters.adapters["rslora"], tmp_path / "adapter")
    (folder / "adapter_config.json").unlink()
    layout, ref = detect(str(folder))
    assert layout.name == "peft" and ref.state is CheckpointState.BROKEN and "adapter_config.json" in ref.note
    result = run_cli("verify", folder, "--json")
    assert result.exit_code == 1
    assert any(p["kind"] == ProblemKind.MISSING_FILE for p in result.json["problems"])


def test_a_config_that_does_not_parse_fails_verify(run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path) -> None:
    folder = copy_tree(peft_adapters.adapters["rslora"], tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    config["r"] = -3
    (folder / "adapter_config.json").write_text(json.dumps(config))
    result = run_cli("verify", folder, "--json")
    assert result.exit_code == 1
    [problem] = result.json["problems"]
    assert problem["kind"] == ProblemKind.BAD_METADATA and "r must be a whole number" in problem["message"]


def test_inspect_says_a_model_is_lora_wrapped(run_cli: Cli, peft_adapters: WrittenPeft) -> None:
    result = run_cli("inspect", peft_adapters.wrapped, "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert doc["layout"] == "dcp"
    wrapped = doc["wrapped_model"]
    assert "LoRA" in wrapped["kind"]
    assert wrapped["adapters"] == ["default"]
    assert wrapped["lora_modules"] == 4  # q_proj and v_proj of 2 layers
    assert wrapped["ranks"] == [VARIANTS["rslora"]["r"]]
    assert wrapped["modules_to_save"] == ["lm_head"]
    human = run_cli("inspect", peft_adapters.wrapped)
    assert "wrapped model" in human.stdout and "--lora merge" in human.stdout
    plain = run_cli("inspect", peft_adapters.base, "--json")
    assert plain.json["wrapped_model"] is None


def test_an_adapter_that_lost_its_weights_is_a_torn_adapter(
    peft_adapters: WrittenPeft, tmp_path: Path, run_cli: Cli
) -> None:
    folder = copy_tree(peft_adapters.adapters["plain"], tmp_path / "plain")
    (folder / "adapter_model.safetensors").unlink()  # PeftModel.from_pretrained fails on it (tests/faults)
    verified = run_cli("verify", folder, "--json")
    assert verified.exit_code == 1 and verified.json["layout"] == "peft"
    assert [(p["path"], p["severity"]) for p in verified.json["problems"]] == [("adapter_model.safetensors", "error")]
    [listed] = run_cli("list", tmp_path, "--json").json["checkpoints"]
    assert (listed["layout"], listed["state"]) == ("peft", "broken")
