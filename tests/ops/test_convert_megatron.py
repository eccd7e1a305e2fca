"""`convert --to hf` (and `diff`) of Megatron dist-ckpt GPT models, proven by a round trip through megatron-core.

`tests/writers/megatron_writer.py` loads a transformers `LlamaForCausalLM`'s weights into megatron-core's
`GPTModel` (tensor parallelism 2; its logits are checked against the transformers model's) and saves it with
`dist_checkpointing.save`. Converted back, every tensor must equal the one transformers saved, bit for bit,
and the folder must load with `from_pretrained` with no missing or unexpected keys: the fused QKV split per
query group, the SwiGLU `linear_fc1` split into gate and up, the norms, embeddings and output layer named as
transformers names them, the tensor-parallel parts merged. Before the megatron layout, `convert` refused
these folders (their `.metadata` was called a forgery). `--mapping none` is proven against megatron-core's own
load of the same folders: the model's `state_dict()` names, one tensor per layer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tests.conftest import CliResult
from tests.writers.megatron_writer import WrittenMegatron

Cli = Callable[..., CliResult]


def _convert(run_cli: Cli, *args: str | Path) -> Any:
    result = run_cli("convert", *args, "--to", "hf", "--json")
    assert result.exit_code == 0, result.stderr
    return result.json


def _assert_round_trip(out: Path, source: Path) -> None:
    """Every tensor transformers saved comes back bit for bit, and the folder loads with no missing or
    unexpected keys into a model that computes the source's logits exactly."""
    from transformers import LlamaForCausalLM

    got, want = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    assert sorted(got) == sorted(want)
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert not different, different
    model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    reference = LlamaForCausalLM.from_pretrained(source)
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens).logits)


