"""What `convert` reads from the Hugging Face model folder it writes (`ConvertSource`): the model that a
config describes and its logits, from transformers itself (`frameworks.hf.architecture`)."""

from __future__ import annotations

from ckptctl.contract.capabilities import ConvertSource
from ckptctl.frameworks.hf.architecture import model_logits, model_spec

__all__ = ["SOURCE"]

SOURCE = ConvertSource(model_spec=model_spec, model_logits=model_logits)
