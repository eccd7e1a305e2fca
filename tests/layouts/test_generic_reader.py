"""The generic reader of the long tail (issue 23.2): runs of frameworks ckptctl was never taught, in the shapes
their own saving code writes, read by the naming rules, the top-level keys of a training state, a run-level
state file beside model folders, and a DCP save's counters.

Each run is written with the objects those frameworks save: `torch.save` of the dicts they build from a real
model's and optimizer's state dicts (LitGPT's `step-00000010/lit_model.pth`, Composer's `ep{E}-ba{B}-rank0.pt`
with its `latest-rank0.pt` link and `Timestamp` counters holding a `datetime.timedelta`), transformers'
`save_pretrained` with a recipe-state file beside the `epoch_N/` folders (torchtune), and `dcp.save`.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CliResult

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

Cli = Callable[..., CliResult]


def _tiny_llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _trained(model: Any) -> tuple[Any, Any, Any]:
    """`model` after one AdamW step with a cosine schedule (the optimizer holds moments, the scheduler a step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    ids = torch.tensor([[1, 2, 3, 4]])
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _litgpt_run(run: Path) -> Path:
    """LitGPT's pretraining saves: `step-{N:08d}/lit_model.pth` holding `{"model", "optimizer",
    "train_dataloader", "iter_num", "step_count"}` (here with a scheduler too, and the model compiled:
    `_orig_mod.` before every name)."""
    model, optimizer, scheduler = _trained(_tiny_llama())
    for step in (10, 20):
        folder = run / f"step-{step:08d}"
        folder.mkdir(parents=True)
        state = {
            "model": {f"_orig_mod.{k}": v for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "train_dataloader": {"epoch": 0, "sampler_iter_yielded": step * 4},
            "iter_num": step * 4,
            "step_count": step,
        }
        torch.save(state, folder / "lit_model.pth")
        (folder / "model_config.yaml").write_text("name: tiny\n")
        os.utime(folder / "lit_model.pth", (1_000_000 + step, 1_000_000 + step))
    model.config.save_pretrained(run / "step-00000020")  # for convert
    return run


def _composer_run(run: Path) -> Path:
    """Composer's `ep{E}-ba{B}-rank0.pt` files: `{"state": {"model", "optimizers", "schedulers", "timestamp",
    "rank_zero_seed"}, "rng": [...]}`, the `Timestamp` state holding its wall-clock times as timedeltas, and a
    `latest-rank0.pt` symbolic link to the newest."""
    run.mkdir(parents=True)
    model, optimizer, scheduler = _trained(_tiny_llama())
    for batch in (10, 20):
        timestamp = {
            "iteration": 0,
            "epoch": 0,
            "batch": batch,
            "sample": batch * 4,
            "token": batch * 16,
            "total_wct": datetime.timedelta(seconds=batch * 1.5),
        }
        state = {
            "state": {
                "model": {f"module.{k}": v for k, v in model.state_dict().items()},
                "optimizers": {"AdamW": optimizer.state_dict()},
                "schedulers": [scheduler.state_dict()],
                "timestamp": timestamp,
                "rank_zero_seed": 17,
            },
            "rng": [{"python": 1, "torch": torch.get_rng_state()}],
        }
        torch.save(state, run / f"ep0-ba{batch}-rank0.pt")
        os.utime(run / f"ep0-ba{batch}-rank0.pt", (1_000_000 + batch, 1_000_000 + batch))
    os.symlink("ep0-ba20-rank0.pt", run / "latest-rank0.pt")
    return run


def _torchtune_run(run: Path) -> Path:
    """torchtune's full fine-tuning saves: `epoch_N/` HF model folders (`save_pretrained`) and, beside them,
    `recipe_state.pt` with the optimizer, `epochs_run`, `seed`, `total_epochs` and `max_steps_per_epoch`."""
    model, optimizer, _ = _trained(_tiny_llama())
    for epoch in (0, 1):
        model.save_pretrained(run / f"epoch_{epoch}")
        os.utime(run / f"epoch_{epoch}" / "model.safetensors", (1_000_000 + epoch, 1_000_000 + epoch))
    recipe = {
        "optimizer": optimizer.state_dict(),
        "epochs_run": 2,
        "seed": 0,
        "total_epochs": 3,
        "max_steps_per_epoch": None,
    }
    torch.save(recipe, run / "recipe_state.pt")
    return run


def _listed(run_cli: Cli, run: Path) -> list[tuple[str, Any, Any, str, str, bool]]:
    result = run_cli("list", run, "--json")
    assert result.exit_code == 0, result.stderr
    return [
        (os.path.relpath(c["url"], run), c["step"], c["epoch"], c["layout"], c["state"], c["latest"])
        for c in json.loads(result.stdout)["checkpoints"]
    ]


def _prune(run_cli: Cli, run: Path) -> dict[str, Any]:
    result = run_cli("prune", run, "-y", "--keep-last", "1", "--grace", "0s", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def test_litgpt_step_folders(run_cli: Cli, tmp_path: Path) -> None:
    run = _litgpt_run(tmp_path / "run")
    assert _listed(run_cli, run) == [
        ("step-00000010", 10, None, "training_state", "complete", False),
        ("step-00000020", 20, None, "training_state", "complete", False),
    ]
    verified = run_cli("verify", run, "--json")
    assert verified.exit_code == 0, verified.stdout
    assert [r["ok"] for r in json.loads(verified.stdout)["results"]] == [True, True]

    inspected = json.loads(run_cli("inspect", run / "step-00000020", "--json").stdout)
    assert set(inspected["components"]) == {"model", "optimizer", "scheduler", "dataloader", "trainer_state"}
    assert "scheduler" not in inspected["missing_components"] and "trainer_state" not in inspected["missing_components"]
    model = {t["name"] for t in inspected["tensors"] if t["component"] == "model"}
    assert model == set(_tiny_llama().state_dict()) - {"lm_head.weight"} or model == set(_tiny_llama().state_dict())

    plan = run_cli("resume-plan", run, "--json")
    assert plan.exit_code == 0, plan.stdout
    doc = json.loads(plan.stdout)
    assert doc["checkpoint"]["url"] == str(run / "step-00000020") and doc["checkpoint"]["step"] == 20
    assert doc["continues_from"]["iter_num"] == 80 and doc["continues_from"]["step_count"] == 20
    assert {"model", "optimizer", "scheduler", "trainer_state"} <= set(doc["restores"])

    report = _prune(run_cli, run)
    assert [(os.path.basename(d["url"]), d["reasons"]) for d in report["delete"]] == [
        ("step-00000010", ["no rule keeps it"])
    ]
    kept = {os.path.basename(k["url"]): k["reasons"] for k in report["keep"]}
    assert "newest complete" in kept["step-00000020"]
    assert not (run / "step-00000010").exists() and (run / "step-00000020" / "lit_model.pth").exists()


def test_convert_and_diff_a_training_state_file(run_cli: Cli, tmp_path: Path) -> None:
    """`convert --to hf` takes the model entry, names without `_orig_mod.`; transformers loads it exactly."""
    run = _litgpt_run(tmp_path / "run")
    state = run / "step-00000020" / "lit_model.pth"
    out = tmp_path / "hf"
    converted = run_cli("convert", state, out, "--to", "hf", "--config", run / "step-00000020", "--json")
    assert converted.exit_code == 0, converted.stdout + converted.stderr
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    saved = torch.load(state, weights_only=True)["model"]
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, saved[f"_orig_mod.{name}"]), name
    reference = tmp_path / "reference"
    _tiny_llama_like(saved).save_pretrained(reference)
    diff = run_cli("diff", state, reference, "--json")
    assert json.loads(diff.stdout)["changed"] == [], diff.stdout


def _tiny_llama_like(saved: dict[str, Any]) -> Any:
    model = _tiny_llama()
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in saved.items()})
    return model


