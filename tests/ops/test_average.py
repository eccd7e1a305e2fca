"""`average` on real writers' checkpoints: the demo's native run, its 2-rank FSDP2 DCP steps and ckptctl's own
multi-rank saves, HF Trainer checkpoints and `save_pretrained` folders, a DeepSpeed ZeRO-2 tag and DeepSpeed's
own `zero_to_fp32` export of it.

Every output is compared bit for bit with a reference the test computes with torch from the inputs as their
writers' own readers give them (safetensors' `load_file`, torch's DCP loader), with the formula the command
documents: float64, in input order, each product and sum rounded once, then one rounding to nearest even.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptctl.ops.average import AverageOptions, average
from ckptctl.ops.convert import Target
from tests.conftest import CliResult
from tests.formats.test_cast import _correctly_rounded_bfloat16
from tests.writers.dcp_load_ranks import dcp_load_on_ranks
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.trainer_writer import WrittenTrainerRun

Cli = Callable[..., CliResult]
Tensors = dict[str, torch.Tensor]


def _safetensors(folder: Path) -> Tensors:
    tensors: Tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def _dcp_model(folder: Path) -> Tensors:
    """The `model` entry of a DCP save as torch's own loader reads it (no process group)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        return dict(_load_state_dict_from_keys({"model"}, checkpoint_id=str(folder))["model"])


