"""`convert --lora adapter|merge` on a PEFT-wrapped model saved whole (the `peft_adapters` writer's `wrapped/step-3`:
torch DCP `dcp.save` of `get_peft_model(...).state_dict()`, rsLoRA r=8 alpha=16 on q_proj/v_proj, lm_head a module
to save): the adapter alone as a PEFT adapter folder that `PeftModel.from_pretrained` loads back into exactly the
saved model, and the scaling given on the command line when the run kept no adapter_config.json.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tests.conftest import CliResult, copy_tree
from tests.writers.peft_writer import VARIANTS, WrittenPeft

Cli = Callable[..., CliResult]

_IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 127, 2]])


def _saved_state(wrapped: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The PEFT model's state dict as the run saved it (DCP), read back by torch itself."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {name: torch.empty_like(tensor) for name, tensor in like.items()}}
    dcp.load(state, checkpoint_id=str(wrapped), no_dist=True)
    return state["model"]


def _peft_model(base: Path, adapter: Path) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()


def _merged_logits(base: Path, merged: dict[str, torch.Tensor]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base).eval()
    model.load_state_dict(merged)
    with torch.no_grad():
        logits: torch.Tensor = model(_IDS).logits
    return logits


def _assert_loads_as_saved(peft_adapters: WrittenPeft, out: Path) -> None:
    """PEFT loads the adapter folder onto the base into exactly the model the run saved, with its logits."""
    from peft import get_peft_model_state_dict

    model = _peft_model(peft_adapters.base, out)
    loaded = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    saved = _saved_state(peft_adapters.wrapped, loaded)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    # the file holds the names PEFT's own save_pretrained gives those tensors
    assert sorted(load_file(str(out / "adapter_model.safetensors"))) == sorted(get_peft_model_state_dict(model))
    with torch.no_grad():
        logits = model(_IDS).logits
    want = _merged_logits(peft_adapters.base, WrittenPeft.merged(peft_adapters.wrapped))
    assert torch.allclose(logits, want, rtol=0, atol=1e-5)  # merged vs unmerged: float32 sums in another order


def test_lora_adapter_writes_a_peft_adapter_folder(run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path) -> None:
    out = tmp_path / "adapter"
    result = run_cli("convert", peft_adapters.wrapped, out, "--lora", "adapter", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert doc["layout"] == "dcp" and doc["model_check"] is None
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(doc["files"])
    assert "config.json" not in doc["files"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["use_rslora"] is True and config["lora_alpha"] == VARIANTS["rslora"]["lora_alpha"]
    _assert_loads_as_saved(peft_adapters, out)
    inspected = run_cli("inspect", out, "--json")
    assert inspected.exit_code == 0 and inspected.json["layout"] == "peft"
    assert inspected.json["metadata"]["ranks"] == [VARIANTS["rslora"]["r"]]
    assert run_cli("verify", out).exit_code == 0


def test_the_scaling_given_on_the_command_line(run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path) -> None:
    """A run that kept no adapter_config.json: --lora-alpha (with --lora-rslora) gives what it lacks, for the merge
    (bit-exact against merge_and_unload) and for an adapter folder (its adapter_config.json made from them)."""
    run = copy_tree(peft_adapters.wrapped.parent, tmp_path / "run")
    (run / "adapter_config.json").unlink()
    refused = run_cli("convert", run / "step-3", tmp_path / "refused")
    assert refused.exit_code == 2 and "--lora-alpha" in refused.stderr
    assert not (tmp_path / "refused").exists()
    alpha = str(VARIANTS["rslora"]["lora_alpha"])
    merged = run_cli("convert", run / "step-3", tmp_path / "merged", "--lora-alpha", alpha, "--lora-rslora", "--json")
    assert merged.exit_code == 0, merged.stderr
    assert merged.json["model_check"]["architecture"] == "LlamaForCausalLM"
    got, want = load_file(str(tmp_path / "merged" / "model.safetensors")), WrittenPeft.merged(peft_adapters.wrapped)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    out = tmp_path / "adapter"
    args = ("--lora", "adapter", "--lora-alpha", alpha, "--lora-r", str(VARIANTS["rslora"]["r"]), "--lora-rslora")
    made = run_cli("convert", run / "step-3", out, *args)
    assert made.exit_code == 0, made.stderr
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["lm_head"] and len(config["target_modules"]) == 4
    _assert_loads_as_saved(peft_adapters, out)
    wrong_rank = run_cli("convert", run / "step-3", tmp_path / "wrong", "--lora-alpha", alpha, "--lora-r", "4")
    assert wrong_rank.exit_code == 2 and "rank 8" in wrong_rank.stderr


def test_lora_adapter_on_a_model_without_adapters_is_refused(
    run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path
) -> None:
    result = run_cli("convert", peft_adapters.base, tmp_path / "out", "--lora", "adapter")
    assert result.exit_code == 2 and "without adapters" in result.stderr
    lone = run_cli("convert", peft_adapters.wrapped, tmp_path / "out", "--lora-r", "8")
    assert lone.exit_code == 2 and "--lora-alpha" in lone.stderr
    unused = run_cli("convert", peft_adapters.base, tmp_path / "out", "--lora-alpha", "16")
    assert unused.exit_code == 2 and "carries none" in unused.stderr
    adapter = run_cli("convert", peft_adapters.adapters["rslora"], tmp_path / "out", "--lora", "adapter")
    assert adapter.exit_code == 2 and "holds an adapter already" in adapter.stderr
    assert not (tmp_path / "out").exists()


def test_inspect_names_the_adapted_modules(run_cli: Cli, peft_adapters: WrittenPeft) -> None:
    result = run_cli("inspect", peft_adapters.wrapped, "--json")
    assert result.json["wrapped_model"]["targets"] == ["q_proj", "v_proj"]


def test_a_scaling_given_where_it_would_not_be_used_is_refused(
    run_cli: Cli, peft_adapters: WrittenPeft, tmp_path: Path
) -> None:
    """--lora-alpha that nothing would take (an adapter folder merges with its own adapter_config.json; --lora keep
    merges nothing), or one that is not a number (nan merged every adapted weight into NaN, exit 0), is refused
    rather than ignored."""
    cases = {
        "adapter folder": (peft_adapters.adapters["rslora"], "--lora-alpha", "16"),
        "keep": (peft_adapters.wrapped, "--lora", "keep", "--lora-alpha", "16"),
        "nan": (peft_adapters.wrapped, "--lora-alpha", "nan"),
    }
    for case, (src, *args) in cases.items():
        result = run_cli("convert", src, tmp_path / "out", *args)
        assert result.exit_code == 2 and "--lora-alpha" in result.stderr, (case, result.stderr)
    assert not (tmp_path / "out").exists()


def test_gpt2_conv1d_layers_merge_transposed_and_only_with_the_runs_adapter_config(
    run_cli: Cli, tmp_path: Path
) -> None:
    """GPT-2's Conv1D layers store W as (in, out), and PEFT merges their LoRA transposed (fan_in_fan_out). For the
    square c_proj the shapes fit either way: without the run's adapter_config.json (which records it) convert
    refuses rather than write wrong weights; with it, the merge equals PEFT's merge_and_unload()."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=16, vocab_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's note that it sets fan_in_fan_out for Conv1D
        model = get_peft_model(GPT2LMHeadModel(config), LoraConfig(r=4, lora_alpha=8, target_modules=["c_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: a trained adapter's B is not
            torch.nn.init.normal_(param)
    src = tmp_path / "wrapped"
    src.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "base_model.model.lm_head.weight"}
    save_file(state, str(src / "model.safetensors"))
    config.save_pretrained(src)

    refused = run_cli("convert", src, tmp_path / "guessed", "--lora-alpha", "8", "--no-check-model")
    assert refused.exit_code == 2 and "Conv1D" in refused.stderr and "fan_in_fan_out" in refused.stderr
    assert not (tmp_path / "guessed").exists()

    model.peft_config["default"].save_pretrained(str(src))  # adapter_config.json beside it, as the run keeps it
    assert json.loads((src / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    merged = run_cli("convert", src, tmp_path / "merged", "--no-check-model")
    assert merged.exit_code == 0, merged.stderr
    want = {k: v for k, v in model.merge_and_unload().state_dict().items() if k != "lm_head.weight"}
    got = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
