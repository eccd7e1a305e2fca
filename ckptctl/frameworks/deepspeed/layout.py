"""DeepSpeed ZeRO save folders, as `engine.save_checkpoint` writes them (LAYOUTS.md, DeepSpeed).

```
SAVE_DIR/latest                         the newest tag, e.g. `global_step40`
SAVE_DIR/{tag}/                         one checkpoint (a "tag folder")
    mp_rank_{mp:02d}_model_states.pt                        ZeRO 0-2: module weights + metadata
    zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt      ZeRO-3: one per DP rank, no weights inside
    [bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt   one per DP rank: fp32 flat partitions
```

A tag is read with the ZeRO tag part (`families.zero_tag`: `names` for rank files and `latest` from
listings, `tag` for the rank-0 facts, `tensor_index`, `master_weights` for zero_to_fp32's output, `verify`,
`folder` for the ref and the checkpoint), which the layouts built on DeepSpeed share. This package holds
DeepSpeed's own: this layout, its resume profile, the classes its files pickle (`pickle_classes`), and
`universal` and `universal_states`, the layout of what `ds_to_universal` makes of a tag.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ckptctl.checkpoint import Checkpoint, CheckpointRef, Problem
from ckptctl.contract.base import Layout, every_child_folder
from ckptctl.families.zero_tag.folder import open_tag, tag_ref
from ckptctl.families.zero_tag.names import read_latest, tag_markers
from ckptctl.families.zero_tag.verify import verify_tag
from ckptctl.io import DirEntry

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = ["DeepSpeedLayout"]


class DeepSpeedLayout(Layout):
    """A DeepSpeed ZeRO (0-3) tag folder; its parent is the run and holds `latest`."""

    name = "deepspeed"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A ref when the folder is a ZeRO tag (`tag_ref`)."""
        return tag_ref(url, entries, self.name)

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """The tag the save folder's `latest` file names."""
        return read_latest(url, entries)

    def members(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """Every child folder: a tag is what one `save_checkpoint` wrote (NVMe offload adds
        `offloaded_tensors/`)."""
        return every_child_folder(entries)

    def open(self, url: str) -> Checkpoint:
        """The tag's rank-0 facts and its tensor index (`open_tag`)."""
        return open_tag(url, self.name)

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """`verify_tag`, plus the save folder's `latest` pointer naming an existing tag."""
        return verify_tag(checkpoint.url, latest=True)

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """The rank-0 model states (`tag_markers`): DeepSpeed writes no marker, but without them the tag
        reads broken."""
        return tag_markers(files)

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.deepspeed.resume`."""
        from ckptctl.frameworks.deepspeed.resume import PROFILE

        return PROFILE
