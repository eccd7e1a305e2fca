"""What `convert` reads from verl's checkpoints beyond their tensor index (`ConvertSource`): where verl keeps
the model's config and tokenizer."""

from __future__ import annotations

from collections.abc import Sequence

from ckptctl import io
from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import ConvertSource, default_config_folders
from ckptctl.families.value_head import HeadTask
from ckptctl.frameworks.verl.layout import HF_FOLDER, STEP_RE

__all__ = ["SOURCE"]


def _config_folders(checkpoint: Checkpoint) -> Sequence[str]:
    """The `huggingface/` folder verl writes beside the rank files (config and tokenizer): the converted
    role's own first."""
    url = checkpoint.url
    if STEP_RE.match(io.name_of(url)):
        role = checkpoint.metadata.get("tensors_of")
        return (io.join(url, str(role), HF_FOLDER), *default_config_folders(checkpoint))
    return (io.join(url, HF_FOLDER), *default_config_folders(checkpoint))


def _value_head_task(checkpoint: Checkpoint) -> HeadTask:
    """A critic: verl builds it as `AutoModelForTokenClassification` with `num_labels=1` (verl/utils/model.py,
    `load_valuehead_model`, from verl/workers/engine/fsdp/transformer_impl.py for a `value_model`), and saves the
    config it was loaded with, which names the base causal LM, in `huggingface/`."""
    return HeadTask.TOKEN


SOURCE = ConvertSource(config_folders=_config_folders, value_head_task=_value_head_task)
