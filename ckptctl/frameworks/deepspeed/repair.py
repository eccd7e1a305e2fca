"""DeepSpeed's pointer: `engine.load_checkpoint(save_dir)` without a tag loads the tag `latest` names
(deepspeed/runtime/engine.py, `load_checkpoint`), and `save_checkpoint` writes the tag name alone into it."""

from __future__ import annotations

from ckptctl import io
from ckptctl.contract.capabilities import Pointer
from ckptctl.families.pointers import FollowsPointer
from ckptctl.families.zero_tag.names import LATEST_NAME


def latest_naming(tag: str) -> Pointer:
    """The `latest` beside the tag folder `tag`, naming it."""
    return Pointer(io.join(io.parent_of(tag), LATEST_NAME), io.name_of(tag))


POINTER_WRITER = FollowsPointer(lambda tag: (latest_naming(tag),))
