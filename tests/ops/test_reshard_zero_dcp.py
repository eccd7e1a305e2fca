"""`reshard --to dcp` from a DeepSpeed ZeRO tag (`ckptctl.families.zero_tag.state`, the `STATE` of deepspeed,
openrlhf and open_instruct): DeepSpeed's fp32 ZeRO-2 and ZeRO-3 saves of AdamW in two groups (and ZeRO-3 with the
groups cut into sub-groups), resharded, load into
FSDP2 + AdamW on 1 and on 2 gloo ranks (`dcp.load` + `set_state_dict`) holding exactly the weights DeepSpeed's
`zero_to_fp32` rebuilds and the moments, steps and group settings DeepSpeed's own loaded engine holds, and one step
from them gives DeepSpeed's next losses (`tests.writers.zero_dcp_proof`); bf16 saves and OpenRLHF's give
zero_to_fp32's masters; torn tags, ZeRO-0 and optimizers other than Adam are refused before anything is written."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl.contract.capabilities import TRAINING_STATE_SOURCE
from ckptctl.families.zero_tag.state import zero_tag_state
from ckptctl.frameworks.dcp.reshard import WRITER
from ckptctl.layouts import capability, open_checkpoint
from tests.conftest import CliResult, build_once, copy_tree
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.openrlhf_writer import WrittenOpenRlhf
from tests.writers.universal_writer import WrittenUniversal
from tests.writers.zero_dcp_proof import (
    RUNS,
    WrittenZeroFp32,
    ZeroToDcpProof,
    prove_zero_to_dcp,
    write_zero_fp32,
)

pytestmark = pytest.mark.slow

Cli = Callable[..., CliResult]
#: What a DCP resume does not get from these tags, in the order `not_carried` lists it.
NOT_CARRIED = [
    "lr_scheduler",
    "global_steps/global_samples",
    "client_state",
    "rng",
    "loss_scaler",
    "data loader position",
]


@pytest.fixture(scope="session")
def zero_fp32(tmp_path_factory: pytest.TempPathFactory) -> WrittenZeroFp32:
    return build_once(tmp_path_factory, "zero-fp32", write_zero_fp32)


@pytest.fixture(scope="session")
def zero_to_dcp(tmp_path_factory: pytest.TempPathFactory, zero_fp32: WrittenZeroFp32) -> ZeroToDcpProof:
    return build_once(tmp_path_factory, "zero-to-dcp", lambda root: prove_zero_to_dcp(root, zero_fp32))


def test_deepspeed_and_the_frameworks_holding_its_tags_declare_the_tag_source() -> None:
    for layout in ("deepspeed", "openrlhf", "open_instruct"):
        assert capability(layout, TRAINING_STATE_SOURCE) is zero_tag_state


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("run", RUNS)
def test_fsdp2_resumes_the_resharded_tag_holding_deepspeeds_own_state(
    zero_fp32: WrittenZeroFp32, zero_to_dcp: ZeroToDcpProof, run: str, world_size: int
) -> None:
    deepspeed = zero_fp32.deepspeed_view(run)
    got = zero_to_dcp.results(world_size)[run]
    # The model: zero_to_fp32's fp32 weights (and the int64 buffer), exactly.
    assert sorted(got["model"]) == sorted(deepspeed["weights"])
    for name, tensor in deepspeed["weights"].items():
        assert got["model"][name].dtype == tensor.dtype and torch.equal(got["model"][name], tensor), name
    # The optimizer: each parameter's moments as DeepSpeed's loaded engine assembles them, the step torch's AdamW
    # keeps per parameter (a 0-dim float32 tensor) equal to DeepSpeed's per flat partition, the groups' names and
    # settings as DeepSpeed's wrapped AdamW holds them (the FSDP2 side was built with other settings).
    state = got["optim"]["state"]
    assert sorted(state) == sorted(deepspeed["moments"])
    # One step per flat partition: ZeRO-3's sub_group_size cut the decay group's parameters into two of them.
    assert len(deepspeed["steps"]) == (3 if run == "zero3-subgroups" else 2)
    (step,) = {float(s) for s in deepspeed["steps"]}
    for name, moments in deepspeed["moments"].items():
        for key, tensor in moments.items():
            assert torch.equal(state[name][key], tensor), f"{name}.{key}"
        assert state[name]["step"].dtype == torch.float32 and state[name]["step"].shape == ()
        assert float(state[name]["step"]) == step
    groups = got["optim"]["param_groups"]
    assert [sorted(g["params"]) for g in groups] == [sorted(names) for names in deepspeed["group_names"]]
    for group, saved in zip(groups, deepspeed["param_groups"], strict=True):
        # `initial_lr` (StepLR's) is in the output, but dcp.load fills only the keys of the state dict it is given,
        # and a fresh AdamW's groups lack it: a trainer gets it by building its scheduler before loading.
        assert {k: v for k, v in group.items() if k != "params"} == {
            k: v for k, v in saved.items() if k != "initial_lr"
        }
    # One step from it. The loss before the step is the same forward pass on the same weights: bit-identical. The
    # loss after it may differ in the last bits only through the order the ranks' gradients are reduced in
    # (DeepSpeed's ZeRO reduction, FSDP2's reduce-scatter, none on 1 rank): relative 1e-6, fp32's rounding of a few
    # additions. Observed bit-identical (every rank takes the same batch, and (g + g) / 2 = g exactly).
    before, after = got["losses"]
    assert before == deepspeed["losses"][0]
    assert after == pytest.approx(deepspeed["losses"][1], rel=1e-6, abs=0)


def test_the_output_holds_torchs_keys_and_every_saved_setting(zero_to_dcp: ZeroToDcpProof) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(zero_to_dcp.root / "out-zero2")).read_metadata().state_dict_metadata)
    assert {"model.embed.weight", "model.counter", "optim.state.embed.weight.exp_avg"} <= keys
    assert {"optim.state.norm.bias.step", "optim.param_groups.0.initial_lr", "optim.param_groups.1.params"} <= keys
    assert zero_to_dcp.written["zero2"]["files"] == ("__0_0.distcp", ".metadata")


@pytest.mark.parametrize("run", RUNS)
def test_not_carried_names_what_a_dcp_resume_does_not_get(zero_to_dcp: ZeroToDcpProof, run: str) -> None:
    written = zero_to_dcp.written[run]
    assert written["layout"] == "deepspeed"
    why = dict(written["not_carried"])
    assert list(why) == NOT_CARRIED
    assert "last_epoch 2" in why["lr_scheduler"] and "mp_rank_00_model_states.pt" in why["lr_scheduler"]
    assert "global_steps 2" in why["global_steps/global_samples"]
    assert "consumed_samples, epoch" in why["client_state"] and "static loss scale (1.0)" in why["loss_scaler"]


def test_the_command_reshards_a_tag_folder_and_its_output_verifies(
    run_cli: Cli, zero_fp32: WrittenZeroFp32, tmp_path: Path
) -> None:
    dst = tmp_path / "dcp"
    result = run_cli("reshard", zero_fp32.tag("zero3"), dst, "--to", "dcp", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["to"] == "dcp" and result.json["world_size"] is None
    assert [c["what"] for c in result.json["not_carried"]] == NOT_CARRIED
    assert result.json["layout"] == "deepspeed" and result.json["files"] == ["__0_0.distcp", ".metadata"]
    verified = run_cli("verify", dst, "--deep", "--json")
    assert verified.exit_code == 0 and verified.json["ok"] is True


def test_a_torn_tag_is_refused_naming_the_file_and_nothing_is_written(
    run_cli: Cli, zero_fp32: WrittenZeroFp32, tmp_path: Path
) -> None:
    tag = copy_tree(zero_fp32.tag("zero2"), tmp_path / "global_step2")
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    refused = run_cli("reshard", tag, tmp_path / "out", "--to", "dcp")
    assert refused.exit_code == 2 and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in refused.stderr
    assert not (tmp_path / "out").exists()


def _with_state(source: Path, dst: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the tag `source` whose rank-0 optim states (written by DeepSpeed in the test's own fixture) had
    their wrapped optimizer's state dict changed: a hand-made corruption."""
    tag = copy_tree(source, dst)
    path = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    saved = torch.load(path, weights_only=False)  # the fixture's own file
    change(saved["optimizer_state_dict"]["base_optimizer_state"])
    torch.save(saved, path)
    return tag


