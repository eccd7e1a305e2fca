"""`convert --to hf` of critics and reward models: the value head is written with the config of the transformers
class that computes the framework's values (`families.value_head`), checked against the meta-device model,
and the output loaded by transformers' Auto classes computes what the framework's model computes on the same ids.

Sources: AReaL's own critic (`tests.writers.areal_critic_writer`: its Saver export and recover slot), verl's own
critic saves (`tests.writers.verl_critic_writer`: FSDP1; `tests.writers.verl_writer`: FSDP2 on an HSDP mesh),
OpenRLHF's own PPO critic
(`tests.writers.openrlhf_writer`: its ZeRO-2 tag and `save_model` folder), and, for a reward model, OpenRLHF's
critic folder saved as OpenRLHF saves a `RewardModel` (the same module but for its class name, also with the
head under its former name `value_head`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptctl.families.value_head import HeadTask, find_value_head
from tests.conftest import CliResult, copy_tree
from tests.writers.areal_critic_writer import TOKEN_IDS, WrittenArealCritic
from tests.writers.openrlhf_writer import WrittenOpenRlhf
from tests.writers.verl_critic_writer import WrittenVerlCritic
from tests.writers.verl_writer import WrittenVerl

Cli = Callable[..., CliResult]


def _convert(run_cli: Cli, src: Path, dst: Path, *extra: str) -> dict:
    result = run_cli("convert", src, dst, "--to", "hf", "--json", *extra)
    assert result.exit_code == 0, result.stderr
    return result.json


def _token_values(folder: Path) -> torch.Tensor:
    """The per-token values of the converted critic, as `AutoModelForTokenClassification` loads it."""
    from transformers import AutoModelForTokenClassification

    model, info = AutoModelForTokenClassification.from_pretrained(
        str(folder), dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # nothing missing, left over or reshaped: no random head
    assert model.config.num_labels == 1
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor([TOKEN_IDS])).logits


def test_areal_critic_export_and_slot_convert_to_token_classification(
    areal_critic: WrittenArealCritic, tmp_path: Path, run_cli: Cli
) -> None:
    """AReaL saves its critic with the base causal LM's config; the conversion names
    `Qwen3ForTokenClassification` with one label, and computes the critic's own values (its module, on the same
    ids) exactly, from the recover slot and from the Saver's export."""
    theirs = load_file(str(areal_critic.values))["values"]
    slot = _convert(run_cli, areal_critic.slot, tmp_path / "slot")
    assert slot["model_check"]["architecture"] == "Qwen3ForTokenClassification"
    assert any("value head" in w and "Qwen3ForCausalLM" in w for w in slot["warnings"])
    config = json.loads((tmp_path / "slot" / "config.json").read_text())
    assert (config["architectures"], config["id2label"]) == (["Qwen3ForTokenClassification"], {"0": "LABEL_0"})
    assert "token_classification_bias" not in config  # AReaL's head is transformers' own, with its bias
    assert set(load_file(str(tmp_path / "slot" / "model.safetensors"))) >= {"score.weight", "score.bias"}
    assert torch.equal(_token_values(tmp_path / "slot"), theirs)

    export = _convert(run_cli, areal_critic.export, tmp_path / "export")
    assert export["model_check"]["architecture"] == "Qwen3ForTokenClassification"
    # Without the model check too: never a causal LM's config with a random lm_head.
    _convert(run_cli, areal_critic.export, tmp_path / "unchecked", "--no-check-model")
    unchecked = json.loads((tmp_path / "unchecked" / "config.json").read_text())
    assert unchecked["architectures"] == ["Qwen3ForTokenClassification"]
    assert torch.equal(_token_values(tmp_path / "export"), theirs)


