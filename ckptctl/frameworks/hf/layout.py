"""Hugging Face model folders as `save_pretrained` writes them.

The folder reader and verifier are a shared part (`layouts.parts.hf_folder`: the checkpoints of other
plugins hold model folders too); the plugin adds what a model folder resumes as (`frameworks.hf.resume`)
and the model transformers builds from its config (`frameworks.hf.architecture`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptctl.frameworks.hf.resume import PROFILE
from ckptctl.layouts.base import ModelSpec
from ckptctl.layouts.parts.hf_folder import HfFolderLayout
from ckptctl.layouts.resume import ResumeProfile

__all__ = ["HfModelLayout"]


class HfModelLayout(HfFolderLayout):
    """A Hugging Face model folder that no framework around it claims."""

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.hf.resume`."""
        return PROFILE

    def model_spec(self, config: Mapping[str, Any], notes: list[str]) -> ModelSpec | None:
        """The model transformers builds from `config` on the meta device (see `frameworks.hf.architecture`)."""
        from ckptctl.frameworks.hf.architecture import model_spec

        return model_spec(config, notes)

    def model_logits(self, folder: str, config: Mapping[str, Any], tensors: Mapping[str, Any] | None) -> Any:
        """See `frameworks.hf.architecture.model_logits`."""
        from ckptctl.frameworks.hf.architecture import model_logits

        return model_logits(folder, config, tensors)
