"""Hugging Face model folders as `save_pretrained` writes them.

The folder reader and verifier are a shared part (`families.hf_folder`: the checkpoints of other
plugins hold model folders too); the plugin adds what a model folder resumes as (`frameworks.hf.resume`)
and, as its convert source, the model transformers builds from its config (`frameworks.hf.convert`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptctl.families.hf_folder import HfFolderLayout

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = ["HfModelLayout"]


class HfModelLayout(HfFolderLayout):
    """A Hugging Face model folder that no framework around it claims."""

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.hf.resume`."""
        from ckptctl.frameworks.hf.resume import PROFILE

        return PROFILE
