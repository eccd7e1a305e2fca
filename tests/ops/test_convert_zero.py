"""`convert` from DeepSpeed ZeRO to HF, on save folders written by DeepSpeed itself (2 CPU ranks, bf16).

The runs train a tiny Llama with tied embeddings (DeepSpeed records the tie in `shared_params`), one frozen
parameter per stage, and, under ZeRO-1, the model inside an OpenRLHF-style `Actor` wrapper with two
persistent buffers. Each conversion is compared with what DeepSpeed's own `zero_to_fp32`
(`get_fp32_state_dict_from_zero_checkpoint`, run by the writer) returns, and loaded with transformers.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptctl.errors import CkptctlError
from ckptctl.families.zero_tag.master_weights import tag_prefix as _deepspeed_prefix
from ckptctl.families.zero_tag.naming import wrapper_prefix
from ckptctl.ops.convert import ConvertOptions, Target, Weights, convert
from ckptctl.ops.convert.plan import plan_tensors as _plan
from ckptctl.ops.verification import verify_checkpoint
from tests.conftest import CliResult, DeepSpeedWriters
from tests.writers.deepspeed_writer import CONVERTER_FROZEN, WRAPPED_BUFFERS, WRAPPER_PREFIX, WrittenDeepSpeed

Cli = Callable[..., CliResult]
FROZEN = CONVERTER_FROZEN


@pytest.fixture(scope="session")
def zero_runs(deepspeed_writers: DeepSpeedWriters) -> dict[int, WrittenDeepSpeed]:
    """ZeRO 0-3 save folders of the tied tiny Llama (`CONVERTER_RUNS`, written by the suite's DeepSpeed ranks)."""
    return deepspeed_writers.runs["converter"]


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def _assert_equal_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def _load_pretrained(folder: Path) -> tuple[Any, dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    return loaded[0], loaded[1]


def _module_weights(run: WrittenDeepSpeed) -> dict[str, torch.Tensor]:
    """The 16-bit weights DeepSpeed keeps in the rank-0 model states (ZeRO 0-2)."""
    states = torch.load(run.latest / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return dict(states["module"])


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_hf_equals_zero_to_fp32_and_loads_in_transformers(
    zero_runs: dict[int, WrittenDeepSpeed], tmp_path: Path, stage: int
) -> None:
    run = zero_runs[stage]
    dst = tmp_path / "hf"
    # The save folder: the tag `latest` names is converted.
    result = convert(str(run.save_dir), str(dst), ConvertOptions(config_dir=str(run.config_dir), reread=True))
    reference = run.reference_tensors()

    assert (result.layout, result.weights, result.checkpoint) == ("deepspeed", "master", str(run.latest))
    assert result.tensors == len(reference) == 21  # lm_head.weight comes back from shared_params
    assert result.streamed == result.tensors and result.assembled == 0  # flat fp32 ranges: byte copies
    assert result.copied == ("config.json",)
    written = _tensors(dst)
    _assert_equal_tensors(written, reference)
    # fp32 masters, not the bf16 module copies; the frozen parameter as zero_to_fp32 returns it (as stored).
    (frozen,) = FROZEN[stage]
    assert {n for n, t in written.items() if t.dtype != torch.float32} == {frozen}
    assert written[frozen].dtype == torch.bfloat16

    model, info = _load_pretrained(dst)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info.get("mismatched_keys"), info
    assert model.lm_head.weight is model.model.embed_tokens.weight
    state = {k: v.detach() for k, v in model.state_dict().items()}
    _assert_equal_tensors({k: state[k] for k in reference}, {k: v.to(state[k].dtype) for k, v in reference.items()})
    assert verify_checkpoint(str(dst)).ok


def test_zero1_wrapped_model_with_buffers_and_a_frozen_parameter(
    zero_runs: dict[int, WrittenDeepSpeed], tmp_path: Path
) -> None:
    run = zero_runs[1]
    dst = tmp_path / "hf"
    result = convert(str(run.latest), str(dst), ConvertOptions(config_dir=str(run.config_dir)))
    reference = {k.removeprefix(WRAPPER_PREFIX): v for k, v in run.reference_tensors().items()}
    written = _tensors(dst)
    # The Actor's `model.` is gone. zero_to_fp32 drops the frozen parameter (ZeRO-1 records no
    # frozen_param_shapes); the conversion takes it from the module's weights and says so.
    (frozen,) = FROZEN[1]
    assert frozen not in reference
    module = _module_weights(run)
    _assert_equal_tensors(written, {**reference, frozen: module[WRAPPER_PREFIX + frozen]})
    assert any("zero_to_fp32 leaves them out" in w and frozen in w for w in result.warnings)
    # Buffers: floating ones upcast to float32 (stored as bf16), integer ones as they are.
    calibration, bucket_ids = WRAPPED_BUFFERS
    assert module[WRAPPER_PREFIX + calibration].dtype == torch.bfloat16
    assert written[calibration].dtype == torch.float32 and written[bucket_ids].dtype == torch.int64

    _, info = _load_pretrained(dst)
    assert not info["missing_keys"] and set(info["unexpected_keys"]) == set(WRAPPED_BUFFERS)

    kept = tmp_path / "kept"
    convert(str(run.latest), str(kept), ConvertOptions(strip_prefix=""))
    assert "model.model.embed_tokens.weight" in _tensors(kept)


def test_zero0_writes_the_module_weights(zero_runs: dict[int, WrittenDeepSpeed], tmp_path: Path) -> None:
    # Without ZeRO there are no optimizer partitions; DeepSpeed's zero_to_fp32 fails on such a folder
    # (TypeError on the missing param_shapes), the writer's reference is the module's own weights.
    run = zero_runs[0]
    result = convert(str(run.save_dir), str(tmp_path / "hf"), ConvertOptions(config_dir=str(run.config_dir)))
    assert result.weights == "stored" and any("zero_to_fp32 cannot read" in w for w in result.warnings)
    _assert_equal_tensors(_tensors(tmp_path / "hf"), run.reference_tensors())
    _, info = _load_pretrained(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with pytest.raises(CkptctlError, match="no fp32 master weights"):
        convert(str(run.save_dir), str(tmp_path / "master"), ConvertOptions(weights=Weights.MASTER))
    assert not (tmp_path / "master").exists()


def test_dtype_stored_weights_and_dcp(zero_runs: dict[int, WrittenDeepSpeed], tmp_path: Path) -> None:
    run = zero_runs[2]
    reference = run.reference_tensors()

    bf16 = convert(str(run.save_dir), str(tmp_path / "bf16"), ConvertOptions(dtype="bfloat16", max_shard_size=20_000))
    assert bf16.streamed == bf16.tensors  # cast block by block while copying
    assert sum(f.endswith(".safetensors") for f in bf16.files) >= 3
    _assert_equal_tensors(_tensors(tmp_path / "bf16"), {k: v.to(torch.bfloat16) for k, v in reference.items()})

    # --dtype fp32 is what the zero_to_fp32.py script writes (it casts the frozen bf16 weights too).
    convert(str(run.save_dir), str(tmp_path / "fp32"), ConvertOptions(dtype="float32"))
    _assert_equal_tensors(_tensors(tmp_path / "fp32"), {k: v.float() for k, v in reference.items()})

    stored = convert(str(run.save_dir), str(tmp_path / "stored"), ConvertOptions(weights=Weights.STORED))
    module = _module_weights(run)
    got = _tensors(tmp_path / "stored")
    assert stored.weights == "stored" and {t.dtype for t in got.values()} == {torch.bfloat16}
    _assert_equal_tensors(got, {k: module[k] for k in got})

    with pytest.raises(CkptctlError, match="no fp32 master weights"):  # an HF folder has one copy
        convert(str(tmp_path / "stored"), str(tmp_path / "none"), ConvertOptions(weights=Weights.MASTER))

    import torch.distributed.checkpoint as dcp

    zero3 = zero_runs[3]
    convert(str(zero3.save_dir), str(tmp_path / "dcp"), ConvertOptions(to=Target.DCP))
    want = zero3.reference_tensors()
    state = {"model": {k: torch.empty_like(v) for k, v in want.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    _assert_equal_tensors(state["model"], want)


def test_trainer_checkpoint_with_deepspeed_inside(zero_runs: dict[int, WrittenDeepSpeed], tmp_path: Path) -> None:
    """`checkpoint-N` as the Trainer writes it under ZeRO-3: 16-bit weights at the top, the DeepSpeed save
    folder (latest, global_stepN/) beside them; the fp32 masters are converted unless asked otherwise."""
    run = zero_runs[3]
    assert run.config_dir is not None
    ckpt = Path(shutil.copytree(run.save_dir, tmp_path / "out" / "checkpoint-4"))
    shutil.copy(run.config_dir / "config.json", ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4, "epoch": 1.0, "log_history": []}))
    reference = run.reference_tensors()
    top = {k: v.to(torch.bfloat16) for k, v in reference.items() if k != "lm_head.weight"}
    save_file(top, str(ckpt / "model.safetensors"), metadata={"format": "pt"})

    result = convert(str(ckpt), str(tmp_path / "hf"))
    assert (result.layout, result.weights) == ("hf_trainer", "master") and "config.json" in result.copied
    _assert_equal_tensors(_tensors(tmp_path / "hf"), reference)
    stored = convert(str(ckpt), str(tmp_path / "stored"), ConvertOptions(weights=Weights.STORED))
    assert stored.weights == "stored"
    _assert_equal_tensors(_tensors(tmp_path / "stored"), top)


def test_cli_convert_a_save_folder(zero_runs: dict[int, WrittenDeepSpeed], tmp_path: Path, run_cli: Cli) -> None:
    run = zero_runs[3]
    dst = tmp_path / "hf"
    result = run_cli("convert", run.save_dir, dst, "--config", run.config_dir, "--dtype", "bf16", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert {"schema_version", "src", "dst", "to", "tensors", "bytes", "files"} <= set(doc)
    assert (doc["schema_version"], doc["src"], doc["dst"], doc["to"]) == (1, str(run.save_dir), str(dst), "hf")
    assert (doc["checkpoint"], doc["layout"], doc["weights"], doc["dtype"]) == (
        str(run.latest),
        "deepspeed",
        "master",
        "bfloat16",
    )
    assert doc["tensors"] == 21 and doc["bytes"] == sum(t.numel() * 2 for t in run.reference_tensors().values())
    assert {"model.safetensors", "config.json"} <= set(doc["files"])

    damaged = Path(shutil.copytree(run.save_dir, tmp_path / "damaged"))
    next(damaged.glob("global_step4/*rank_1*optim_states.pt")).unlink()
    failed = run_cli("convert", damaged, tmp_path / "never", "--json")
    assert failed.exit_code == 2 and "fails structural verification" in failed.stderr
    assert "Traceback" not in failed.stderr and not (tmp_path / "never").exists()


def test_layouts_built_on_the_deepspeed_one_are_recognised(zero_runs: dict[int, WrittenDeepSpeed]) -> None:
    """An RL framework's layout that indexes a tag with `families.zero_tag` (its own name, its own metadata)
    gets the fp32 masters too: the model's chunks lie in DeepSpeed rank files."""
    from ckptctl.frameworks.deepspeed.layout import DeepSpeedLayout

    class SomeRlLayout(DeepSpeedLayout):
        name = "some_rl_framework"

    opened = DeepSpeedLayout().open(str(zero_runs[2].latest))
    other = replace(opened, ref=replace(opened.ref, layout="some_rl_framework"), metadata={"format": "rl"})
    assert _deepspeed_prefix(other) == ""
    notes: list[str] = []
    plan, weights = _plan(other, SomeRlLayout(), ConvertOptions(), notes)
    assert weights is Weights.MASTER and {p.entry.dtype for p in plan} == {"float32", "bfloat16"}
    assert sorted(p.name for p in plan) == sorted(zero_runs[2].reference_tensors())


@pytest.mark.parametrize(
    ("names", "prefix"),
    [
        (["model.embed_tokens.weight", "lm_head.weight"], ""),
        (["module.model.embed_tokens.weight", "module.lm_head.weight"], "module."),
        (["_orig_mod.module.layers.0.w", "_orig_mod.module.norm.w"], "_orig_mod.module."),
        (["model.model.embed_tokens.weight", "model.lm_head.weight"], "model."),
        (["module.model.model.layers.0.w", "module.model.model.norm.w"], "module.model."),
        (["model.layers.0.w", "model.norm.w"], ""),  # a base model: `model.` is its own
        (["model.model.layers.0.w", "model.model.norm.w"], "model."),  # a tied Actor without lm_head
        ([], ""),
    ],
)
def test_wrapper_prefix(names: list[str], prefix: str) -> None:
    assert wrapper_prefix(names) == prefix


def test_a_bf16_export_config_over_the_fp32_masters(zero_runs: dict[int, WrittenDeepSpeed], tmp_path: Path) -> None:
    """`--config` from a bf16 export (with `architectures`, so the model check runs on a ZeRO output): the
    output's config says float32, what the masters are, so transformers loads them as they are; the tied
    `lm_head.weight` is left out, as transformers' own save does."""
    from tests.conftest import tiny_llama

    run = zero_runs[2]
    export = tmp_path / "bf16-export"
    tiny_llama(tie_word_embeddings=True).to(torch.bfloat16).save_pretrained(export)
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    dst = tmp_path / "hf"
    result = convert(str(run.save_dir), str(dst), ConvertOptions(config_dir=str(export)))
    assert result.model is not None and (result.model.architecture, result.model.tied) == (
        "LlamaForCausalLM",
        ("lm_head.weight",),
    )
    assert json.loads((dst / "config.json").read_text())["dtype"] == "float32"
    reference = run.reference_tensors()
    _assert_equal_tensors(_tensors(dst), {k: v for k, v in reference.items() if k != "lm_head.weight"})
    model, info = _load_pretrained(dst)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight
