"""DeepSpeed universal checkpoints, as `ds_to_universal` writes them (`tests.writers.universal_writer`), through
the CLI: the run's verify gate, inspect, convert to HF and resume-plan on another world size, for plain
DeepSpeed (ZeRO-2 and ZeRO-3), open-instruct and OpenRLHF save folders."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult, copy_tree
from tests.writers.universal_writer import UNIVERSAL_TAG, WrittenUniversal

Cli = Callable[..., CliResult]
STAGES = pytest.mark.parametrize("stage", [2, 3])
#: A parameter every stage trains (ZeRO-3 freezes `model.norm.weight`).
PARAM = "model.layers.0.mlp.up_proj.weight"


@STAGES
def test_verify_passes_on_the_run_and_the_conversion(
    run_cli: Cli, deepspeed_universal: WrittenUniversal, stage: int
) -> None:
    save_dir = deepspeed_universal.save_dirs[stage]
    result = run_cli("verify", save_dir, "--json")
    assert result.exit_code == 0, result.stdout
    layouts = {Path(r["url"]).name: (r["layout"], r["ok"]) for r in result.json["results"]}
    assert layouts[UNIVERSAL_TAG] == ("deepspeed_universal", True)
    assert layouts["global_step4"] == ("deepspeed", True)
    one = run_cli("verify", deepspeed_universal.universal(stage), "--json")
    assert one.exit_code == 0 and one.json["ok"] is True and one.json["problems"] == []


@STAGES
def test_verify_fails_without_a_parameters_fp32_weights(
    run_cli: Cli, deepspeed_universal: WrittenUniversal, stage: int, tmp_path: Path
) -> None:
    save_dir = copy_tree(deepspeed_universal.save_dirs[stage], tmp_path / "ds")
    (save_dir / UNIVERSAL_TAG / "zero" / PARAM / "fp32.pt").unlink()
    result = run_cli("verify", save_dir / UNIVERSAL_TAG, "--json")
    assert result.exit_code == 1
    (problem,) = result.json["problems"]
    assert (problem["kind"], problem["path"]) == ("missing_file", f"zero/{PARAM}/fp32.pt")
    assert run_cli("verify", save_dir).exit_code == 1  # the run's gate


@STAGES
def test_inspect_shows_the_parameters_and_the_optimizer_state(
    run_cli: Cli, deepspeed_universal: WrittenUniversal, stage: int
) -> None:
    result = run_cli("inspect", deepspeed_universal.universal(stage), "--json")
    assert result.exit_code == 0
    doc = result.json
    assert (doc["layout"], doc["step"], doc["world_size"]) == ("deepspeed_universal", 4, 2)
    assert "optimizer" in doc["components"] and "optimizer" not in doc["missing_components"]
    assert doc["totals"]["parameters"] == deepspeed_universal.runs[stage].model_parameters
    assert doc["metadata"]["converted_from"] == {"tag": "global_step4", "layout": "deepspeed"}
    tensors = {t["name"]: t for t in doc["tensors"]}
    shape = tensors[PARAM]["shape"]
    for state in ("exp_avg", "exp_avg_sq"):
        moment = tensors[f"optimizer.state.{PARAM}.{state}"]
        assert (moment["component"], moment["dtype"], moment["shape"]) == ("optimizer", "float32", shape)
    step = f"optimizer.state.{PARAM}.step" if stage == 2 else "optimizer.state.group0.step"
    assert tensors[step]["shape"] == []


@STAGES
def test_convert_to_hf_is_zero_to_fp32_bit_for_bit(
    run_cli: Cli, deepspeed_universal: WrittenUniversal, hf_model_dirs: dict[str, Path], stage: int, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    config = hf_model_dirs["single"]  # the tiny Llama's: a DeepSpeed save keeps no config.json
    result = run_cli("convert", deepspeed_universal.universal(stage), out, "--to", "hf", "--config", config, "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["model_check"]["architecture"] == "LlamaForCausalLM"
    assert result.json["layout"] == "deepspeed_universal" and result.json["weights"] == "master"
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    # DeepSpeed's own get_fp32_state_dict_from_zero_checkpoint on the tag the universal checkpoint was made from.
    reference = deepspeed_universal.runs[stage].reference_tensors()
    assert written.keys() == reference.keys()
    for name, tensor in reference.items():
        assert written[name].dtype == tensor.dtype and written[name].equal(tensor), name


@STAGES
def test_diff_against_the_tag_it_was_converted_from(
    run_cli: Cli, deepspeed_universal: WrittenUniversal, stage: int
) -> None:
    tag, universal = deepspeed_universal.save_dirs[stage] / "global_step4", deepspeed_universal.universal(stage)
    model = run_cli("diff", tag, universal, "--json")
    assert model.exit_code == 0 and model.json["equal"] is True
    # The same fp32 copies and moments; the step is kept per group in a tag, per parameter in ZeRO-2's conversion.
    optimizer = run_cli("diff", tag, universal, "--component", "optimizer", "--json").json
    assert optimizer["changed"] == []
    assert all(name.endswith(".step") for name in optimizer["only_in_a"] + optimizer["only_in_b"])


@STAGES
def test_resume_plan_on_another_world_size_loads_the_universal_checkpoint(
    run_cli: Cli, deepspeed_universal: WrittenUniversal, stage: int
) -> None:
    save_dir = deepspeed_universal.save_dirs[stage]
    result = run_cli("resume-plan", save_dir, "--world-size", "4", "--json")
    assert result.exit_code == 0
    doc = result.json
    assert doc["checkpoint"]["url"] == str(save_dir / UNIVERSAL_TAG)
    assert (doc["checkpoint"]["layout"], doc["checkpoint"]["step"]) == ("deepspeed_universal", 4)
    assert doc["world_size_ok"] is True and doc["world_size"]["target"] == 4 and doc["world_size"]["fix"] == ""
    assert doc["resume_hint"] == (
        f"engine.load_checkpoint({str(save_dir)!r}, tag={UNIVERSAL_TAG!r})  # with "
        '"checkpoint": {"load_universal": true} in the DeepSpeed config'
    )
    assert "ds_to_universal" not in result.stdout  # the conversion exists: nobody is told to run it again
    (skipped,) = doc["skipped"]
    assert skipped["url"] == str(save_dir / "global_step4")
    assert f"resuming from {UNIVERSAL_TAG}, a conversion of it that does" in skipped["reason"]
    assert {"model", "optimizer", "scheduler", "trainer_state"} <= set(doc["restores"])
    assert doc["continues_from"]["global_steps"] == 4


def test_resume_plan_on_the_saved_world_size_keeps_the_tag(run_cli: Cli, deepspeed_universal: WrittenUniversal) -> None:
    save_dir = deepspeed_universal.save_dirs[2]
    doc = run_cli("resume-plan", save_dir, "--json").json
    assert doc["checkpoint"]["url"] == str(save_dir / "global_step4") and doc["skipped"] == []
    assert f"{UNIVERSAL_TAG}, its universal conversion, loads on other data-parallel sizes" in doc["world_size"]["note"]


def test_a_broken_conversion_is_not_loaded(run_cli: Cli, deepspeed_universal: WrittenUniversal, tmp_path: Path) -> None:
    save_dir = copy_tree(deepspeed_universal.save_dirs[2], tmp_path / "ds")
    (save_dir / UNIVERSAL_TAG / "zero" / PARAM / "exp_avg.pt").unlink()
    doc = run_cli("resume-plan", save_dir, "--world-size", "4", "--json").json
    assert doc["checkpoint"]["url"] == str(save_dir / "global_step4") and doc["world_size_ok"] is False
    fix = doc["world_size"]["fix"]
    assert fix.startswith("python -m deepspeed.checkpoint.ds_to_universal")
    # A plain engine's tag records no universal_checkpoint_info: ds_to_universal refuses it without this.
    assert f"--output_folder {save_dir / UNIVERSAL_TAG} --inject_missing_state  # first delete " in fix
    assert (
        f"# first delete {UNIVERSAL_TAG}, its universal conversion, which cannot be loaded (fails verify: "
        f"zero/{PARAM}/exp_avg.pt: "
    ) in fix


def test_list_marks_what_latest_universal_names(run_cli: Cli, deepspeed_universal: WrittenUniversal) -> None:
    doc = run_cli("list", deepspeed_universal.save_dirs[3], "--json").json
    found = {Path(c["url"]).name: (c["layout"], c["step"], c["state"], c["latest"]) for c in doc["checkpoints"]}
    assert found == {
        "global_step2": ("deepspeed", 2, "complete", False),
        "global_step4": ("deepspeed", 4, "complete", True),
        UNIVERSAL_TAG: ("deepspeed_universal", 4, "complete", True),
    }


# --- open-instruct and OpenRLHF: the conversions each framework makes, in its own run folder ------------------


def test_open_instruct_loads_its_conversion_with_its_flag(run_cli: Cli, deepspeed_universal: WrittenUniversal) -> None:
    state = deepspeed_universal.open_instruct
    listed = {Path(c["url"]).name: c for c in run_cli("list", state, "--json").json["checkpoints"]}
    universal = listed["ds_universal_global_step4"]
    # Its step is the tag's training step (open-instruct's tag names count optimizer steps).
    assert (universal["layout"], universal["step"], universal["latest"]) == ("deepspeed_universal", 2, True)
    assert run_cli("verify", state).exit_code == 0

    doc = run_cli("resume-plan", state, "--world-size", "4", "--json").json
    assert doc["checkpoint"]["url"] == str(state / "ds_universal_global_step4") and doc["world_size_ok"] is True
    assert doc["resume_hint"] == f"--checkpoint_state_dir {state} --deepspeed_checkpoint_load_universal"
    assert doc["continues_from"]["training_step"] == 2
    assert {"rng", "dataloader"} <= set(doc["restores"])  # the tag's client state, copied with its model states


def test_open_instruct_converts_at_start_up_when_asked(
    run_cli: Cli, deepspeed_universal: WrittenUniversal, tmp_path: Path
) -> None:
    state = copy_tree(deepspeed_universal.open_instruct, tmp_path / "state")
    conversion = state / "ds_universal_global_step4"
    # An unusable conversion under the name open-instruct loads must go first: it would be loaded as it is.
    (conversion / "zero" / PARAM / "fp32.pt").unlink()
    doc = run_cli("resume-plan", state, "--world-size", "4", "--json").json
    assert doc["checkpoint"]["url"] == str(state / "global_step4") and doc["world_size_ok"] is False
    fix = doc["world_size"]["fix"]
    assert fix.startswith(
        f"--checkpoint_state_dir {state} --deepspeed_checkpoint_load_universal  # first delete "
        f"ds_universal_global_step4 (fails verify: zero/{PARAM}/fp32.pt: "
    )
    assert "open-instruct loads an existing ds_universal_global_step4 as it is; at start-up" in fix
    # Without one, the flag is all it takes: open-instruct converts the tag itself.
    shutil.rmtree(conversion)
    (state / "latest_universal").unlink()
    doc = run_cli("resume-plan", state, "--world-size", "4", "--json").json
    assert doc["world_size"]["fix"] == (
        f"--checkpoint_state_dir {state} --deepspeed_checkpoint_load_universal  # at start-up open-instruct "
        "converts the tag `latest` names into ds_universal_global_step4 (ds_to_universal) and loads it"
    )


def test_openrlhf_loads_its_conversions_with_its_flag(run_cli: Cli, deepspeed_universal: WrittenUniversal) -> None:
    ckpt = deepspeed_universal.openrlhf
    listed = {c["url"]: c["layout"] for c in run_cli("list", ckpt, "--json").json["checkpoints"]}
    for role in ("_actor", "_critic"):
        assert listed[str(ckpt / role / "best_global_step4_uni")] == "deepspeed_universal"
    doc = run_cli("resume-plan", ckpt, "--world-size", "4", "--json").json
    assert doc["checkpoint"]["url"] == str(ckpt / "_actor" / "best_global_step4_uni") and doc["world_size_ok"] is True
    assert doc["resume_hint"] == (
        f"--load_checkpoint --ckpt_path {ckpt} --use_ds_universal_ckpt  # OpenRLHF >= 0.10.2: --ckpt.load_enable "
        f"--ckpt.path {ckpt} --ds.use_universal_ckpt"
    )
    assert not any("critic" in w for w in doc["warnings"])


def test_openrlhf_critic_without_a_conversion(
    run_cli: Cli, deepspeed_universal: WrittenUniversal, tmp_path: Path
) -> None:
    ckpt = copy_tree(deepspeed_universal.openrlhf, tmp_path / "ckpt")
    shutil.rmtree(ckpt / "_critic" / "best_global_step4_uni")
    (ckpt / "_critic" / "latest_universal").unlink()
    doc = run_cli("resume-plan", ckpt, "--world-size", "4", "--json").json
    assert doc["checkpoint"]["url"] == str(ckpt / "_actor" / "best_global_step4_uni")
    assert any(
        "makes the critic load what _critic/latest_universal names too, and there is none: its load fails" in w
        for w in doc["warnings"]
    )
