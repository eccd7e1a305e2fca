"""torch.distributed.checkpoint (DCP) folders: `.metadata` + `__{rank}_{n}.distcp` (LAYOUTS.md, DCP).

The folder reader and verifier are a shared part (`families.dcp_folder`: other plugins keep DCP
folders too); the plugin adds how `dcp.load` resumes (`frameworks.dcp.resume`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptctl.families.dcp_folder import DcpFolderLayout

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = ["DcpLayout"]


class DcpLayout(DcpFolderLayout):
    """A torch DCP checkpoint folder that no framework around it claims."""

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.dcp.resume`."""
        from ckptctl.frameworks.dcp.resume import PROFILE

        return PROFILE