def _weighted(inputs: Sequence[Tensors], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """float64: acc = w1·x1, then acc = acc + wi·xi (separate roundings: torch multiplies, then adds)."""
    out = {}
    for name in inputs[-1]:
        acc = weights[0] * inputs[0][name].double()
        for tensors, weight in zip(inputs[1:], weights[1:], strict=True):
            acc = acc + weight * tensors[name].double()
        out[name] = acc
    return out


def _ema(inputs: Sequence[Tensors], decay: float) -> dict[str, torch.Tensor]:
    """float64: acc = x_oldest, then acc = decay·acc + (1 - decay)·x."""
    out = {}
    for name in inputs[-1]:
        acc = inputs[0][name].double()
        for tensors in inputs[1:]:
            acc = decay * acc + (1 - decay) * tensors[name].double()
        out[name] = acc
    return out


def _rounded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 -> `dtype`, rounded once to nearest even (bf16: from the float64 value, never via float32)."""
    if dtype == torch.bfloat16:
        bits = _correctly_rounded_bfloat16(values.numpy()).view(np.uint16)
        return torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)
    return values.to(dtype)  # float32 and float16: one IEEE rounding


def _assert_bits(got: Tensors, want: dict[str, torch.Tensor]) -> None:
    """Equal names, dtypes, shapes and bytes (so -0.0 and 0.0 differ)."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def _unprefixed(tensors: Tensors) -> Tensors:
    return {name.removeprefix("model."): t for name, t in tensors.items()}


# --- mixed layouts: native, FSDP2 DCP of 2 ranks, ckptctl's multi-rank save ----------------------------------


@pytest.fixture(scope="module")
def demo_inputs(demo_dir: Path) -> tuple[list[Path], list[Tensors]]:
    """Steps 10, 20 and 30 of three layouts, and their models as their writers' readers give them."""
    paths = [demo_dir / "native" / "step-10", demo_dir / "dcp" / "step-20", demo_dir / "distributed" / "step-30"]
    tensors = [
        load_file(str(paths[0] / "model.safetensors")),
        _dcp_model(paths[1]),
        _dcp_model(paths[2] / "dcp"),
    ]
    return paths, tensors


@pytest.fixture(params=["one block", "blocks", "whole reads"])
def blocks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's tensors fit in one block; cut into many (odd-sized, on threads, across the chunks of a DCP
    tensor) they must sum the same, read block by block from the files' raw ranges or, as where there are
    none, read whole first."""
    from ckptctl.ops import average as module

    if request.param == "blocks":
        monkeypatch.setattr(module, "_STREAM_BLOCK", 89)
    if request.param == "whole reads":
        monkeypatch.setattr(module._StreamedInputs, "open", classmethod(lambda cls, sources, numel: None))
        monkeypatch.setattr(module, "_BLOCK", 97)


@pytest.mark.usefixtures("blocks")
def test_weighted_average_of_three_layouts_is_bit_exact(
    demo_inputs: tuple[list[Path], list[Tensors]], tmp_path: Path
) -> None:
    paths, tensors = demo_inputs
    weights = (0.2, 0.3, 0.5)
    # The demo's toy model has no config: its stored names, as asked.
    result = average([str(p) for p in paths], str(tmp_path / "out"), AverageOptions(weights=weights, mapping="none"))

    want = {n: _rounded(v, tensors[-1][n].dtype) for n, v in _weighted(tensors, weights).items()}
    _assert_bits(_safetensors(tmp_path / "out"), want)
    assert [(i.layout, i.step, i.weight) for i in result.inputs] == [
        ("native", 10, 0.2),
        ("dcp", 20, 0.3),
        ("native", 30, 0.5),
    ]
    assert (result.method, result.tensors, result.mapping) == ("weighted", len(want), "none")


@pytest.mark.usefixtures("blocks")
def test_ema_follows_the_recurrence_over_steps_and_writes_dcp(
    demo_inputs: tuple[list[Path], list[Tensors]], tmp_path: Path
) -> None:
    paths, tensors = demo_inputs
    decay = 0.9
    # Given newest first: the EMA orders its inputs by step.
    result = average([str(p) for p in reversed(paths)], str(tmp_path / "ema"), AverageOptions(ema=decay, to=Target.DCP))

    want = {n: _rounded(v, tensors[-1][n].dtype) for n, v in _ema(tensors, decay).items()}
    _assert_bits(_unprefixed(_dcp_model(tmp_path / "ema")), want)
    assert [i.step for i in result.inputs] == [10, 20, 30]
    assert [i.weight for i in result.inputs] == pytest.approx([0.81, 0.09, 0.1])
    assert result.method == "ema"


# --- HF: Trainer checkpoints and save_pretrained, loaded by from_pretrained ----------------------------------


def test_hf_inputs_average_to_a_folder_transformers_loads(
    trainer_run: WrittenTrainerRun, hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    paths = [hf_model_dirs["sharded"], *trainer_run.checkpoints]
    tensors = [_safetensors(p) for p in paths]
    result = average([str(p) for p in paths], str(tmp_path / "hf"), AverageOptions(dtype="bfloat16"))

    want = {n: _rounded(v, torch.bfloat16) for n, v in _weighted(tensors, [1 / 3] * 3).items()}
    _assert_bits(_safetensors(tmp_path / "hf"), want)
    assert "config.json" in result.copied
    assert result.model is not None and result.model.architecture == "LlamaForCausalLM"
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16
    state = model.state_dict()
    for name, tensor in want.items():
        assert torch.equal(state[name].view(torch.int16), tensor.view(torch.int16)), name


def test_a_checkpoint_averaged_with_itself_comes_back_exactly(hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    single = str(hf_model_dirs["single"])
    average([single] * 3, str(tmp_path / "same"))
    _assert_bits(_safetensors(tmp_path / "same"), _safetensors(hf_model_dirs["single"]))


# --- DeepSpeed: a ZeRO-2 tag's fp32 masters with DeepSpeed's own export, to DCP loaded by dcp.load ----------


def test_zero_tag_and_its_export_average_to_dcp_that_dcp_load_reads(
    deepspeed_runs: dict[int, WrittenDeepSpeed], hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp

    from tests.writers.models import tiny_llama

    run = deepspeed_runs[2]
    initial = hf_model_dirs["single"]  # the suite's tiny Llama before training: the run's first weights
    # The tag's fp32 master weights and DeepSpeed's own zero_to_fp32 export of them, a single weights file.
    tensors = [_safetensors(initial), run.reference_tensors(), run.reference_tensors()]
    weights = (0.5, 0.125, 0.375)
    result = average(
        [str(initial), str(run.reference), str(run.latest)],
        str(tmp_path / "dcp"),
        AverageOptions(weights=weights, to=Target.DCP, config_dir=str(run.config_dir)),
    )
    assert [i.url for i in result.inputs] == [str(initial), str(run.reference), str(run.latest)]
    assert result.inputs[-1].layout == "deepspeed"

    want = {n: _rounded(v, torch.float32) for n, v in _weighted(tensors, weights).items()}
    model = tiny_llama()
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # one process, no process group: as intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    loaded = dict(state["model"])
    _assert_bits({n: loaded[n] for n in want}, want)


@pytest.mark.long
def test_a_dcp_output_loads_into_the_model_on_2_fsdp2_ranks(
    deepspeed_runs: dict[int, WrittenDeepSpeed], hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """What a job resuming from the average does: `dcp.load` of the folder into its sharded model, every key."""
    run = deepspeed_runs[2]
    initial = hf_model_dirs["single"]
    tensors = [_safetensors(initial), run.reference_tensors()]
    weights = (0.25, 0.75)
    average(
        [str(initial), str(run.latest)],
        str(tmp_path / "dcp"),
        AverageOptions(weights=weights, to=Target.DCP, config_dir=str(run.config_dir)),
    )
    want = {n: _rounded(v, torch.float32) for n, v in _weighted(tensors, weights).items()}
    _assert_bits(dcp_load_on_ranks(tmp_path / "dcp", tmp_path / "ranks"), want)


# --- refusals: nothing is written ------------------------------------------------------------------------------


def _refused(run_cli: Cli, dst: Path, *args: Any) -> CliResult:
    result = run_cli("average", *args, "--json")
    assert result.exit_code == 2, result.stderr
    assert not dst.exists()
    assert not any(p.name.startswith(".") for p in dst.parent.iterdir())  # no staging left either
    return result


def test_mismatched_inputs_and_bad_weights_exit_2_writing_nothing(
    run_cli: Cli, demo_dir: Path, hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    native = demo_dir / "native"
    llama = hf_model_dirs["single"]
    dst = tmp_path / "out" / "avg"
    dst.parent.mkdir()

    other_model = json.loads(_refused(run_cli, dst, native / "step-10", llama, dst).stdout)["error"]["message"]
    assert "'embed.weight' is in" in other_model and "the inputs hold different models" in other_model

    # The same model with one tensor of another shape.
    reshaped = tmp_path / "reshaped"
    reshaped.mkdir()
    tensors = load_file(str(native / "step-10" / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name][:1].clone()
    save_file(tensors, str(reshaped / "model.safetensors"))
    shape = _refused(run_cli, dst, native / "step-20", reshaped, dst, "--mapping", "none")
    assert f"{name!r} has shape" in shape.stderr

    assert "sum to 1.1" in _refused(run_cli, dst, native, dst, "--last", "2", "--weights", "0.5,0.6").stderr
    assert "2 weight(s) for 3" in _refused(run_cli, dst, native, dst, "--last", "3", "--weights", "0.5,0.5").stderr
    assert "decay" in _refused(run_cli, dst, native, dst, "--last", "2", "--ema", "1.5").stderr
    assert "step 40" in _refused(run_cli, dst, native, dst, "--steps", "10,40").stderr


def test_no_normalize_takes_weights_as_given(demo_dir: Path, tmp_path: Path) -> None:
    step = demo_dir / "native" / "step-30"
    options = AverageOptions(weights=(1.0, 1.0), normalize=False, mapping="none")
    average([str(step), str(step)], str(tmp_path / "twice"), options)
    tensors = load_file(str(step / "model.safetensors"))
    _assert_bits(_safetensors(tmp_path / "twice"), {n: (2 * t.double()).to(t.dtype) for n, t in tensors.items()})


def test_an_interrupted_average_leaves_nothing(demo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptctl.ops import average as module

    done = []
    real = module._Average.raw  # what the HF writer asks each averaged tensor for

    def interrupted(self: Any) -> Any:
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(self)
        return real(self)

    monkeypatch.setattr(module._Average, "raw", interrupted)
    (tmp_path / "out").mkdir()
    with pytest.raises(KeyboardInterrupt):
        average(
            [str(demo_dir / "native" / "step-10"), str(demo_dir / "native" / "step-20")],
            str(tmp_path / "out" / "a"),
            AverageOptions(mapping="none"),
        )
    assert len(done) == 2
    assert list((tmp_path / "out").iterdir()) == []


# --- the command: a run's last steps, --json ----------------------------------------------------------------


def test_cli_last_k_of_a_run_with_json(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    run = demo_dir / "native"
    result = run_cli("average", run, tmp_path / "avg", "--last", "2", "--mapping", "none", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["schema_version"] == 1
    assert [(i["url"], i["step"], i["weight"]) for i in doc["inputs"]] == [
        (str(run / "step-20"), 20, 0.5),
        (str(run / "step-30"), 30, 0.5),
    ]
    assert (doc["dst"], doc["to"], doc["method"], doc["mapping"]) == (str(tmp_path / "avg"), "hf", "uniform", "none")
    assert doc["tensors"] == len(_safetensors(tmp_path / "avg"))
    assert doc["bytes_written"] == sum(t.nbytes for t in _safetensors(tmp_path / "avg").values())
    assert doc["seconds"] >= 0
    tensors = [load_file(str(run / f"step-{s}" / "model.safetensors")) for s in (20, 30)]
    want = {n: _rounded(v, tensors[-1][n].dtype) for n, v in _weighted(tensors, [0.5, 0.5]).items()}
    _assert_bits(_safetensors(tmp_path / "avg"), want)
    assert run_cli("verify", tmp_path / "avg").exit_code == 0
