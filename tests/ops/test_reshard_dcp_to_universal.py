"""`reshard --to deepspeed-universal` from a torch DCP training state (`frameworks/deepspeed/universal_from_state`):
a 2-rank FSDP2 + AdamW run (decay/no-decay groups), saved by `dcp.save(get_state_dict)` and by ckptctl's
`CheckpointManager`, resharded; DeepSpeed 0.19.8 (ZeRO-1 and ZeRO-2, fp32, torch AdamW) loads it with
`"load_universal": true` on 1 and on 2 gloo ranks (`tests.writers.dcp_to_universal_proof`).

Tolerance: none. Every fp32 master, moment, step and group setting equals what FSDP2 itself resumes from the
source, and one training step gives the source's own losses to the bit: both sides run the same fp32 forward on
the same batch, the data-parallel mean of equal per-rank gradients is the gradient itself (halving is exact), and
torch's AdamW updates each element alike whether it steps a DTensor shard or ZeRO's flat partition.

Refused before anything is written: optimizers whose state is not Adam's, parameters that are not float32, a group
whose parameters took different numbers of steps, a layout with neither a ZeRO tag nor a training-state source.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl.frameworks.deepspeed.reshard import WRITER
from ckptctl.layouts import open_checkpoint
from tests.conftest import CliResult, build_once
from tests.ops.same_state import assert_same_state
from tests.writers.dcp_to_universal_proof import SOURCES, STAGES, DcpToUniversalProof, prove_dcp_to_universal
from tests.writers.reshard_dcp_proof import DcpReshardProof, prove_dcp_reshard

Cli = Callable[..., CliResult]


@pytest.fixture(scope="session")
def dcp_source(tmp_path_factory: pytest.TempPathFactory) -> DcpReshardProof:
    """The DCP reshard proof's sources and FSDP2's own resumes of them (`tests/ops/test_reshard_dcp.py`'s fixture)."""
    return build_once(tmp_path_factory, "dcp-reshard", prove_dcp_reshard)


@pytest.fixture(scope="session")
def to_universal(tmp_path_factory: pytest.TempPathFactory, dcp_source: DcpReshardProof) -> DcpToUniversalProof:
    return build_once(tmp_path_factory, "dcp-to-universal", lambda root: prove_dcp_to_universal(root, dcp_source.root))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("out", [out for out, _ in SOURCES])
def test_deepspeed_loads_the_fsdp2_state_exactly_and_steps_as_fsdp2_does(
    dcp_source: DcpReshardProof, to_universal: DcpToUniversalProof, world_size: int, stage: int, out: str
) -> None:
    want = dcp_source.results(world_size)["source-dcp"]  # FSDP2's own resume of the source, and its next step
    got = to_universal.results(world_size)[(out, stage)]
    names = list(got["state"])
    assert sorted(names) == sorted(set(want["model"]) - {"counter"})  # every parameter: TinyNet's buffer aside
    for name in names:
        held = want["optim"]["state"][name]
        assert_same_state(got["state"][name]["fp32"], want["model"][name], f"{name}.fp32")
        assert_same_state(got["state"][name]["exp_avg"], held["exp_avg"], f"{name}.exp_avg")
        assert_same_state(got["state"][name]["exp_avg_sq"], held["exp_avg_sq"], f"{name}.exp_avg_sq")
    groups = want["optim"]["param_groups"]
    assert len(got["groups"]) == len(groups) == 2
    for g, (loaded, source) in enumerate(zip(got["groups"], groups, strict=True)):
        settings = {k: v for k, v in source.items() if k != "params"}
        # FSDP2's resume leaves out `initial_lr`, which the source's StepLR put in its groups; DeepSpeed gets it too.
        assert loaded["settings"] == {**settings, "initial_lr": 0.01}, g
        assert settings["weight_decay"] == (0.1, 0.0)[g] and settings["lr"] == 0.0025  # after StepLR's 2 steps
        assert_same_state(loaded["step"], want["optim"]["state"][source["params"][0]]["step"], f"group {g} step")
    assert got["global_steps"] == 3  # the source's 2 optimizer steps, and the one taken
    assert got["losses"] == want["losses"]


@pytest.mark.slow
def test_the_output_names_what_deepspeed_does_not_take(to_universal: DcpToUniversalProof) -> None:
    written = to_universal.written
    dcp = dict(written["dcp"]["not_carried"])
    assert list(dcp) == [
        "trainer_state",
        "lr_scheduler",
        "rng",
        "data loader position",
        "buffers and frozen parameters (counter)",
    ]
    assert (
        "load_lr_scheduler_states=False" in dcp["lr_scheduler"] and "global_steps is 2" in dcp["data loader position"]
    )
    assert {"scheduler", "rng", "step", "lr_scheduler"} <= set(dict(written["native/step-2"]["not_carried"]))
    files = written["dcp"]["files"]
    assert files[-3:] == (
        "global_step2/zero/optimizer_state.pt",
        "global_step2/mp_rank_00_model_states.pt",
        "latest_universal",
    )
    assert "global_step2/zero/embed.weight/step.pt" in files
    assert "ZeRO stage 1 or 2" in written["dcp"]["resume_hint"]


@pytest.mark.slow
def test_the_model_states_hold_what_deepspeeds_universal_load_reads(to_universal: DcpToUniversalProof) -> None:
    from ckptctl.formats.torch_pickle import open_torch_pickle

    states = open_torch_pickle(str(to_universal.root / "uni-dcp" / "global_step2" / "mp_rank_00_model_states.pt")).root
    assert states["global_steps"] == 2 and states["dp_world_size"] == 2 and states["lr_scheduler"] is None
    assert "module" not in states  # not read under load_universal: the weights come from zero/


@pytest.mark.slow
def test_the_command_writes_it_and_list_and_verify_read_it(
    run_cli: Cli, dcp_source: DcpReshardProof, tmp_path: Path
) -> None:
    dst = tmp_path / "ds"
    result = run_cli(
        "reshard", dcp_source.root / "dcp", dst, "--to", "deepspeed-universal", "--world-size", "3", "--json"
    )
    assert result.exit_code == 0, result.stderr
    assert result.json["to"] == "deepspeed-universal" and result.json["world_size"] == 3
    assert result.json["tensors"] == 24 and result.json["bytes"] == 3 * 4 * 293
    assert {"lr_scheduler", "rng", "data loader position", "trainer_state"} <= {
        c["what"] for c in result.json["not_carried"]
    }
    assert (dst / "latest_universal").read_text() == "global_step2"
    listed = run_cli("list", dst, "--json").json["checkpoints"]
    assert [(c["layout"], c["step"], c["state"], c["latest"]) for c in listed] == [
        ("deepspeed_universal", 2, "complete", True)
    ]
    assert run_cli("verify", dst, "--deep").exit_code == 0
    plan = run_cli("resume-plan", dst, "--world-size", "1", "--json").json
    assert plan["checkpoint"]["layout"] == "deepspeed_universal" and plan["world_size_ok"] is True
    assert "load_universal" in plan["resume_hint"]


def _dcp_state(
    folder: Path,
    optimizer: Callable[[Any], torch.optim.Optimizer],
    dtype: Any = torch.float32,
    frozen_bias: bool = False,
) -> Path:
    """A single-process `dcp.save` of `get_state_dict` of a small model and `optimizer` over it, after two steps
    (the second, with `frozen_bias`, without the bias's gradient: torch's optimizers then leave its state alone)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(3, 2).to(dtype)
    opt = optimizer(model.parameters())
    for step in range(2):
        model(torch.ones(1, 3, dtype=dtype)).sum().backward()
        if frozen_bias and step == 1:
            model.bias.grad = None
        opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder), no_dist=True)
    return folder


def _refused(run_cli: Cli, source: Path, dst: Path) -> str:
    """Why the writer refuses `source`; the command refuses it too (exit 2), naming the same, with nothing at `dst`."""
    reason = WRITER.refusal(open_checkpoint(str(source)), None)
    assert reason is not None
    refused = run_cli("reshard", source, dst, "--to", "deepspeed-universal")
    assert refused.exit_code == 2 and reason in " ".join(refused.stderr.split())
    assert not dst.exists()
    return reason


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(
    ("optimizer", "dtype", "reason"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), torch.float32, "no betas/eps: not an Adam-family"),
        (lambda p: torch.optim.Adam(p, amsgrad=True), torch.float32, "holds exp_avg, exp_avg_sq, max_exp_avg_sq, step"),
        (torch.optim.AdamW, torch.bfloat16, "'weight' is bfloat16; DeepSpeed keeps float32 masters"),
    ],
    ids=["sgd", "amsgrad", "bf16"],
)
def test_what_cannot_be_carried_exactly_is_refused_with_nothing_written(
    run_cli: Cli, tmp_path: Path, optimizer: Callable[[Any], torch.optim.Optimizer], dtype: Any, reason: str
) -> None:
    source = _dcp_state(tmp_path / "src", optimizer, dtype)
    assert reason in _refused(run_cli, source, tmp_path / "dst")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_group_whose_parameters_took_different_steps_is_refused(run_cli: Cli, tmp_path: Path) -> None:
    source = _dcp_state(tmp_path / "src", torch.optim.AdamW, frozen_bias=True)
    reason = _refused(run_cli, source, tmp_path / "dst")
    assert "('weight' at 2, 'bias' at 1); DeepSpeed keeps one step per group" in reason


def test_a_layout_with_neither_a_zero_tag_nor_a_state_source_is_refused(run_cli: Cli, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "hf").mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "config.json").write_text("{}")
    refused = run_cli("reshard", tmp_path / "hf", tmp_path / "dst", "--to", "deepspeed-universal")
    assert refused.exit_code == 2 and "no DeepSpeed ZeRO tag" in refused.stderr
    assert not (tmp_path / "dst").exists()
