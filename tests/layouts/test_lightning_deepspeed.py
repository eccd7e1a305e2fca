"""Lightning DeepSpeed checkpoints (the `lightning_run` writer's `deepspeed/`: lightning 2.6.6's Trainer with
`DeepSpeedStrategy(stage=2)` on one CPU process, `ModelCheckpoint` every step of 2): each `epoch=0-step=S.ckpt/`
is a DeepSpeed save folder (tag `checkpoint/`, `latest`, zero_to_fp32.py) with Lightning's dict as client
state. They list, inspect, verify, prune and resume-plan as Lightning checkpoints, and convert to the model
under transformers' names (the LightningModule's `model.` attribute removed), equal to the trained weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CliResult, copy_tree
from tests.writers.lightning_writer import WrittenLightning

Cli = Callable[..., CliResult]


def test_list_inspect_and_verify(run_cli: Cli, lightning_run: WrittenLightning) -> None:
    listed = run_cli("list", lightning_run.deepspeed, "--json")
    assert listed.exit_code == 0, listed.stderr
    rows = [(Path(r["url"]).name, r["layout"], r["step"], r["state"]) for r in listed.json["checkpoints"]]
    assert rows == [(f"epoch=0-step={s}.ckpt", "lightning", s, "complete") for s in (1, 2)]  # no inner tag rows
    inspected = run_cli("inspect", lightning_run.deepspeed / "epoch=0-step=2.ckpt", "--json")
    assert inspected.exit_code == 0, inspected.stderr
    doc = inspected.json
    assert doc["layout"] == "lightning" and doc["step"] == 2 and doc["world_size"] == 1
    assert {"model", "optimizer", "scheduler", "trainer_state"} <= set(doc["components"])
    assert doc["metadata"]["deepspeed"]["zero_stage"] == 2
    assert doc["metadata"]["lightning_version"] == "2.6.6"
    reference = torch.load(lightning_run.deepspeed_reference, weights_only=True)
    model = {t["name"] for t in doc["tensors"] if t["component"] == "model"}
    assert model == set(reference)
    verified = run_cli("verify", lightning_run.deepspeed, "--json")
    assert verified.exit_code == 0 and verified.json["ok"], verified.stdout


@pytest.mark.parametrize("weights", ["auto", "stored"])
def test_convert_gives_the_trained_model(
    run_cli: Cli, lightning_run: WrittenLightning, tmp_path: Path, weights: str
) -> None:
    """fp32 training: the ZeRO-2 master partitions (auto) and the module weights (stored) are the same numbers."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    result = run_cli(
        "convert", lightning_run.deepspeed / "epoch=0-step=2.ckpt", out, "--model-weights", weights, "--json"
    )
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert doc["layout"] == "lightning" and doc["weights"] == ("master" if weights == "auto" else "stored")
    assert doc["model_check"]["architecture"] == "LlamaForCausalLM" and "config.json" in doc["files"]
    reference = torch.load(lightning_run.deepspeed_reference, weights_only=True)
    want = {name.removeprefix("model."): tensor for name, tensor in reference.items()}
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    model = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_resume_plan_and_prune(run_cli: Cli, lightning_run: WrittenLightning, tmp_path: Path) -> None:
    plan = run_cli("resume-plan", lightning_run.deepspeed, "--json")
    assert plan.exit_code == 0, plan.stderr
    assert plan.json["checkpoint"]["step"] == 2 and plan.json["world_size_ok"] is True
    assert "ckpt_path='" in plan.json["resume_hint"]
    wider = run_cli("resume-plan", lightning_run.deepspeed, "--world-size", "2", "--json")
    assert wider.json["world_size_ok"] is False  # ZeRO-2 partitions need a universal checkpoint
    run = copy_tree(lightning_run.deepspeed, tmp_path / "run")
    pruned = run_cli("prune", run, "--keep-last", "1", "--grace", "0s", "--yes", "--json")
    assert pruned.exit_code == 0, pruned.stderr
    assert [d["step"] for d in pruned.json["delete"]] == [1]
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["epoch=0-step=2.ckpt"]


def test_a_save_without_latest_is_in_progress_and_a_missing_partition_broken(
    run_cli: Cli, lightning_run: WrittenLightning, tmp_path: Path
) -> None:
    run = copy_tree(lightning_run.deepspeed, tmp_path / "run")
    (run / "epoch=0-step=2.ckpt" / "latest").unlink()
    optim = next((run / "epoch=0-step=1.ckpt" / "checkpoint").glob("*_optim_states.pt"))
    optim.unlink()
    states = {Path(r["url"]).name: r["state"] for r in run_cli("list", run, "--json").json["checkpoints"]}
    assert states == {"epoch=0-step=1.ckpt": "broken", "epoch=0-step=2.ckpt": "in_progress"}
    verified = run_cli("verify", run / "epoch=0-step=1.ckpt", "--json")
    assert verified.exit_code == 1 and any(optim.name in p["path"] for p in verified.json["problems"])
    refused = run_cli("convert", run / "epoch=0-step=2.ckpt", tmp_path / "out")
    assert refused.exit_code == 2 and "still being written" in refused.stderr
