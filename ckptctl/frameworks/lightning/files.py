"""The names of what Lightning's `ModelCheckpoint` and strategies write, which its reader (`layout`) and its
resume profile (`resume`) both go by."""

from __future__ import annotations

__all__ = ["DEEPSPEED_TAG", "LAST", "META", "SUFFIX"]

SUFFIX = ".ckpt"
#: `ModelCheckpoint.CHECKPOINT_NAME_LAST` (and its `-vN` versions when the name was taken).
LAST = "last.ckpt"
#: The sharded folder's last file (`lightning.fabric.utilities.load._METADATA_FILENAME`).
META = "meta.pt"
#: The tag `DeepSpeedStrategy.save_checkpoint` saves under, inside the `.ckpt` folder.
DEEPSPEED_TAG = "checkpoint"
