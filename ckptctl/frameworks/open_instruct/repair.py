"""open-instruct's pointer: `--checkpoint_state_dir` is a DeepSpeed save folder, resumed through
`load_checkpoint(checkpoint_state_dir)` without a tag, which follows its `latest` (open_instruct/
grpo_fast.py, `load_from_checkpoint`)."""

from __future__ import annotations

from ckptctl import io
from ckptctl.contract.capabilities import Pointer
from ckptctl.families.pointers import FollowsPointer
from ckptctl.families.zero_tag.names import LATEST_NAME

POINTER_WRITER = FollowsPointer(lambda tag: (Pointer(io.join(io.parent_of(tag), LATEST_NAME), io.name_of(tag)),))