def test_composer_batch_files_and_their_latest_link(run_cli: Cli, tmp_path: Path) -> None:
    run = _composer_run(tmp_path / "run")
    assert _listed(run_cli, run) == [
        ("ep0-ba10-rank0.pt", 10, 0.0, "training_state", "complete", False),
        ("ep0-ba20-rank0.pt", 20, 0.0, "training_state", "complete", True),
    ]
    plan = json.loads(run_cli("resume-plan", run, "--json").stdout)
    assert plan["checkpoint"]["url"] == str(run / "ep0-ba20-rank0.pt")
    assert plan["continues_from"]["timestamp.batch"] == 20 and plan["continues_from"]["timestamp.sample"] == 80
    assert {"model", "optimizer", "scheduler", "rng", "trainer_state"} <= set(plan["restores"])
    verified = run_cli("verify", run / "ep0-ba20-rank0.pt", "--json")
    assert verified.exit_code == 0 and json.loads(verified.stdout)["problems"] == [], verified.stdout
    report = _prune(run_cli, run)
    assert [os.path.basename(d["url"]) for d in report["delete"]] == ["ep0-ba10-rank0.pt"]
    kept = {os.path.basename(k["url"]): k["reasons"] for k in report["keep"]}
    assert "named by the run's latest pointer" in kept["ep0-ba20-rank0.pt"]
    assert (run / "latest-rank0.pt").resolve() == run / "ep0-ba20-rank0.pt"