def test_verl_critic_converts_to_token_classification(verl_run: WrittenVerl, tmp_path: Path, run_cli: Cli) -> None:
    """verl's critic role (`huggingface/` names Qwen2ForCausalLM) converts with the model check on, to what verl's
    critic loads (`AutoModelForTokenClassification`, one label); its values are those of the critic's weights as
    verl's own merger wrote them, in the same class."""
    from transformers import AutoModelForTokenClassification

    critic = verl_run.step(2) / "critic"
    result = _convert(run_cli, critic, tmp_path / "critic", "--check-logits")
    assert result["model_check"]["architecture"] == "Qwen2ForTokenClassification"
    assert result["model_check"]["logits_max_abs_diff"] == 0.0  # the values of the source tensors, exactly
    config = json.loads((verl_run.merged_critic / "config.json").read_text())
    config["architectures"] = ["Qwen2ForTokenClassification"]  # verl's merger keeps the causal LM's name
    merged = copy_tree(verl_run.merged_critic, tmp_path / "merged")
    (merged / "config.json").write_text(json.dumps(config))
    reference = AutoModelForTokenClassification.from_pretrained(str(merged), dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(input_ids=torch.tensor([TOKEN_IDS])).logits
    # The merger wrote bfloat16: compare with our float32 output rounded the same way.
    ours = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic"), dtype=torch.bfloat16)
    with torch.no_grad():
        got = ours.eval().float()(input_ids=torch.tensor([TOKEN_IDS])).logits
    assert torch.equal(got, want)
    # The merger's own folder (an HF model folder: no framework says what it is) converts alike, its head's bias
    # being transformers' token classification head.
    merged_converted = _convert(run_cli, verl_run.merged_critic, tmp_path / "merged-hf")
    assert merged_converted["model_check"]["architecture"] == "Qwen2ForTokenClassification"


def test_verl_fsdp1_critic_converts_to_what_verl_computes(
    verl_critic: WrittenVerlCritic, tmp_path: Path, run_cli: Cli
) -> None:
    """verl's FSDP1 critic: listed with its role, verified, and converted (the model check on) to
    `Qwen2ForTokenClassification`, whose values on the same ids are those the FSDP1-wrapped critic computed."""
    (row,) = run_cli("list", verl_critic.critic, "--json").json["checkpoints"]
    assert (row["layout"], row["state"], row["roles"]) == ("verl", "complete", ["critic"])
    assert run_cli("verify", verl_critic.critic).exit_code == 0
    result = _convert(run_cli, verl_critic.critic, tmp_path / "hf")
    assert result["model_check"]["architecture"] == "Qwen2ForTokenClassification"
    assert torch.equal(_token_values(tmp_path / "hf"), load_file(str(verl_critic.values))["values"])


def _openrlhf_values(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """OpenRLHF's `CriticModel`/`RewardModel.forward` on ids without padding: its base model (LlamaModel, the
    `model.*` tensors) and the linear value head without bias on the last hidden states (openrlhf/models/
    model.py): a value per token."""
    from transformers import LlamaModel

    tensors = load_file(str(folder / "model.safetensors"))
    head = tensors.get("score.weight", tensors.get("value_head.weight"))
    assert head is not None
    body = LlamaModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = body(ids, position_ids=torch.arange(ids.shape[1])[None]).last_hidden_state
    return (hidden @ head.float().T).squeeze(-1)


def test_openrlhf_critic_tag_and_folder_convert_to_token_classification(
    openrlhf_ppo: WrittenOpenRlhf, tmp_path: Path, run_cli: Cli
) -> None:
    """OpenRLHF's `CriticModel` has a head without bias: the output says `token_classification_bias: false`, so
    transformers builds exactly its tensors; the final folder's values are OpenRLHF's, and the ZeRO-2 tag's
    (its fp32 master weights, config from `{output_dir}_critic`) pass the model check."""
    ids = torch.tensor([TOKEN_IDS])
    folder = _convert(run_cli, openrlhf_ppo.critic_output_dir, tmp_path / "final")
    assert folder["model_check"]["architecture"] == "LlamaForTokenClassification"
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["token_classification_bias"] is False and config["architectures"] == ["LlamaForTokenClassification"]
    torch.testing.assert_close(
        _token_values(tmp_path / "final")[..., 0], _openrlhf_values(openrlhf_ppo.critic_output_dir, ids)
    )
    tag = _convert(run_cli, openrlhf_ppo.critic / openrlhf_ppo.latest, tmp_path / "tag")
    assert tag["model_check"]["architecture"] == "LlamaForTokenClassification"
    assert sorted(load_file(str(tmp_path / "tag" / "model.safetensors")))[-1] == "score.weight"


@pytest.fixture
def reward_model(openrlhf_ppo: WrittenOpenRlhf, tmp_path: Path) -> Path:
    """OpenRLHF's critic folder as `save_model` writes a reward model: `RewardModel` is built like `CriticModel`
    (`_get_reward_model`), so only the class name `save_pretrained` records differs; the head under OpenRLHF's
    former `value_head_prefix`, `value_head`, which its config then names."""
    folder = copy_tree(openrlhf_ppo.critic_output_dir, tmp_path / "rm")
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["RewardModel"], value_head_prefix="value_head")
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["value_head.weight"] = tensors.pop("score.weight")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_a_reward_model_converts_to_sequence_classification(reward_model: Path, tmp_path: Path, run_cli: Cli) -> None:
    """A `RewardModel` converts to `LlamaForSequenceClassification` with one label, its `value_head` renamed
    `score`; transformers' reward is OpenRLHF's value at the last token."""
    from transformers import AutoModelForSequenceClassification

    result = _convert(run_cli, reward_model, tmp_path / "hf")
    assert result["model_check"]["architecture"] == "LlamaForSequenceClassification"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["value_head_prefix"] == "score"  # OpenRLHF's loader finds the renamed head
    assert "value_head.weight" not in load_file(str(tmp_path / "hf" / "model.safetensors"))
    model, info = AutoModelForSequenceClassification.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    ids = torch.tensor([TOKEN_IDS])
    with torch.no_grad():
        reward = model.eval()(input_ids=ids).logits
    torch.testing.assert_close(reward[:, 0], _openrlhf_values(reward_model, ids)[:, -1])


def test_the_head_without_a_task_is_left_alone_with_a_note() -> None:
    """A causal LM config beside a head without bias, from a framework that does not say what it builds: no
    guess, a note naming what to pass; a model with an `lm_head` has no value head."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4}
    notes: list[str] = []
    assert find_value_head({"model.norm.weight": (4,), "score.weight": (1, 4)}, config, None, notes) is None
    assert "--config" in notes[0]
    assert find_value_head({"lm_head.weight": (8, 4), "score.weight": (1, 4)}, config, HeadTask.TOKEN, []) is None
    assert find_value_head({"score.weight": (1, 5)}, config, HeadTask.TOKEN, []) is None  # not the hidden size
    head = find_value_head({"score.weight": (1, 4), "score.bias": (1,)}, config, None, [])
    assert head is not None and head.architecture == "LlamaForTokenClassification"
    normalized: list[str] = []
    openrlhf = {**config, "architectures": ["RewardModel"], "normalize_reward": True, "mean": 0.5, "std": 2.0}
    head = find_value_head({"value_head.weight": (1, 4)}, openrlhf, None, normalized)
    assert head is not None and head.architecture == "LlamaForSequenceClassification"
    assert head.names == {"value_head.weight": "score.weight"} and "normalizes" in normalized[0]
