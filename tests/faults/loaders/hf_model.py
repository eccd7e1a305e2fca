"""A Hugging Face model folder, loaded by transformers itself: `AutoModelForCausalLM.from_pretrained`
(transformers/modeling_utils.py: PreTrainedModel.from_pretrained: config.json, the weights or the shard index
and its shards, generation_config.json), and `AutoTokenizer.from_pretrained` where the folder holds tokenizer
files. The model's state dict and its generation config are the state compared."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.faults.cells import loader_verdicts
from tests.faults.loaders.common import run

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load(path: str, options: Mapping[str, Any]) -> Any:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.set_verbosity_warning()
    model = AutoModelForCausalLM.from_pretrained(path)
    # The generation settings that differ from GenerationConfig's defaults (what the saved file says beyond
    # them), without the version and provenance fields a rebuilt config sets otherwise, and without flags off
    # either way (False in a saved file, None in a rebuilt one: generate reads both as off).
    generation = {
        key: value
        for key, value in model.generation_config.to_diff_dict().items()
        if key not in ("transformers_version", "_from_model_config") and value is not None and value is not False
    }
    state: dict[str, Any] = {"model": model.state_dict(), "generation": generation}
    if options["tokenizer"]:
        tokenizer = AutoTokenizer.from_pretrained(path)
        state["tokenizer"] = {"vocab": tokenizer.get_vocab(), "specials": tokenizer.all_special_tokens}
    return state


def build(checkpoint: Path, _out: Path) -> dict[str, str]:
    """transformers' verdict on each cell of a model folder (`save_pretrained`'s output)."""
    tokenizer = any((checkpoint / name).exists() for name in _TOKENIZER_FILES)
    return loader_verdicts(__name__, checkpoint, tokenizer=tokenizer, loggers=["transformers"])


if __name__ == "__main__":
    run(load)
