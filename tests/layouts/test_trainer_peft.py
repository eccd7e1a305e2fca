"""HF Trainer checkpoints of a PEFT model (the `trainer_run` writer's `peft-out/`: transformers 5.24's Trainer
training `get_peft_model(tiny Llama)` for 2 steps with `save_steps=1`): `checkpoint-N/` holds the adapter
(adapter_model.safetensors + adapter_config.json) with optimizer.pt, scheduler.pt, rng_state.pth and
trainer_state.json, and no model. Every command reads it as a Trainer checkpoint whose model is an adapter;
`convert` merges it into its base, exactly as PEFT's own `merge_and_unload()`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.conftest import CliResult, copy_tree
from tests.writers.trainer_writer import WrittenTrainerRun

Cli = Callable[..., CliResult]


def test_list_inspect_verify_and_resume_plan(run_cli: Cli, trainer_run: WrittenTrainerRun) -> None:
    listed = run_cli("list", trainer_run.peft_run, "--json")
    assert listed.exit_code == 0, listed.stderr
    rows = listed.json["checkpoints"]
    assert [(r["layout"], r["step"], r["state"]) for r in rows] == [("hf_trainer", s, "complete") for s in (1, 2)]
    inspected = run_cli("inspect", trainer_run.peft_run / "checkpoint-2", "--json")
    assert inspected.exit_code == 0, inspected.stderr
    doc = inspected.json
    assert doc["layout"] == "hf_trainer" and doc["step"] == 2
    assert {"model", "optimizer", "scheduler", "rng", "trainer_state"} <= set(doc["components"])
    assert "PEFT adapter" in doc["metadata"]["model"]
    assert doc["metadata"]["lora_modules"] == 4 and doc["metadata"]["ranks"] == [4]
    assert doc["metadata"]["adapter"]["base_model_name_or_path"] == str(trainer_run.peft_base)
    model = [t["name"] for t in doc["tensors"] if t["component"] == "model"]
    assert model and all(".lora_" in name for name in model)
    verified = run_cli("verify", trainer_run.peft_run, "--json")
    assert verified.exit_code == 0 and verified.json["ok"], verified.stdout
    plan = run_cli("resume-plan", trainer_run.peft_run, "--json")
    assert plan.exit_code == 0, plan.stderr
    assert plan.json["checkpoint"]["step"] == 2 and plan.json["checkpoint"]["layout"] == "hf_trainer"
    assert {"model", "optimizer", "scheduler", "rng"} <= set(plan.json["restores"])
    assert "resume_from_checkpoint" in plan.json["resume_hint"]


def test_an_adapter_without_its_config_fails_verify(
    run_cli: Cli, trainer_run: WrittenTrainerRun, tmp_path: Path
) -> None:
    run = copy_tree(trainer_run.peft_run, tmp_path / "run")
    (run / "checkpoint-2" / "adapter_config.json").unlink()
    result = run_cli("verify", run / "checkpoint-2", "--json")
    assert result.exit_code == 1
    assert any(p["path"] == "adapter_config.json" for p in result.json["problems"])


def test_prune_deletes_a_whole_adapter_checkpoint(run_cli: Cli, trainer_run: WrittenTrainerRun, tmp_path: Path) -> None:
    run = copy_tree(trainer_run.peft_run, tmp_path / "run")
    result = run_cli("prune", run, "--keep-last", "1", "--grace", "0s", "--yes", "--json")
    assert result.exit_code == 0, result.stderr
    assert [d["step"] for d in result.json["delete"]] == [1]
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["checkpoint-2"]


def test_convert_merges_the_adapter_as_merge_and_unload(
    run_cli: Cli, trainer_run: WrittenTrainerRun, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    want = load_file(str(trainer_run.peft_merged))
    checkpoint = trainer_run.peft_run / "checkpoint-2"
    named = run_cli("convert", checkpoint, tmp_path / "named", "--json")  # the base the adapter names
    given = run_cli("convert", checkpoint, tmp_path / "given", "--merge-adapter", trainer_run.peft_base, "--json")
    for result, out in ((named, tmp_path / "named"), (given, tmp_path / "given")):
        assert result.exit_code == 0, result.stderr
        assert result.json["base"] == str(trainer_run.peft_base) and result.json["derived_tensors"] == 4
        assert result.json["model_check"]["architecture"] == "LlamaForCausalLM"
        got = load_file(str(out / "model.safetensors"))
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "given")
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