def test_a_tensor_parallel_llama_round_trips_bit_exactly(
    megatron_runs: WrittenMegatron, run_cli: Cli, tmp_path: Path
) -> None:
    out = tmp_path / "hf"
    doc = _convert(run_cli, megatron_runs.iteration(1), out)
    assert (doc["layout"], doc["tensors"]) == ("megatron", 21)
    assert doc["copied"] == ["config.json"]
    assert any("common.pt (LlamaForCausalLM)" in w for w in doc["warnings"])
    _assert_round_trip(out, megatron_runs.source)
    config = json.loads((out / "config.json").read_text())
    source = json.loads((megatron_runs.source / "config.json").read_text())
    keys = ("num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "tie_word_embeddings", "vocab_size")
    assert {k: config[k] for k in keys} == {k: source[k] for k in keys}


def test_a_save_folder_converts_what_its_tracker_names(
    megatron_runs: WrittenMegatron, run_cli: Cli, tmp_path: Path
) -> None:
    doc = _convert(run_cli, megatron_runs.save, tmp_path / "hf")
    assert doc["checkpoint"] == str(megatron_runs.iteration(2))
    assert sorted(load_file(tmp_path / "hf" / "model.safetensors")) == sorted(
        load_file(megatron_runs.source / "model.safetensors")
    )


def test_tied_embeddings_without_arguments_take_the_shape_from_config(
    megatron_runs: WrittenMegatron, run_cli: Cli, tmp_path: Path
) -> None:
    """megatron-core alone records no arguments: the split needs the model's config, and says so."""
    refused = run_cli("convert", megatron_runs.tied, tmp_path / "refused", "--to", "hf")
    assert refused.exit_code == 2
    assert "--config" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "hf"
    doc = _convert(run_cli, megatron_runs.tied, out, "--config", megatron_runs.tied_source)
    assert doc["tensors"] == 20  # no lm_head: transformers ties it to the embeddings
    _assert_round_trip(out, megatron_runs.tied_source)


def test_a_config_of_another_model_is_refused(megatron_runs: WrittenMegatron, run_cli: Cli, tmp_path: Path) -> None:
    refused = run_cli(
        "convert", megatron_runs.iteration(1), tmp_path / "hf", "--to", "hf", "--config", megatron_runs.tied_source
    )
    assert refused.exit_code == 2
    assert "is not the one common.pt describes" in refused.stderr


def test_diff_compares_megatron_with_transformers_under_transformers_names(
    megatron_runs: WrittenMegatron, run_cli: Cli
) -> None:
    same = run_cli("diff", "--json", megatron_runs.iteration(1), megatron_runs.source)
    assert same.exit_code == 0, same.stdout
    doc = same.json
    assert (doc["equal"], doc["compared"], doc["only_in_a"], doc["only_in_b"]) == (True, 21, [], [])
    trained = run_cli("diff", "--json", megatron_runs.iteration(2), megatron_runs.source)
    assert trained.exit_code == 1
    changed = {c["name"]: c["kind"] for c in trained.json["changed"]}
    assert changed["model.layers.0.self_attn.k_proj.weight"] == "values"
    assert trained.json["only_in_a"] == [] and trained.json["only_in_b"] == []


def test_a_cast_follows_into_the_made_config(megatron_runs: WrittenMegatron, run_cli: Cli, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    _convert(run_cli, megatron_runs.iteration(1), out, "--dtype", "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    want = load_file(megatron_runs.source / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)


def test_mapping_none_writes_what_megatron_cores_own_load_gives_the_model(
    megatron_runs: WrittenMegatron, run_cli: Cli, tmp_path: Path
) -> None:
    """`--mapping none` writes the model's own names and shapes: what megatron-core's `dist_checkpointing.load`
    hands to a fresh `GPTModel` (`tests.writers.megatron_load_proof`, resharding TP 2 to 1), one tensor per layer
    (cut out of the stacked tensors as byte ranges), its local spec's norms under their module names. The tied
    save records no arguments: its names are the Transformer Engine spec's, and the renames the note gives make
    them the local model's. `diff` matches a checkpoint with each export under the export's names."""
    from ckptctl.frameworks.megatron.names import LOCAL_SPEC_KEYS
    from tests.writers.megatron_load_proof import SPEC_KEYS, megatron_loaded

    trained = _convert(run_cli, megatron_runs.iteration(1), tmp_path / "trained", "--mapping", "none")
    assert (trained["tensors"], trained["streamed_tensors"]) == (15, 13)  # linear_proj's TP columns: 32 floats
    tied = _convert(run_cli, megatron_runs.tied, tmp_path / "tied", "--mapping", "none")
    note = next(w for w in tied["warnings"] if "records no Megatron-LM arguments" in w)
    renames = [arg for part in note.split("--rename ")[1:] for arg in ("--rename", part.split("'")[1])]
    assert len(renames) == 4
    _convert(run_cli, megatron_runs.tied, tmp_path / "tied-local", "--mapping", "none", *renames)

    want_trained, want_tied = (
        load_file(f)
        for f in megatron_loaded([(megatron_runs.iteration(1), False), (megatron_runs.tied, True)], tmp_path / "load")
    )
    for out, want in ((tmp_path / "trained", want_trained), (tmp_path / "tied-local", want_tied)):
        got = load_file(out / "model.safetensors")
        assert sorted(got) == sorted(want)
        assert [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])] == []
    assert "decoder.layers.1.input_layernorm.weight" in want_trained
    assert json.loads((tmp_path / "load" / SPEC_KEYS).read_text()) == {"dense": LOCAL_SPEC_KEYS, "mla": {}}
    te_names = sorted(load_file(tmp_path / "tied" / "model.safetensors"))
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in te_names
    assert len(te_names) == len(want_tied)

    for export, count in ((tmp_path / "trained", 15), (megatron_runs.source, 21)):
        same = run_cli("diff", "--json", megatron_runs.iteration(1), export)
        assert (same.exit_code, same.json["equal"], same.json["compared"]) == (0, True, count), same.stdout
    steps = run_cli("diff", "--json", megatron_runs.iteration(1), megatron_runs.iteration(2))
    assert steps.exit_code == 1 and steps.json["compared"] == 15
    assert "decoder.layers.0.mlp.linear_fc1.weight" in {c["name"] for c in steps.json["changed"]}
