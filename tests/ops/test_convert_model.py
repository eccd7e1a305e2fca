"""`convert` outputs proven as models: legacy `pytorch_model.bin` sources, tied embeddings both ways, a config
dtype that says what the files hold, and the check against the architecture config.json names."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptctl.errors import CkptctlError, ModelMismatch
from ckptctl.layouts import get_layout, open_checkpoint
from ckptctl.ops.convert import ConvertOptions, Target, convert
from ckptctl.ops.convert.model_check import compare_logits
from ckptctl.ops.convert.plan import plan_tensors
from ckptctl.ops.verification import verify_checkpoint
from tests.conftest import CliResult, tiny_llama
from tests.writers.hf_legacy_writer import WrittenLegacy

Cli = Callable[..., CliResult]


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def _assert_equal_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def _load_pretrained(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info.get("mismatched_keys"), info
    return model


# --- legacy pytorch_model.bin -> safetensors -----------------------------------------------------------


@pytest.mark.parametrize("variant", ["single", "sharded"])
def test_legacy_bin_folders_convert_bit_exactly(
    run_cli: Cli, legacy_models: WrittenLegacy, tmp_path: Path, variant: str
) -> None:
    folder = getattr(legacy_models, variant)
    reference = legacy_models.reference(folder)
    dst = tmp_path / "hf"
    result = convert(str(folder), str(dst), ConvertOptions(max_shard_size=40_000))
    assert result.layout == "hf" and result.streamed == result.tensors  # byte copies out of the zips
    # transformers' own safetensors save leaves the tied lm_head.weight out (the sharded model ties it)
    want = {k: v for k, v in reference.items() if not (variant == "sharded" and k == "lm_head.weight")}
    _assert_equal_tensors(_hf_tensors(dst), want)
    assert result.model is not None and result.model.architecture == "LlamaForCausalLM"
    model = _load_pretrained(dst)
    _assert_equal_tensors({k: v.detach() for k, v in model.state_dict().items()}, reference)
    assert verify_checkpoint(str(dst)).ok

    diffed = run_cli("diff", folder, dst, "--json")
    assert diffed.exit_code == 0 and diffed.json["equal"], diffed.stdout


def test_a_lone_bin_file_converts(legacy_models: WrittenLegacy, tmp_path: Path) -> None:
    lone = legacy_models.single / "pytorch_model.bin"
    result = convert(str(lone), str(tmp_path / "hf"))
    assert result.layout == "torch" and "config.json" in result.copied  # found beside the file
    _assert_equal_tensors(_hf_tensors(tmp_path / "hf"), legacy_models.reference(legacy_models.single))
    assert result.model is not None and result.model.tied == ()


# --- tied embeddings: HF -> DCP -> HF --------------------------------------------------------------------


def test_tied_llama_to_dcp_loads_with_dcp_load_and_comes_back_bit_identical(
    legacy_models: WrittenLegacy, tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp

    source = legacy_models.tied
    original = _hf_tensors(source)
    assert "lm_head.weight" not in original  # transformers 5 leaves the tied copy out
    dcp_dir = tmp_path / "dcp"
    result = convert(str(source), str(dcp_dir), ConvertOptions(to=Target.DCP))
    assert result.model is not None and result.model.tied == ("lm_head.weight",)
    assert result.tensors == len(original) + 1

    # the README's way back into training: a model of the config, its state dict filled by dcp.load
    model = tiny_llama(tie_word_embeddings=True)
    for parameter in model.parameters():
        torch.nn.init.zeros_(parameter)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(dcp_dir))
    model.load_state_dict(state["model"])
    reference = legacy_models.reference(source)
    _assert_equal_tensors({k: v.detach() for k, v in model.state_dict().items()}, reference)
    assert model.lm_head.weight is model.model.embed_tokens.weight

    back = tmp_path / "hf-again"
    again = convert(str(dcp_dir), str(back), ConvertOptions(check_logits=True))
    assert again.model is not None and again.model.tied == ("lm_head.weight",)
    assert again.model.logits_max_abs_diff == 0.0
    assert sorted(p.name for p in back.glob("*.safetensors")) == ["model.safetensors"]
    _assert_equal_tensors(_hf_tensors(back), original)
    assert (back / "config.json").read_bytes() == (source / "config.json").read_bytes()
    _load_pretrained(back)


def test_a_tied_copy_that_differs_is_refused(hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """An untied model's DCP export under a config that ties its embeddings: transformers would load one
    tensor for two different ones."""
    dcp_dir = tmp_path / "dcp"
    convert(str(hf_model_dirs["single"]), str(dcp_dir), ConvertOptions(to=Target.DCP))
    tied_config = tmp_path / "tied-config"
    tied_config.mkdir()
    config = json.loads((hf_model_dirs["single"] / "config.json").read_text())
    (tied_config / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ModelMismatch, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        convert(str(dcp_dir), str(tmp_path / "hf"), ConvertOptions(config_dir=str(tied_config)))
    assert not (tmp_path / "hf").exists()


# --- config.json's dtype -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama saved in bf16 by transformers: its config.json says `"dtype": "bfloat16"`."""
    folder = tmp_path_factory.mktemp("bf16-export")
    tiny_llama().to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("dtype", "key", "want"),
    [(None, "dtype", "float32"), (None, "torch_dtype", "float32"), ("bfloat16", "dtype", "bfloat16")],
)
def test_the_config_dtype_says_what_the_files_hold(
    legacy_models: WrittenLegacy, bf16_export: Path, tmp_path: Path, dtype: str | None, key: str, want: str
) -> None:
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    config = json.loads((bf16_export / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    if key == "torch_dtype":  # as transformers 4 wrote it
        config["torch_dtype"] = config.pop("dtype")
    (config_dir / "config.json").write_text(json.dumps(config))
    dst = tmp_path / "hf"
    convert(str(legacy_models.single), str(dst), ConvertOptions(config_dir=str(config_dir), dtype=dtype))
    written = json.loads((dst / "config.json").read_text())
    assert written[key] == want and ({"dtype", "torch_dtype"} - {key}).isdisjoint(written)
    assert {t.dtype for t in _hf_tensors(dst).values()} == {getattr(torch, want)}
    assert next(_load_pretrained(dst).parameters()).dtype == getattr(torch, want)


# --- the check against the architecture ----------------------------------------------------------------


def _altered_copy(folder: Path, dst: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of an HF folder whose model.safetensors was rewritten after `change` (hand-made damage)."""
    shutil.copytree(folder, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.pop("model.layers.1.mlp.down_proj.weight"), "missing: model.layers.1.mlp.down_proj.weight"),
        (
            lambda t: t.update({"model.norm.weight": torch.ones(8)}),
            r"wrong shape: model.norm.weight is \[8\] where the model's is \[32\]",
        ),
        (lambda t: t.update({"model.layers.0.mlp.bias": torch.ones(3)}), "left over: model.layers.0.mlp.bias"),
    ],
    ids=["dropped", "reshaped", "left-over"],
)
@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_a_model_that_is_not_its_architecture_fails_and_writes_nothing(
    run_cli: Cli, hf_model_dirs: dict[str, Path], tmp_path: Path, change: Callable[..., Any], message: str, to: str
) -> None:
    source = _altered_copy(hf_model_dirs["single"], tmp_path / "src", change)
    dst = tmp_path / "out"
    result = run_cli("convert", source, dst, "--to", to, "--json")
    assert result.exit_code == 1, result.stderr
    error = result.json["error"]
    assert (error["type"], error["exit_code"]) == ("ModelMismatch", 1)
    assert "LlamaForCausalLM" in error["message"] and re.search(message, error["message"]), error
    assert "--no-check-model" in error["hint"]
    assert not dst.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]

    forced = run_cli("convert", source, dst, "--to", to, "--no-check-model")
    assert forced.exit_code == 0, forced.stderr


def test_moe_experts_are_checked_one_by_one(tmp_path: Path) -> None:
    """transformers 5 fuses a Mixtral's experts in the model but saves them one per expert: the check holds
    the output against what `save_pretrained` writes, so a dropped expert is named."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    MixtralForCausalLM(config).save_pretrained(tmp_path / "moe")
    expert = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    assert expert in _hf_tensors(tmp_path / "moe")
    result = convert(str(tmp_path / "moe"), str(tmp_path / "hf"), ConvertOptions(check_logits=True))
    assert result.model is not None and result.model.architecture == "MixtralForCausalLM"
    assert result.model.logits_max_abs_diff == 0.0

    broken = _altered_copy(tmp_path / "moe", tmp_path / "moe-broken", lambda t: t.pop(expert))
    with pytest.raises(ModelMismatch, match=f"missing: {expert}"):
        convert(str(broken), str(tmp_path / "hf-broken"))


def test_logits_that_differ_from_the_source_are_caught(hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """`compare_logits` on an output whose bytes no longer compute what the source's do (same names and
    shapes: only running the model shows it)."""
    dst = tmp_path / "hf"
    convert(str(hf_model_dirs["single"]), str(dst))
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] *= 3
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    source = open_checkpoint(str(hf_model_dirs["single"]))
    plan, _ = plan_tensors(source, get_layout("hf"), ConvertOptions(), [])
    config = json.loads((dst / "config.json").read_text())
    with pytest.raises(ModelMismatch, match="logits differ from the source's"):
        compare_logits(source, plan, str(dst), config)


def test_configs_without_an_architecture_are_not_checked(hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A config that names no class (written by hand, or by a trainer's own code) gives nothing to build."""
    source = tmp_path / "src"
    shutil.copytree(hf_model_dirs["single"], source)
    config = json.loads((source / "config.json").read_text())
    del config["architectures"]
    (source / "config.json").write_text(json.dumps(config))
    result = convert(str(source), str(tmp_path / "hf"))
    assert result.model is None
    assert any("names no architecture" in note for note in result.warnings)
    with pytest.raises(CkptctlError, match=r"cannot compare logits: config\.json names no architecture"):
        convert(str(source), str(tmp_path / "hf2"), ConvertOptions(check_logits=True))
    with pytest.raises(CkptctlError, match="--to hf"):
        convert(str(source), str(tmp_path / "dcp"), ConvertOptions(to=Target.DCP, check_logits=True))


def test_without_transformers_the_check_is_skipped_with_a_note(
    hf_model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("ckptctl.families.hf_model_class.has_transformers_5", lambda: False)
    result = convert(str(hf_model_dirs["single"]), str(tmp_path / "hf"))
    assert result.model is None
    assert any("transformers 5 or later is not importable" in note for note in result.warnings), result.warnings


def test_a_config_asking_for_a_million_layers_is_refused_before_building(
    hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    config = json.loads((hf_model_dirs["single"] / "config.json").read_text())
    (config_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000}))
    with pytest.raises(ModelMismatch, match="num_hidden_layers=1000000"):
        convert(str(hf_model_dirs["single"]), str(tmp_path / "hf"), ConvertOptions(config_dir=str(config_dir)))
