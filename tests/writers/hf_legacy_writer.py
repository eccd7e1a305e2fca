"""Hugging Face model folders as older transformers wrote them, and a tied-embedding model as 5.x writes it.

transformers 5 dropped `save_pretrained(safe_serialization=False)` (5.24's `PreTrainedModel.save_pretrained`
writes safetensors only), yet `pytorch_model.bin` folders are everywhere. The legacy folders are written
the way transformers 4.x's `save_pretrained` wrote them with `safe_serialization=False`
(huggingface/transformers v4.46 `src/transformers/modeling_utils.py`, `PreTrainedModel.save_pretrained`):
the state dict split by `huggingface_hub.split_torch_state_dict_into_shards(state_dict,
filename_pattern="pytorch_model{suffix}.bin", max_shard_size=...)`, each shard
`{name: state_dict[name].contiguous()}` written by `save_function=torch.save`, and, when sharded,
`pytorch_model.bin.index.json` (`{"metadata": split.metadata, "weight_map": split.tensor_to_filename}`,
`json.dumps(index, indent=2, sort_keys=True) + "\\n"`); the config, its `architectures` set to the model's
class, by `config.save_pretrained`, and the generation config by `generation_config.save_pretrained`.
Unlike the safetensors path, that branch keeps tied weights: `lm_head.weight` is pickled as the same storage
as `model.embed_tokens.weight`.

- `single`: the untied tiny Llama of `tests.writers.models.tiny_llama`, one `pytorch_model.bin`.
- `sharded`: the same Llama with `tie_word_embeddings=True`, `max_shard_size="20KB"` (several shards).
- `tied`: that tied Llama saved by transformers 5's own `save_pretrained` (safetensors; the tied
  `lm_head.weight` left out, as transformers does).

Each folder has its model's full `state_dict()` beside it as `<name>.reference.pt` (plain tensors).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["WrittenLegacy", "write_legacy_models"]


@dataclass(frozen=True)
class WrittenLegacy:
    """The folders and the state dicts (with tied names) they hold."""

    single: Path
    sharded: Path
    tied: Path

    @staticmethod
    def reference(folder: Path) -> dict[str, torch.Tensor]:
        """The model's full `state_dict()` (tied names included) written beside `folder`."""
        loaded: dict[str, torch.Tensor] = torch.load(folder.with_suffix(".reference.pt"), weights_only=True)
        return loaded


def _save_legacy(model: torch.nn.Module, folder: Path, max_shard_size: str) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    folder.mkdir(parents=True)
    state_dict = model.state_dict()
    split = split_torch_state_dict_into_shards(
        state_dict, filename_pattern="pytorch_model{suffix}.bin", max_shard_size=max_shard_size
    )
    for file_name, names in split.filename_to_tensors.items():
        torch.save({name: state_dict[name].contiguous() for name in names}, folder / file_name)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    # save_pretrained names the class in the config before saving it (`config.architectures = [...]`)
    model.config.architectures = [type(model).__name__]  # type: ignore[union-attr]
    model.config.save_pretrained(folder)  # type: ignore[operator]
    # and, for a model that can generate, its generation config beside it (`if self.can_generate():
    # model_to_save.generation_config.save_pretrained(save_directory)`)
    if model.can_generate():  # type: ignore[operator]
        model.generation_config.save_pretrained(folder)  # type: ignore[union-attr]


def _save_reference(model: torch.nn.Module, folder: Path) -> None:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, folder.with_suffix(".reference.pt"))


def write_legacy_models(root: Path) -> WrittenLegacy:
    """Write the three folders under `root` (about a second: tiny models, no processes)."""
    from tests.writers.models import tiny_llama

    untied = tiny_llama()
    _save_legacy(untied, root / "single", "50GB")
    _save_reference(untied, root / "single")
    tied = tiny_llama(tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    _save_legacy(tied, root / "sharded", "20KB")
    _save_reference(tied, root / "sharded")
    tied.save_pretrained(root / "tied")
    _save_reference(tied, root / "tied")
    return WrittenLegacy(root / "single", root / "sharded", root / "tied")
