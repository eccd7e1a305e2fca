"""What `convert` and `diff` read from Megatron's checkpoints beyond their tensor index (`ConvertSource`): the
model under transformers names (`frameworks.megatron.hf`), under its own names as megatron-core's load gives it
to the model (`frameworks.megatron.names`), and where its config and tokenizer lie."""

from __future__ import annotations

from collections.abc import Sequence

from ckptctl import io
from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import ConvertSource, default_config_folders
from ckptctl.frameworks.megatron.hf import hf_model
from ckptctl.frameworks.megatron.layout import TOKENIZER_FOLDER, VERL_HF_FOLDER
from ckptctl.frameworks.megatron.names import native_model

__all__ = ["SOURCE"]


def _config_folders(checkpoint: Checkpoint) -> Sequence[str]:
    """The tokenizer Megatron-LM saved inside the iteration folder (`save_tokenizer_assets`), verl's
    `model/huggingface/` beside its `model/dist_ckpt/` (verl `utils/megatron_utils.py`
    `get_hf_model_checkpoint_path`), then the default places."""
    beside = io.join(io.parent_of(checkpoint.url), VERL_HF_FOLDER)
    return (io.join(checkpoint.url, TOKENIZER_FOLDER), beside, *default_config_folders(checkpoint))


SOURCE = ConvertSource(hf_model=hf_model, native_model=native_model, config_folders=_config_folders)
