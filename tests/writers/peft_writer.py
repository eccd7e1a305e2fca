"""PEFT adapters written by peft 0.21.2 itself, and the merged models PEFT makes of them.

`get_peft_model(<the tiny Llama of tests.writers.models.tiny_llama, loaded from its save_pretrained folder>,
LoraConfig(...))`, every LoRA factor drawn at random (PEFT initialises lora_B to zero, which would make
every merge a no-op), then `PeftModel.save_pretrained(folder)` and, as the reference a merge must equal,
`merge_and_unload().state_dict()` beside it as `<folder>.merged.pt`. Variants:

- `plain`: all seven projections and `embed_tokens` (an Embedding LoRA), `rank_pattern` and `alpha_pattern`;
- `rslora`: `use_rslora=True` (scaling alpha/sqrt(r));
- `modules_to_save`: `modules_to_save=["lm_head"]`, the trained copy of `lm_head` moved off the base's;
- `alpha0`: `lora_alpha=0` (the adapter does nothing; verl exports such configs);
- `dora`: `use_dora=True`, which ckptctl refuses to merge.

`wrapped/step-3`: the `rslora` + `modules_to_save` model saved whole while wrapped, as a training save holds
it: a single-process `torch.distributed.checkpoint.save({"model": peft_model.state_dict()})` (keys
`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`, `...lora_A.default.weight`, ...), with
the run's `adapter_config.json` (`peft_config.save_pretrained`) and the base's `config.json` in `wrapped/`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["VARIANTS", "WrittenPeft", "write_peft_adapters"]

_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": [*_TARGETS, "embed_tokens"],
        "rank_pattern": {"layers.1.self_attn.q_proj": 2},
        "alpha_pattern": {"v_proj": 16},
    },
    "rslora": {"r": 8, "lora_alpha": 16, "use_rslora": True, "target_modules": ["q_proj", "v_proj"]},
    "modules_to_save": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "modules_to_save": ["lm_head"],
    },
    "alpha0": {"r": 4, "lora_alpha": 0, "target_modules": ["q_proj", "v_proj"]},
    "dora": {"r": 4, "lora_alpha": 8, "use_dora": True, "target_modules": ["q_proj", "v_proj"]},
}


@dataclass(frozen=True)
class WrittenPeft:
    """The base model folder, the adapter folders by variant, and the wrapped DCP checkpoint."""

    base: Path
    adapters: dict[str, Path]
    wrapped: Path
    wrapped_parameters: int
    #: PEFT's own count of each adapter's trainable parameters (`get_nb_trainable_parameters`).
    trainable: dict[str, int]

    @staticmethod
    def merged(folder: Path) -> dict[str, torch.Tensor]:
        """PEFT's `merge_and_unload().state_dict()` of the adapter (or wrapped run) at `folder`."""
        loaded: dict[str, torch.Tensor] = torch.load(folder.with_suffix(".merged.pt"), weights_only=True)
        return loaded


def _peft_model(base: Path, settings: dict[str, Any], seed: int) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(**settings))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
            elif ".modules_to_save." in name:  # the trained copy: no longer the base's
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def _save_merged(model: Any, path: Path) -> None:
    merged = model.merge_and_unload()
    torch.save({k: v.detach().clone() for k, v in merged.state_dict().items()}, path)


def write_peft_adapters(root: Path) -> WrittenPeft:
    """Write the base, the adapters and the wrapped run under `root` (a few seconds: no processes)."""
    from tests.writers.models import tiny_llama

    base = root / "base"
    tiny_llama().save_pretrained(base)
    adapters = {}
    trainable = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notes on DoRA and untied lm_head
        for seed, (variant, settings) in enumerate(VARIANTS.items()):
            model = _peft_model(base, settings, seed)
            trainable[variant] = model.get_nb_trainable_parameters()[0]
            adapters[variant] = root / variant
            model.save_pretrained(adapters[variant])
            _save_merged(model, adapters[variant].with_suffix(".merged.pt"))
        wrapped = root / "wrapped" / "step-3"
        model = _peft_model(base, {**VARIANTS["rslora"], "modules_to_save": ["lm_head"]}, 99)
        import torch.distributed.checkpoint as dcp

        state = model.state_dict()
        dcp.save({"model": state}, checkpoint_id=str(wrapped), no_dist=True)
        model.peft_config["default"].save_pretrained(wrapped.parent)
        model.base_model.model.config.save_pretrained(wrapped.parent)
        _save_merged(model, wrapped.with_suffix(".merged.pt"))
    return WrittenPeft(base, adapters, wrapped, sum(t.numel() for t in state.values()), trainable)
