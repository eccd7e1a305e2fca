"""Lightning checkpoints written by lightning 2.6.6 on 2 CPU ranks (`tests.writers.lightning_writer`): the
ModelCheckpoint files (with `last.ckpt` as a copy and as a symbolic link) and a sharded FSDP `.ckpt/` folder,
listed, inspected, verified, pruned, planned for resume and converted to a transformers model."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptctl.checkpoint import ProblemKind
from tests.conftest import CliResult, copy_tree
from tests.writers.lightning_writer import STEPS, WrittenLightning, model_config

Cli = Callable[..., CliResult]


def _lightning_load(path: Path) -> dict[str, Any]:
    """The checkpoint as Lightning itself loads it (the writer's own output: trusted)."""
    loaded: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    return loaded


def _rows(result: CliResult) -> dict[str, dict[str, Any]]:
    assert result.exit_code == 0, result.stderr
    return {os.path.basename(c["url"]): c for c in result.json["checkpoints"]}


def test_list_shows_the_steps_and_last_ckpt_as_latest(run_cli: Cli, lightning_run: WrittenLightning) -> None:
    copied = _rows(run_cli("list", lightning_run.checkpoints, "--json"))
    assert {
        name: (row["step"], row["epoch"], row["layout"], row["state"], row["latest"]) for name, row in copied.items()
    } == {
        "epoch=0-step=2.ckpt": (2, 0, "lightning", "complete", False),
        "epoch=0-step=4.ckpt": (4, 0, "lightning", "complete", False),
        "last.ckpt": (STEPS, 0, "lightning", "complete", True),  # a copy: its step read from global_step
    }
    linked = _rows(run_cli("list", lightning_run.linked, "--json"))
    assert {name: row["latest"] for name, row in linked.items()} == {
        "epoch=0-step=2.ckpt": False,
        "epoch=0-step=4.ckpt": True,  # what the last.ckpt link names; the link itself is no checkpoint
    }
    whole = _rows(run_cli("list", lightning_run.root, "--json"))
    assert whole["epoch=0-step=4.ckpt"]["layout"] == "lightning"
    assert sum(1 for c in run_cli("list", lightning_run.root, "--json").json["checkpoints"]) == 6


def test_inspect_a_file(run_cli: Cli, lightning_run: WrittenLightning) -> None:
    path = lightning_run.checkpoints / "last.ckpt"
    saved = _lightning_load(path)
    result = run_cli("inspect", path, "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert (doc["layout"], doc["step"], doc["epoch"]) == ("lightning", saved["global_step"], saved["epoch"])
    assert {"model", "optimizer", "scheduler", "trainer_state"} <= set(doc["components"])
    assert doc["totals"]["parameters"] == lightning_run.model_parameters
    meta = doc["metadata"]
    assert meta["lightning_version"] == saved["pytorch-lightning_version"]
    assert meta["progress"] == {"global_step": saved["global_step"], "epoch": saved["epoch"]}
    assert meta["hyper_parameters"]["lr"] == saved["hyper_parameters"]["lr"]
    assert meta["optimizers"] == len(saved["optimizer_states"])
    state = next(v for k, v in saved["callbacks"].items() if str(lightning_run.checkpoints) in v.get("dirpath", ""))
    assert meta["best_model_path"] == state["best_model_path"]
    model = {t["name"] for t in doc["tensors"] if t["component"] == "model"}
    assert model == {f"state_dict.{name}" for name in saved["state_dict"]}
    optimizer = [t for t in doc["tensors"] if t["component"] == "optimizer"]
    assert len(optimizer) == sum(len(s) for s in saved["optimizer_states"][0]["state"].values())


def test_inspect_the_sharded_folder(run_cli: Cli, lightning_run: WrittenLightning) -> None:
    result = run_cli("inspect", lightning_run.sharded, "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert (doc["layout"], doc["step"], doc["world_size"]) == ("lightning", STEPS, 2)
    assert {"model", "optimizer", "scheduler", "trainer_state"} <= set(doc["components"])
    assert doc["totals"]["parameters"] == lightning_run.model_parameters
    assert doc["metadata"]["format"] == "Lightning checkpoint (sharded: torch DCP + meta.pt)"


def test_every_checkpoint_verifies(run_cli: Cli, lightning_run: WrittenLightning) -> None:
    result = run_cli("verify", lightning_run.root, "--json")
    assert result.exit_code == 0, result.stdout
    assert len(result.json["results"]) == 6 and all(r["ok"] for r in result.json["results"])


def test_a_truncated_file_fails_verify(run_cli: Cli, lightning_run: WrittenLightning, tmp_path: Path) -> None:
    victim = tmp_path / "epoch=0-step=2.ckpt"
    victim.write_bytes((lightning_run.checkpoints / victim.name).read_bytes()[:100_000])
    result = run_cli("verify", victim, "--json")
    assert result.exit_code == 1
    assert result.json["problems"][0]["kind"] in (ProblemKind.TRUNCATED, ProblemKind.BAD_METADATA)


def test_a_sharded_folder_without_meta_pt_is_in_progress(
    run_cli: Cli, lightning_run: WrittenLightning, tmp_path: Path
) -> None:
    folder = copy_tree(lightning_run.sharded, tmp_path / "sharded" / lightning_run.sharded.name)
    (folder / "meta.pt").unlink()
    listed = run_cli("list", folder.parent, "--json").json["checkpoints"]
    assert [(c["layout"], c["state"]) for c in listed] == [("lightning", "in_progress")]
    verified = run_cli("verify", folder, "--json")
    assert verified.exit_code == 1
    assert [p["kind"] for p in verified.json["problems"]] == [ProblemKind.IN_PROGRESS]
    converted = run_cli("convert", folder, tmp_path / "out")
    assert converted.exit_code == 2 and "still being written" in converted.stderr


# --- the pickle's classes ------------------------------------------------------------------------------


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _with_hparams(lightning_run: WrittenLightning, folder: Path, **extra: Any) -> Path:
    checkpoint = _lightning_load(lightning_run.step(2))
    checkpoint["hyper_parameters"].update(extra)
    folder.mkdir()
    torch.save(checkpoint, folder / "epoch=0-step=2.ckpt")
    return folder / "epoch=0-step=2.ckpt"


def test_the_classes_lightning_writes_into_hparams_are_read(
    run_cli: Cli, lightning_run: WrittenLightning, tmp_path: Path
) -> None:
    from lightning.pytorch.utilities.parsing import AttributeDict

    path = _with_hparams(
        lightning_run, tmp_path / "run", args=argparse.Namespace(batch_size=8), nested=AttributeDict(warmup=100)
    )
    result = run_cli("inspect", path, "--json")
    assert result.exit_code == 0, result.stderr
    hparams = result.json["metadata"]["hyper_parameters"]
    assert hparams["args"] == "<argparse.Namespace>" and hparams["nested"] == "<dict of 1>"
    assert run_cli("verify", path).exit_code == 0


def test_other_classes_in_hparams_are_refused(run_cli: Cli, lightning_run: WrittenLightning, tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    path = _with_hparams(lightning_run, tmp_path / "run", payload=_Payload(marker))
    result = run_cli("verify", path, "--json")
    assert result.exit_code == 1
    [problem] = result.json["problems"]
    assert problem["kind"] == ProblemKind.UNSAFE_PICKLE
    assert "posix.system" in problem["message"] or "os.system" in problem["message"]
    assert "hyper_parameters" in problem["message"]
    assert run_cli("inspect", path).exit_code == 2
    assert not marker.exists()


# --- prune and resume ----------------------------------------------------------------------------------


def test_prune_keeps_last_ckpt_and_the_best_model_path(
    run_cli: Cli, lightning_run: WrittenLightning, tmp_path: Path
) -> None:
    folder = copy_tree(lightning_run.checkpoints, tmp_path / "checkpoints")
    state = next(
        v for k, v in _lightning_load(folder / "last.ckpt")["callbacks"].items() if v["dirpath"].endswith("checkpoints")
    )
    best = os.path.basename(state["best_model_path"])
    result = run_cli("prune", folder, "--keep-last", "1", "--grace", "0s", "--yes", "--json")
    # exit 0: the rules would delete the best checkpoint, which Lightning's state protects (a note, issue 33)
    assert result.exit_code == 0 and f"note: {best} is protected" in result.stderr, result.stderr
    keep = {os.path.basename(k["url"]): k["reasons"] for k in result.json["keep"]}
    assert any("last.ckpt" in reason for reason in keep["last.ckpt"])
    assert any("best_model_path" in reason for reason in keep[best])
    deleted = {os.path.basename(d["url"]) for d in result.json["delete"]}
    assert deleted == {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"} - {best}
    assert sorted(p.name for p in folder.iterdir()) == sorted({"last.ckpt", best})
    assert result.json["freed_bytes"] == sum((lightning_run.checkpoints / name).stat().st_size for name in deleted)


def test_resume_plan_names_ckpt_path(run_cli: Cli, lightning_run: WrittenLightning) -> None:
    copied = run_cli("resume-plan", lightning_run.checkpoints, "--json")
    assert copied.exit_code == 0, copied.stderr
    doc = copied.json
    assert doc["checkpoint"]["url"] == str(lightning_run.checkpoints / "last.ckpt")
    assert doc["checkpoint"]["step"] == STEPS
    assert "ckpt_path='last'" in doc["resume_hint"]
    assert {"model", "optimizer", "scheduler", "trainer_state"} <= set(doc["restores"])
    assert "rng" in doc["missing"] and "no RNG state" in doc["impacts"]["rng"]
    linked = run_cli("resume-plan", lightning_run.linked, "--json").json
    assert linked["checkpoint"]["url"] == str(lightning_run.linked / f"epoch=0-step={STEPS}.ckpt")
    assert (
        linked["resume_hint"]
        == f"trainer.fit(model, ckpt_path={str(lightning_run.linked / f'epoch=0-step={STEPS}.ckpt')!r})"
    )
    sharded = run_cli("resume-plan", lightning_run.sharded.parent, "--world-size", "4", "--json").json
    assert sharded["world_size_ok"] is True and sharded["world_size"]["saved"] == 2


# --- convert -------------------------------------------------------------------------------------------


def _model_names(reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LightningModule's state dict under the model's own names (its attribute `model.` removed)."""
    return {name.removeprefix("model."): tensor for name, tensor in reference.items()}


@pytest.mark.parametrize("which", ["last", "sharded", "dirpath"])
def test_convert_to_a_transformers_model(
    run_cli: Cli, lightning_run: WrittenLightning, tmp_path: Path, which: str
) -> None:
    from transformers import AutoModelForCausalLM

    source = {
        "last": lightning_run.checkpoints / "last.ckpt",
        "sharded": lightning_run.sharded,
        "dirpath": lightning_run.checkpoints,  # the folder: what last.ckpt names
    }[which]
    out = tmp_path / "hf"
    result = run_cli("convert", source, out, "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert doc["layout"] == "lightning" and doc["model_check"]["architecture"] == "LlamaForCausalLM"
    assert any("config.json written from the model config" in w for w in doc["warnings"])
    want = _model_names(torch.load(lightning_run.reference, weights_only=True))
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    _model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_convert_without_a_config_asks_for_one(run_cli: Cli, lightning_run: WrittenLightning, tmp_path: Path) -> None:
    checkpoint = _lightning_load(lightning_run.step(2))
    checkpoint["hyper_parameters"] = {"lr": 0.01}
    (tmp_path / "run").mkdir()
    torch.save(checkpoint, tmp_path / "run" / "epoch=0-step=2.ckpt")
    result = run_cli("convert", tmp_path / "run" / "epoch=0-step=2.ckpt", tmp_path / "out", "--json")
    assert result.exit_code == 2, result.stderr  # nothing proves the module's names are a transformers model's
    assert result.json["error"]["type"] == "UnprovedModel" and "--config PATH" in result.json["error"]["hint"]
    assert not (tmp_path / "out").exists()
    config = tmp_path / "config"
    config.mkdir()
    (config / "config.json").write_text(json.dumps(model_config()))
    given = run_cli(
        "convert", tmp_path / "run" / "epoch=0-step=2.ckpt", tmp_path / "out2", "--config", config, "--json"
    )
    assert given.exit_code == 0, given.stderr
    assert given.json["model_check"]["architecture"] == "LlamaForCausalLM"
