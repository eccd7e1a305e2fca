"""A PEFT adapter folder, loaded by PEFT itself: `PeftModel.from_pretrained(base, adapter)` (peft/peft_model.py:
PeftModel.from_pretrained reads `adapter_config.json` through `PeftConfig.from_pretrained`, then
`load_adapter` the weights, `adapter_model.safetensors` or `adapter_model.bin`) onto the base model the adapter
was trained on, loaded afresh by transformers for each cell. The PEFT model's state dict and its adapter config
are the state compared."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.faults.cells import loader_verdicts
from tests.faults.loaders.common import run


def load(path: str, options: Mapping[str, Any]) -> Any:
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.set_verbosity_warning()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(options["base"]), path)
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in model.peft_config["default"].to_dict().items()}
    return {"model": model.state_dict(), "config": config}


def build(checkpoint: Path, base: Path, _out: Path) -> dict[str, str]:
    """PEFT's verdict on each cell of an adapter folder (`PeftModel.save_pretrained`'s output) on `base`."""
    return loader_verdicts(__name__, checkpoint, base=str(base), loggers=["transformers", "peft"])


if __name__ == "__main__":
    run(load)
