"""`convert --merge-adapter`: PEFT adapters (peft 0.21.2's own `save_pretrained`) merged into their base model,
proven against PEFT's own `merge_and_unload()`; and a PEFT-wrapped model saved whole by DCP, merged into its base
weights under the model's own names.

The merges are bit-exact: ckptctl computes `W + scaling·(B @ A)` with the same float32 operations, in the same
order, as PEFT's `Linear.get_delta_weight` / `Embedding.get_delta_weight` and `merge`, so every tensor is
compared with `torch.equal`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptctl.ops.verification import verify_checkpoint
from tests.conftest import CliResult, copy_tree, tiny_llama
from tests.writers.peft_writer import WrittenPeft

Cli = Callable[..., CliResult]


def _output(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def _from_pretrained(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info.get("mismatched_keys"), info
    return model


@pytest.mark.parametrize("variant", ["plain", "rslora", "modules_to_save", "alpha0"])
def test_the_merged_model_is_what_merge_and_unload_gives(
    run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path, variant: str
) -> None:
    adapter = peft_adapters.adapters[variant]
    want = WrittenPeft.merged(adapter)
    out = tmp_path / "merged"
    result = run_cli(
        "convert", adapter, out, "--merge-adapter", peft_adapters.base, "--json", "--max-shard-size", "40KB"
    )
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert doc["layout"] == "peft" and doc["base"] == str(peft_adapters.base)
    assert doc["model_check"]["architecture"] == "LlamaForCausalLM"
    assert "config.json" in doc["copied"]  # the base's
    got = _output(out)
    _assert_equal(got, want)
    base = load_file(str(peft_adapters.base / "model.safetensors"))
    changed = sorted(name for name in base if not torch.equal(base[name], got[name]))
    assert doc["derived_tensors"] >= len(changed) > 0 or variant == "alpha0"
    model = _from_pretrained(out)
    _assert_equal({k: v.detach() for k, v in model.state_dict().items()}, want)
    assert verify_checkpoint(str(out)).ok
    if variant == "alpha0":
        assert changed == []  # lora_alpha 0: the merged model is the base model
        assert any("lora_alpha is 0" in w for w in doc["warnings"])
    if variant == "modules_to_save":
        assert "lm_head.weight" in changed


def test_the_base_the_adapter_names_is_used_when_none_is_given(
    run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path
) -> None:
    adapter = peft_adapters.adapters["rslora"]
    result = run_cli("convert", adapter, tmp_path / "merged", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["base"] == str(peft_adapters.base)
    assert any("the base model the adapter names" in w for w in result.json["warnings"])
    _assert_equal(_output(tmp_path / "merged"), WrittenPeft.merged(adapter))


def test_an_adapter_without_a_base_is_refused(run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path) -> None:
    adapter = copy_tree(peft_adapters.adapters["rslora"], tmp_path / "adapter")
    config = (adapter / "adapter_config.json").read_text()
    (adapter / "adapter_config.json").write_text(config.replace(str(peft_adapters.base), "meta-llama/Llama-3.1-8B"))
    result = run_cli("convert", adapter, tmp_path / "out")
    assert result.exit_code == 2
    assert "adapter, not a model" in result.stderr and "--merge-adapter BASE" in result.stderr
    assert "meta-llama/Llama-3.1-8B" in result.stderr
    assert not (tmp_path / "out").exists()


def test_the_merge_writes_a_dcp_checkpoint_too(peft_adapters: WrittenPeft, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptctl.ops.convert import ConvertOptions, Target, convert

    adapter = peft_adapters.adapters["plain"]
    want = WrittenPeft.merged(adapter)
    result = convert(
        str(adapter), str(tmp_path / "dcp"), ConvertOptions(to=Target.DCP, merge_adapter=str(peft_adapters.base))
    )
    assert result.derived > 0
    state = {"model": {name: torch.empty_like(tensor) for name, tensor in want.items()}}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    _assert_equal(state["model"], want)


def test_dora_is_refused(run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path) -> None:
    result = run_cli("convert", peft_adapters.adapters["dora"], tmp_path / "out", "--merge-adapter", peft_adapters.base)
    assert result.exit_code == 2
    assert "DoRA" in result.stderr and "merge_and_unload" in result.stderr
    assert not (tmp_path / "out").exists()


def test_another_peft_type_is_refused(run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path) -> None:
    adapter = copy_tree(peft_adapters.adapters["rslora"], tmp_path / "adapter")
    config = adapter / "adapter_config.json"
    config.write_text(config.read_text().replace('"peft_type": "LORA"', '"peft_type": "LOHA"'))
    result = run_cli("convert", adapter, tmp_path / "out", "--merge-adapter", peft_adapters.base)
    assert result.exit_code == 2
    assert "peft_type is LOHA" in result.stderr and "LoRA adapters only" in result.stderr


def test_a_base_the_adapter_does_not_fit_is_refused(run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other-base"
    config = tiny_llama().config.to_dict() | {"num_key_value_heads": 4}  # v_proj is [32, 32], not [16, 32]
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(other)
    result = run_cli("convert", peft_adapters.adapters["rslora"], tmp_path / "out", "--merge-adapter", other)
    assert result.exit_code == 2
    assert "v_proj" in result.stderr and "do not fit" in result.stderr
    assert not (tmp_path / "out").exists()


def test_merge_adapter_on_a_model_is_refused(run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path) -> None:
    result = run_cli("convert", peft_adapters.base, tmp_path / "out", "--merge-adapter", peft_adapters.base)
    assert result.exit_code == 2
    assert "holds a model, not an adapter" in result.stderr


# --- a PEFT-wrapped model saved whole ------------------------------------------------------------------


def test_a_wrapped_model_converts_merged_under_the_models_names(
    run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path
) -> None:
    want = WrittenPeft.merged(peft_adapters.wrapped)
    out = tmp_path / "merged"
    result = run_cli("convert", peft_adapters.wrapped, out, "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert doc["layout"] == "dcp" and doc["derived_tensors"] == 4
    assert doc["model_check"]["architecture"] == "LlamaForCausalLM"
    assert any("adapter_config.json" in w for w in doc["warnings"])
    _assert_equal(_output(out), want)
    model = _from_pretrained(out)
    _assert_equal({k: v.detach() for k, v in model.state_dict().items()}, want)


def test_lora_keep_writes_the_wrapped_tensors_as_stored(
    run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path
) -> None:
    out = tmp_path / "kept"
    result = run_cli("convert", peft_adapters.wrapped, out, "--lora", "keep", "--no-check-model", "--json")
    assert result.exit_code == 0, result.stderr
    names = set(_output(out))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in names
    assert sum(t.numel() for t in _output(out).values()) == peft_adapters.wrapped_parameters
    checked = run_cli("convert", peft_adapters.wrapped, tmp_path / "checked", "--lora", "keep")
    assert checked.exit_code == 1 and "left over" in checked.stderr  # transformers would not load those names


def test_a_wrapped_model_needs_its_lora_alpha(run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path) -> None:
    run = copy_tree(peft_adapters.wrapped.parent, tmp_path / "run")
    settings = tmp_path / "settings" / "adapter_config.json"
    settings.parent.mkdir()
    shutil.move(run / "adapter_config.json", settings)
    refused = run_cli("convert", run / "step-3", tmp_path / "out")
    assert refused.exit_code == 2
    assert "lora_alpha" in refused.stderr and "--adapter-config" in refused.stderr
    assert not (tmp_path / "out").exists()
    given = run_cli("convert", run / "step-3", tmp_path / "out", "--adapter-config", settings)
    assert given.exit_code == 0, given.stderr
    _assert_equal(_output(tmp_path / "out"), WrittenPeft.merged(peft_adapters.wrapped))


def test_verls_lora_train_meta_gives_the_scaling(run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path) -> None:
    """verl keeps `lora_train_meta.json` = {r, lora_alpha, task_type} beside its shards instead of an adapter_config."""
    import json

    run = copy_tree(peft_adapters.wrapped.parent, tmp_path / "run")
    config = json.loads((run / "adapter_config.json").read_text())
    (run / "adapter_config.json").unlink()
    # the writer's wrapped model is rsLoRA, which lora_train_meta.json cannot say: alpha chosen so that
    # alpha/r equals its alpha/sqrt(r)
    alpha = config["lora_alpha"] / config["r"] ** 0.5 * config["r"]
    meta = {"r": config["r"], "lora_alpha": alpha, "task_type": "CAUSAL_LM"}
    (run / "step-3" / "lora_train_meta.json").write_text(json.dumps(meta))
    result = run_cli("convert", run / "step-3", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.stderr
    got, want = _output(tmp_path / "out"), WrittenPeft.merged(peft_adapters.wrapped)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():  # alpha/r and alpha/sqrt(r) round differently: close, not equal
        assert torch.allclose(got[name], tensor, rtol=0, atol=1e-6), name
