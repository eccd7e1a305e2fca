"""`reshard --to dcp` from a Hugging Face Trainer `checkpoint-N` (`ckptctl.frameworks.hf_trainer.state.SOURCE`): the
Trainer's optimizer.pt, keyed by parameter index over its decay / no-decay groups, is named by what transformers'
own code says the groups hold. An FSDP2 model of the same class with torch AdamW in the Trainer's groups loads the
output on 1 and on 2 gloo ranks (`dcp.load` + `set_state_dict`) into exactly the state the Trainer's own resume
holds, and takes the Trainer's next steps with the Trainer's losses (`tests.writers.reshard_dcp_proof`); what
cannot be proved is refused before anything is written.

`reshard --to deepspeed-universal` from the same checkpoints (`frameworks/deepspeed/universal_from_state`): DeepSpeed
0.19.8 (ZeRO-1 and ZeRO-2, fp32, torch AdamW in the Trainer's groups, gradient clipping at the Trainer's
max_grad_norm) loads the output with `"load_universal": true` on 1 and on 2 gloo ranks into exactly the state the
Trainer's own resume holds, and takes the Trainer's step 3 with its losses (`tests.writers.trainer_to_universal_proof`).
Tied embeddings: the output holds the one parameter (`zero/model.embed_tokens.weight/`), which DeepSpeed's model of
the same config also holds once."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl.contract.capabilities import TRAINING_STATE_SOURCE, StateTensor
from ckptctl.errors import CkptctlError
from ckptctl.families.param_state import grouped_state
from ckptctl.frameworks.dcp.reshard import WRITER
from ckptctl.frameworks.hf_trainer.state import SOURCE
from ckptctl.layouts import capability, open_checkpoint
from tests.conftest import CliResult, build_once, copy_tree
from tests.ops.same_state import assert_same_state
from tests.writers.megatron_writer import WrittenMegatron
from tests.writers.reshard_dcp_proof import TrainerToDcpProof, prove_trainer_to_dcp
from tests.writers.trainer_resume_writer import (
    WEIGHT_DECAY,
    WrittenTrainerResume,
    WrittenTrainerResumes,
    write_trainer_resume,
)
from tests.writers.trainer_to_universal_proof import (
    STAGES,
    TrainerToUniversalProof,
    prove_trainer_to_universal,
)

Cli = Callable[..., CliResult]
#: What the Trainer's resume restores from checkpoint-2 besides the model and optimizer: every target lists it.
TRAINER_NOT_CARRIED = (
    "scheduler.pt",
    "rng_state.pth",
    "trainer_state.json",
    "data loader position",
    "gradient accumulation",
    "training_args.bin",
    "config.json",
)


@pytest.fixture(scope="session")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> WrittenTrainerResumes:
    return build_once(tmp_path_factory, "trainer-resume", write_trainer_resume)


@pytest.fixture(scope="session")
def trainer_resume(trainer_runs: WrittenTrainerResumes) -> WrittenTrainerResume:
    return trainer_runs.untied


@pytest.fixture(scope="session")
def trainer_to_dcp(tmp_path_factory: pytest.TempPathFactory, trainer_runs: WrittenTrainerResumes) -> TrainerToDcpProof:
    runs = {
        name: (run.checkpoint, run.record)
        for name, run in (("untied", trainer_runs.untied), ("tied", trainer_runs.tied))
    }
    return build_once(tmp_path_factory, "trainer-to-dcp", lambda root: prove_trainer_to_dcp(root, runs))


@pytest.fixture(scope="session")
def trainer_to_universal(
    tmp_path_factory: pytest.TempPathFactory, trainer_runs: WrittenTrainerResumes
) -> TrainerToUniversalProof:
    runs = {
        name: (run.checkpoint, run.record)
        for name, run in (("untied", trainer_runs.untied), ("tied", trainer_runs.tied))
    }
    return build_once(tmp_path_factory, "trainer-to-universal", lambda root: prove_trainer_to_universal(root, runs))


def _record(trainer_resume: WrittenTrainerResume) -> dict[str, Any]:
    return torch.load(trainer_resume.record, weights_only=True)  # written by the writer


def test_the_trainer_source_is_registered() -> None:
    assert capability("hf_trainer", TRAINING_STATE_SOURCE) is SOURCE


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(("case", "decay_group"), [("untied", 16), ("tied", 15)])
def test_fsdp2_resumes_the_resharded_trainer_state_as_the_trainer_resumes_it(
    trainer_to_dcp: TrainerToDcpProof, trainer_runs: WrittenTrainerResumes, world_size: int, case: str, decay_group: int
) -> None:
    from safetensors.torch import load_file

    run: WrittenTrainerResume = getattr(trainer_runs, case)
    got = trainer_to_dcp.results(case, world_size)
    record = _record(run)
    # Both groups in use and different: a parameter put in the wrong group would step differently. Tied, the
    # embedding and the output layer are one parameter, numbered once.
    groups = record["optim"]["param_groups"]
    assert [(g["weight_decay"], len(g["params"])) for g in groups] == [(WEIGHT_DECAY, decay_group), (0.0, 5)]
    # The model: the Trainer's saved weights (tied, save_pretrained leaves lm_head.weight out), and what its resume
    # holds (lm_head.weight too), exactly.
    saved = load_file(str(run.checkpoint / "model.safetensors"))
    assert sorted(set(got["model"]) - set(saved)) == (["lm_head.weight"] if case == "tied" else [])
    for name, tensor in saved.items():
        assert torch.equal(got["model"][name], tensor), name
    assert_same_state(got["model"], record["model"], "model")
    # The optimizer: the Trainer's resumed optimizer named by torch (by parameter identity), exactly.
    assert_same_state(got["optim"], record["optim"], "optim")
    # ... and optimizer.pt read independently, its indices named by the live Trainer's optimizer.
    optimizer_pt = torch.load(run.checkpoint / "optimizer.pt", weights_only=True)
    names = record["names_by_index"]
    assert {names[index] for index in optimizer_pt["state"]} == set(got["optim"]["state"])
    for index, state in optimizer_pt["state"].items():
        assert_same_state(got["optim"]["state"][names[index]], state, names[index])
    for loaded, saved_group in zip(got["optim"]["param_groups"], optimizer_pt["param_groups"], strict=True):
        assert loaded["params"] == [names[index] for index in saved_group["params"]]
        assert {k: v for k, v in loaded.items() if k != "params"} == {
            k: v for k, v in saved_group.items() if k != "params"
        }
    # The Trainer's next two steps: step 3's loss comes from the loaded weights alone (the same to the bit); step 4's
    # after one AdamW step of the loaded optimizer (decay per group, the learning rate the groups hold, gradients
    # clipped to norm 1 as the Trainer does), where a norm summed over 2 ranks' shards may round differently
    # (observed: the same to the bit on 1 and 2 ranks). The LR scheduler loaded from scheduler.pt (not carried)
    # gives step 4 the Trainer's learning rate.
    losses = [loss for loss, _ in got["steps"]]
    want = [float(step["loss"]) for step in record["steps"]]
    assert losses[0] == want[0]
    assert losses[1] == pytest.approx(want[1], rel=1e-6, abs=0)
    assert [lrs for _, lrs in got["steps"]] == [step["lr"] for step in record["steps"]]


@pytest.mark.slow
def test_not_carried_names_what_a_trainer_resume_restores_and_dcp_does_not(trainer_to_dcp: TrainerToDcpProof) -> None:
    not_carried = dict(trainer_to_dcp.written["untied"]["not_carried"])
    assert list(not_carried) == list(TRAINER_NOT_CARRIED)
    assert "global_step 2" in not_carried["trainer_state.json"]
    assert "gradient_accumulation_steps=1" in not_carried["gradient accumulation"]
    assert trainer_to_dcp.written["untied"]["files"] == ("__0_0.distcp", ".metadata")


@pytest.mark.slow
def test_the_command_writes_dcp_from_a_trainer_checkpoint(
    run_cli: Cli, trainer_resume: WrittenTrainerResume, tmp_path: Path
) -> None:
    dst = tmp_path / "dcp"
    result = run_cli("reshard", trainer_resume.checkpoint, dst, "--to", "dcp", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["to"] == "dcp" and result.json["tensors"] == 84  # 21 parameters, their moments and steps
    assert {"scheduler.pt", "rng_state.pth", "trainer_state.json"} <= {c["what"] for c in result.json["not_carried"]}
    listed = run_cli("list", dst, "--json").json["checkpoints"]
    assert [(c["layout"], c["state"]) for c in listed] == [("dcp", "complete")]


@pytest.mark.slow
def test_groups_the_model_from_config_json_does_not_make_are_refused_with_nothing_written(
    run_cli: Cli, trainer_resume: WrittenTrainerResume, tmp_path: Path
) -> None:
    # A config.json that says the embeddings are tied: transformers' model then has 20 parameters, 15 of them in the
    # decay group, and the saved optimizer numbers 16 there, so which index is which parameter is not proved.
    source = copy_tree(trainer_resume.checkpoint, tmp_path / "checkpoint-2")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    refused = run_cli("reshard", source, tmp_path / "out", "--to", "dcp")
    assert refused.exit_code == 2
    assert "parameter group 0 numbers 16 parameters" in refused.stderr and "puts 15 there" in refused.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_model_code_shipped_with_the_checkpoint_and_a_missing_transformers_are_refused(
    trainer_resume: WrittenTrainerResume, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = copy_tree(trainer_resume.checkpoint, tmp_path / "checkpoint-2")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "modeling.Model"}}))
    reason = WRITER.refusal(open_checkpoint(str(source)), None)
    assert reason is not None and "auto_map" in reason and "never runs it" in reason
    (source / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr("ckptctl.frameworks.hf_trainer.state.has_transformers_5", lambda: False)
    reason = WRITER.refusal(open_checkpoint(str(source)), None)
    assert reason is not None and "install transformers" in reason


def _tensor(*shape: int) -> StateTensor:
    return StateTensor("float32", shape, lambda: None)


def test_grouped_state_names_each_groups_indices_in_order_and_refuses_what_does_not_match() -> None:
    params = {"a.weight": _tensor(2, 3), "norm.weight": _tensor(3), "b.weight": _tensor(3, 2)}
    members = [["a.weight", "b.weight"], ["norm.weight"]]
    groups = [{"weight_decay": 0.1, "params": [0, 1]}, {"weight_decay": 0.0, "params": [2]}]
    state = {0: {"exp_avg": _tensor(2, 3)}, 1: {"exp_avg": _tensor(3, 2)}, 2: {"exp_avg": _tensor(3), "step": 1}}
    named, named_groups = grouped_state(members, params, state, groups, "optimizer.pt", "built", "hint")
    assert list(named) == ["a.weight", "b.weight", "norm.weight"]
    assert [g["params"] for g in named_groups] == members and named_groups[0]["weight_decay"] == 0.1
    with pytest.raises(CkptctlError, match="2 parameter groups, and built makes 1"):
        grouped_state([["a.weight"]], params, state, groups, "optimizer.pt", "built", "hint")
    with pytest.raises(CkptctlError, match="group 0 numbers 2 parameters, and built puts 1 there"):
        grouped_state([["a.weight"], ["b.weight", "norm.weight"]], params, state, groups, "optimizer.pt", "built", "")
    swapped = [["b.weight", "a.weight"], ["norm.weight"]]
    with pytest.raises(CkptctlError, match="not the model's"):
        grouped_state(swapped, params, state, groups, "optimizer.pt", "built", "hint")
    with pytest.raises(CkptctlError, match=r"numbered 0, 1, \.\.\. in order"):
        grouped_state(members, params, state, [groups[0], {"params": [3]}], "optimizer.pt", "built", "hint")
    with pytest.raises(CkptctlError, match="state of parameter 3"):
        grouped_state(members, params, {**state, 3: {}}, groups, "optimizer.pt", "built", "hint")


@pytest.mark.slow
def test_a_megatron_dist_ckpt_is_refused_saying_why_with_nothing_written(
    run_cli: Cli, megatron_runs: WrittenMegatron, tmp_path: Path
) -> None:
    # megatron-core saves its param_groups without their parameters: group membership is not in the checkpoint.
    refused = run_cli("reshard", megatron_runs.iteration(2), tmp_path / "out", "--to", "dcp")
    assert refused.exit_code == 2
    assert "param_groups without their parameters" in refused.stderr and "--to dcp" in refused.stderr
    assert not (tmp_path / "out").exists()
    reason = WRITER.refusal(open_checkpoint(str(megatron_runs.tied)), None)
    assert reason is not None and "without optimizer state" in reason


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", ["untied", "tied"])
def test_deepspeed_resumes_the_resharded_trainer_state_as_the_trainer_resumes_it(
    trainer_to_universal: TrainerToUniversalProof,
    trainer_runs: WrittenTrainerResumes,
    world_size: int,
    stage: int,
    case: str,
) -> None:
    record = _record(getattr(trainer_runs, case))
    got = trainer_to_universal.results(case, world_size)[stage]
    optim = record["optim"]
    # Every parameter the Trainer optimizes, once. Tied, DeepSpeed's model holds the embedding and the output layer
    # as one parameter (named_parameters gives its first name), as the Trainer's does.
    assert sorted(got["state"]) == sorted(optim["state"])
    assert sorted(set(record["model"]) - set(got["state"])) == (["lm_head.weight"] if case == "tied" else [])
    assert got["tied"] is (case == "tied")
    for name, loaded in got["state"].items():
        assert_same_state(loaded["fp32"], record["model"][name], f"{name}.fp32")
        for key in ("exp_avg", "exp_avg_sq"):
            assert_same_state(loaded[key], optim["state"][name][key], f"{name}.{key}")
    if case == "tied":
        assert_same_state(got["state"]["model.embed_tokens.weight"]["fp32"], record["model"]["lm_head.weight"], "tie")
    # Each group's settings (lr, weight_decay, betas, eps, and the rest AdamW keeps, initial_lr from the Trainer's
    # scheduler) and step, exactly: the decay group first, as the Trainer builds them.
    assert len(got["groups"]) == len(optim["param_groups"]) == 2
    for loaded, resumed in zip(got["groups"], optim["param_groups"], strict=True):
        assert loaded["settings"] == {k: v for k, v in resumed.items() if k != "params"}
        assert_same_state(loaded["step"], optim["state"][resumed["params"][0]]["step"], "step")
    assert [g["settings"]["weight_decay"] for g in got["groups"]] == [WEIGHT_DECAY, 0.0]
    assert got["global_steps"] == 3  # the Trainer's 2 optimizer steps, and the one taken
    # Step 3's loss comes from the loaded weights alone: the same fp32 forward on the same batch, to the bit. Step
    # 4's follows one AdamW step with the gradients clipped to norm 1 (the Trainer's grad norm is ~1.55 there, so
    # the clip acts); DeepSpeed divides by (norm + 1e-6) / 1 where torch multiplies by 1 / (norm + 1e-6), and a
    # norm summed over 2 ranks' partitions may round differently, hence rel 1e-6 (observed: the same to the bit on
    # 1 and 2 ranks, ZeRO-1 and ZeRO-2).
    want = [float(step["loss"]) for step in record["steps"]]
    assert got["losses"][0] == want[0]
    assert got["losses"][1] == pytest.approx(want[1], rel=1e-6, abs=0)


@pytest.mark.slow
def test_the_universal_output_names_what_deepspeed_does_not_take_and_how_tied_weights_go(
    trainer_to_universal: TrainerToUniversalProof,
) -> None:
    untied = trainer_to_universal.written["untied"]
    not_carried = dict(untied["not_carried"])
    assert list(not_carried) == [*TRAINER_NOT_CARRIED, "lr_scheduler", "rng"]  # DeepSpeed's own two after the Trainer's
    assert "skips the batches of the first 2" in not_carried["data loader position"]
    assert "global_steps is 2" in not_carried["data loader position"]
    assert "global_step2/zero/lm_head.weight/fp32.pt" in untied["files"]
    assert "Tied" not in untied["resume_hint"]
    tied = trainer_to_universal.written["tied"]
    # lm_head.weight is the embedding: no folder of its own, and not listed as something the load leaves out.
    assert not any("lm_head" in f for f in tied["files"])
    assert "global_step2/zero/model.embed_tokens.weight/fp32.pt" in tied["files"]
    assert [what for what, _ in tied["not_carried"]] == list(not_carried)
    assert "Tied weights (lm_head.weight is model.embed_tokens.weight)" in tied["resume_hint"]
    assert "finds no zero/lm_head.weight/ and its load fails" in tied["resume_hint"]
    # ... as it does: DeepSpeed's model with untied embeddings looks for the output layer's folder.
    raised = (trainer_to_universal.root / "untied-model-load.txt").read_text()
    assert raised.startswith("FileNotFoundError") and raised.endswith("global_step2/zero/lm_head.weight'")


@pytest.mark.slow
def test_the_command_writes_deepspeed_universal_from_a_trainer_checkpoint(
    run_cli: Cli, trainer_resume: WrittenTrainerResume, tmp_path: Path
) -> None:
    dst = tmp_path / "ds"
    result = run_cli("reshard", trainer_resume.checkpoint, dst, "--to", "deepspeed-universal", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["to"] == "deepspeed-universal" and result.json["layout"] == "hf_trainer"
    assert result.json["tensors"] == 63  # 21 parameters: master, exp_avg, exp_avg_sq
    assert {"scheduler.pt", "rng_state.pth", "trainer_state.json", "lr_scheduler"} <= {
        c["what"] for c in result.json["not_carried"]
    }
    assert (dst / "latest_universal").read_text() == "global_step2"
    listed = run_cli("list", dst, "--json").json["checkpoints"]
    assert [(c["layout"], c["step"], c["state"]) for c in listed] == [("deepspeed_universal", 2, "complete")]
    assert run_cli("verify", dst, "--deep").exit_code == 0
