"""torchtitan's `step-N` folders, written by torchtitan 0.3.0's own CheckpointManager (`torchtitan_run`).

What a torchtitan user relies on: the steps are listed as torchtitan's, the resume plan gives torchtitan's
own setting and skips the model-only last save that torchtitan's default load would wrongly take, and
`convert --to hf` writes a model transformers loads whose tensors are those of torchtitan's own conversion
(`Llama3StateDictAdapter.to_hf`: transformers names, q/k rows reordered for its RoPE) and whose logits are
those of torchtitan's model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CliResult
from tests.writers.torchtitan_writer import TOKENS, WrittenTorchtitan

Cli = Callable[..., CliResult]


def test_list_names_every_step_as_torchtitans(run_cli: Cli, torchtitan_run: WrittenTorchtitan) -> None:
    result = run_cli("list", torchtitan_run.folder, "--json")
    assert result.exit_code == 0, result.stderr
    assert [(c["step"], c["layout"], c["state"]) for c in result.json["checkpoints"]] == [
        (1, "torchtitan", "complete"),
        (2, "torchtitan", "complete"),
        (3, "torchtitan", "complete"),
    ]


def test_inspect_shows_the_trainer_state_and_counters(run_cli: Cli, torchtitan_run: WrittenTorchtitan) -> None:
    result = run_cli("inspect", torchtitan_run.step(2), "--json")
    assert result.exit_code == 0, result.stderr
    data = result.json
    assert data["layout"] == "torchtitan"
    assert {"model", "optimizer", "scheduler", "dataloader", "trainer_state"} <= set(data["components"])
    assert data["metadata"]["progress"] == {"step": 2, "ntokens_seen": 18}
    assert data["metadata"]["model_only"] is False


def test_resume_plan_skips_the_model_only_last_save_and_names_the_step(
    run_cli: Cli, torchtitan_run: WrittenTorchtitan
) -> None:
    result = run_cli("resume-plan", torchtitan_run.folder, "--json")
    assert result.exit_code == 0, result.stderr
    plan = result.json
    assert plan["checkpoint"]["step"] == 2
    assert [(s["step"], "model weights only" in s["reason"]) for s in plan["skipped"]] == [(3, True)]
    assert plan["resume_hint"] == (
        f"--dump_folder {torchtitan_run.dump_folder} --checkpoint.enable --checkpoint.folder checkpoint "
        "--checkpoint.load_step 2"
    )
    assert any("takes step-3" in w for w in plan["warnings"])
    assert plan["continues_from"]["ntokens_seen"] == 18


def test_resume_plan_on_other_data_ranks_leaves_the_loader_state_out(
    run_cli: Cli, torchtitan_run: WrittenTorchtitan
) -> None:
    """torchtitan reshards model and optimizer, but its data loader asserts the saved dp degree."""
    result = run_cli("resume-plan", torchtitan_run.folder, "--world-size", "2", "--json")
    assert result.exit_code == 1
    plan = result.json
    assert plan["world_size"]["saved"] == 1
    assert plan["world_size_ok"] is False
    assert plan["resume_hint"].endswith("--checkpoint.exclude_from_loading dataloader")


def test_convert_equals_torchtitans_own_conversion(
    run_cli: Cli, torchtitan_run: WrittenTorchtitan, tmp_path: Path
) -> None:
    out = tmp_path / "hf"
    result = run_cli(
        "convert", torchtitan_run.step(2), out, "--config", torchtitan_run.assets, "--check-logits", "--json"
    )
    assert result.exit_code == 0, result.stderr
    assert result.json["model_check"]["architecture"] == "LlamaForCausalLM"
    reference = load_file(str(torchtitan_run.reference))
    written = load_file(str(out / "model.safetensors"))
    assert sorted(written) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(written[name], tensor), name

    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(out)
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits[0]
    want = load_file(str(torchtitan_run.reference.with_name("logits.safetensors")))["logits"]
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_mapping_none_keeps_torchtitans_names_and_rows(
    run_cli: Cli, torchtitan_run: WrittenTorchtitan, tmp_path: Path
) -> None:
    out = tmp_path / "native"
    result = run_cli("convert", torchtitan_run.step(2), out, "--mapping", "none", "--no-check-model")
    assert result.exit_code == 0, result.stderr
    written = load_file(str(out / "model.safetensors"))
    assert "layers.0.attention.qkv_linear.wq.weight" in written and "tok_embeddings.weight" in written
    reference = load_file(str(torchtitan_run.reference))
    # torchtitan's own conversion reorders q rows; kept as stored they differ from it, the rest is equal.
    assert not torch.equal(
        written["layers.0.attention.qkv_linear.wq.weight"], reference["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(written["layers.1.feed_forward.w2.weight"], reference["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "--config"),  # the Llama map needs the head size
        (("--mapping", "gpt2"), "no tensor name map 'gpt2'"),
    ],
)
def test_a_map_that_cannot_be_applied_is_refused(
    run_cli: Cli, torchtitan_run: WrittenTorchtitan, tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    result = run_cli("convert", torchtitan_run.step(2), tmp_path / "out", *args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert not (tmp_path / "out").exists()