def test_torchtune_epoch_folders_with_their_recipe_state(run_cli: Cli, tmp_path: Path) -> None:
    run = _torchtune_run(tmp_path / "run")
    assert _listed(run_cli, run) == [
        ("epoch_0", None, 0.0, "hf", "complete", False),
        ("epoch_1", None, 1.0, "hf", "complete", False),
    ]
    listed = json.loads(run_cli("list", run, "--json").stdout)["checkpoints"]
    assert [c["run_state"] for c in listed] == [None, str(run / "recipe_state.pt")]
    plan = run_cli("resume-plan", run, "--json")
    assert plan.exit_code == 0, plan.stdout
    assert "nothing resumable" not in run_cli("resume-plan", run).stdout
    doc = json.loads(plan.stdout)
    assert doc["checkpoint"]["url"] == str(run / "epoch_1")
    assert doc["continues_from"]["epoch"] == 1.0 and doc["continues_from"]["epochs_run"] == 2
    assert {"model", "optimizer", "trainer_state"} <= set(doc["restores"])
    assert "recipe_state.pt" in run_cli("resume-plan", run).stdout
    report = _prune(run_cli, run)
    assert [(os.path.basename(d["url"]), d["reasons"]) for d in report["delete"]] == [("epoch_0", ["no rule keeps it"])]
    assert (run / "epoch_1").is_dir() and (run / "recipe_state.pt").is_file()


def test_a_dcp_training_state_reports_its_counters(run_cli: Cli, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model, optimizer, _ = _trained(_tiny_llama())
    folder = tmp_path / "run" / "epoch_2"
    with pytest.warns(UserWarning):
        dcp.save(
            {"model": model.state_dict(), "optim": optimizer.state_dict(), "epochs_run": 3, "seed": 0},
            checkpoint_id=folder,
            no_dist=True,
        )
    inspected = json.loads(run_cli("inspect", folder, "--json").stdout)
    assert "trainer_state" in inspected["components"] and "trainer_state" not in inspected["missing_components"]
    plan = run_cli("resume-plan", tmp_path / "run", "--json")
    assert plan.exit_code == 0, plan.stdout
    doc = json.loads(plan.stdout)
    assert doc["continues_from"]["epochs_run"] == 3 and doc["continues_from"]["epoch"] == 2.0
    assert "trainer_state" in doc["restores"]
    assert "no step/epoch counters" not in run_cli("resume-plan", tmp_path / "run").stdout


def test_a_tracker_file_names_the_latest_folder(run_cli: Cli, tmp_path: Path) -> None:
    run = _litgpt_run(tmp_path / "run")
    (run / "latest_checkpointed_iteration.txt").write_text("10\n")
    assert [(path, latest) for path, *_, latest in _listed(run_cli, run)] == [
        ("step-00000010", True),
        ("step-00000020", False),
    ]


def test_a_damaged_recipe_state_is_no_resume_point(run_cli: Cli, tmp_path: Path) -> None:
    run = _torchtune_run(tmp_path / "run")
    state = run / "recipe_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    plan = run_cli("resume-plan", run, "--json")
    assert plan.exit_code == 1, plan.stdout
    skipped = json.loads(plan.stdout)["skipped"]
    assert skipped[0]["url"] == str(run / "epoch_1") and "recipe_state.pt" in skipped[0]["reason"]
    assert run_cli("verify", run, "--latest").exit_code == 1


def _adam_after_one_step() -> tuple[Any, Any]:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def _fsdp_style_optimizer_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """`{state, param_groups}` keyed by parameter names, as FSDP's full optimizer state dict keys it."""
    names = [name for name, _ in model.named_parameters()]
    saved = optimizer.state_dict()
    return {
        "state": {names[i]: value for i, value in saved["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]],
    }


@pytest.mark.parametrize("shape", ["by_index", "by_name", "moments_only", "under_a_key_of_its_own"])
def test_optimizer_state_alone_is_never_read_as_a_model(run_cli: Cli, tmp_path: Path, shape: str) -> None:
    """The generic reader claims `model` only with evidence: Adam's moments are not published as weights."""
    import torch

    model, optimizer = _adam_after_one_step()
    saved = {
        "by_index": optimizer.state_dict,
        "by_name": lambda: _fsdp_style_optimizer_state(model, optimizer),
        "moments_only": lambda: {f"{n}.exp_avg": optimizer.state[p]["exp_avg"] for n, p in model.named_parameters()},
        "under_a_key_of_its_own": lambda: {"osd": optimizer.state_dict()},
    }[shape]()
    path = tmp_path / "opt.pt"
    torch.save(saved, path)
    inspected = run_cli("inspect", path, "--json")
    assert inspected.exit_code == 0, inspected.stderr
    assert "model" not in inspected.json["components"]
    assert inspected.json["totals"]["parameters"] == 0
    converted = run_cli("convert", path, tmp_path / "out", "--to", "hf")
    assert converted.exit_code == 2
    assert "no model tensors" in converted.stderr
    assert not (tmp_path / "out").exists()


def test_a_model_state_dict_is_still_a_model(run_cli: Cli, tmp_path: Path) -> None:
    import torch

    model, _ = _adam_after_one_step()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    inspected = run_cli("inspect", tmp_path / "weights.pt", "--json")
    assert inspected.json["components"] == ["model"]
    assert inspected.json["totals"]["parameters"] == sum(p.numel() for p in model.parameters())