def test_an_optimizer_other_than_adam_is_refused_naming_its_state(zero_fp32: WrittenZeroFp32, tmp_path: Path) -> None:
    def amsgrad(base: dict[str, Any]) -> None:
        base["state"][0]["max_exp_avg_sq"] = base["state"][0]["exp_avg_sq"].clone()

    reason = WRITER.refusal(open_checkpoint(str(_with_state(zero_fp32.tag("zero2"), tmp_path / "a", amsgrad))), None)
    assert reason is not None and "max_exp_avg_sq" in reason and "Adam" in reason

    def no_state(base: dict[str, Any]) -> None:
        base["state"].clear()

    reason = WRITER.refusal(open_checkpoint(str(_with_state(zero_fp32.tag("zero2"), tmp_path / "b", no_state))), None)
    assert reason is not None and "no state" in reason

    def ungrouped(base: dict[str, Any]) -> None:
        base["param_groups"][1]["params"] = []

    reason = WRITER.refusal(open_checkpoint(str(_with_state(zero_fp32.tag("zero2"), tmp_path / "c", ungrouped))), None)
    assert reason is not None and "cannot be proved" in reason


def test_zero0_is_refused(deepspeed_runs: dict[int, WrittenDeepSpeed]) -> None:
    reason = WRITER.refusal(open_checkpoint(str(deepspeed_runs[0].save_dir)), None)
    assert reason is not None and "no ZeRO optimizer partitions" in reason


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_tags_give_zero_to_fp32s_masters_and_adams_state(
    deepspeed_runs: dict[int, WrittenDeepSpeed], stage: int
) -> None:
    # DeepSpeed's bf16 training (`bf16_zero_pp_rank_*` optim files): the fp32 masters, not the bf16 module weights.
    written = deepspeed_runs[stage]
    state = zero_tag_state(open_checkpoint(str(written.save_dir)))
    reference = written.reference_tensors()
    model = {name: tensor.read() for name, tensor in state.model}
    assert sorted(model) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(model[name].to(tensor.dtype), tensor), name
    assert [len(g["params"]) for g in state.param_groups] == [len(state.optimizer)]
    for name, per_param in state.optimizer.items():
        assert list(per_param) == ["step", "exp_avg", "exp_avg_sq"]
        assert per_param["exp_avg"].shape == model[name].shape == per_param["exp_avg_sq"].shape  # type: ignore[union-attr]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_openrlhfs_actor_reshards_to_zero_to_fp32s_masters(
    run_cli: Cli, openrlhf_ppo: WrittenOpenRlhf, tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    dst = tmp_path / "actor-dcp"
    result = run_cli("reshard", openrlhf_ppo.actor, dst, "--to", "dcp", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["layout"] == "openrlhf"
    reference = load_file(str(openrlhf_ppo.reference))
    loaded = {f"model.{name}": torch.empty_like(tensor) for name, tensor in reference.items()}
    dcp.load(loaded, checkpoint_id=str(dst), no_dist=True)
    for name, tensor in reference.items():
        assert torch.equal(loaded[f"model.{name}"], tensor), name
    shutil.rmtree(dst)


def test_the_universal_writer_unflattens_moments_saved_with_their_group_padding(
    zero_fp32: WrittenZeroFp32, tmp_path: Path
) -> None:
    # ZeRO-2 saves rank 1's fp32 partition of the no-decay group without the 3 elements padding it (17 of 20) and
    # its moments with them (20): `--to deepspeed-universal` reads these moments too, as DeepSpeed's engine does.
    from ckptctl.ops.reshard import ReshardOptions, reshard

    reshard(str(zero_fp32.save_dir("zero2")), str(tmp_path / "out"), ReshardOptions(to="deepspeed-universal"))
    zero = tmp_path / "out" / "global_step2" / "zero"
    for name, moments in zero_fp32.deepspeed_view("zero2")["moments"].items():
        for key, tensor in moments.items():
            assert torch.equal(torch.load(zero / name / f"{key}.pt", weights_only=True)["param"], tensor), name


@pytest.mark.parametrize(
    ("where", "layout"), [("open-instruct/state", "open_instruct"), ("openrlhf/_critic", "openrlhf")]
)
def test_open_instruct_and_openrlhfs_critic_reshard_naming_what_they_keep_beside_the_tag(
    run_cli: Cli, deepspeed_universal: WrittenUniversal, tmp_path: Path, where: str, layout: str
) -> None:
    # open-instruct's tag (ZeRO-2) holds its data-loader position in driver_state.pt and its RNG in the client
    # state; OpenRLHF's critic tag is ZeRO-3. Both masters are DeepSpeed's own zero_to_fp32 weights of their run.
    folder = deepspeed_universal.openrlhf.parent / where
    tag = (folder / "latest").read_text().strip()
    result = run_cli("reshard", folder / tag, tmp_path / "dcp", "--to", "dcp", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["layout"] == layout
    why = {c["what"]: c["why"] for c in result.json["not_carried"]}
    if layout == "open_instruct":
        assert "driver_state.pt" in why and "rng_states" in why["client_state"]
    assert run_cli("verify", tmp_path / "dcp", "--json").json["ok"] is True
