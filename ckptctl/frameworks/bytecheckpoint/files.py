"""The names of what ByteCheckpoint writes (bytecheckpoint 0.0.2, `checkpointer/meta_type.py`), which its reader
(`layout`) and its resume profile (`resume`) both go by, and how to read its tracker.

```
ckpt_path/                                  what `bcp.save(ckpt_path, ..., global_steps=N)` is given
    latest_checkpointed_iteration.txt       the tracker: rank 0 writes the step atomically once its gRPC
                                            coordinator has gathered that every rank wrote its files
    global_step_{N}/                        one checkpoint (`bcp.load` takes this folder)
        model/                              `.metadata` (a pickle of ByteCheckpoint's `Metadata`: DCP's
        optimizer/                          tensor metadata, storage records, one pickled tensor header per
                                            record) and `__{rank}_{i}.distcp` files of raw tensor bytes
        extra_state/extra_state_rank_{R}.pt a torch.save (protocol 4) of each rank's extra state
```
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ckptctl import io
from ckptctl.errors import CkptctlError
from ckptctl.io import DirEntry
from ckptctl.layouts import peek_dir

__all__ = [
    "COMPONENT_FOLDERS",
    "EXTRA_STATE",
    "EXTRA_STATE_RE",
    "MODEL",
    "OPTIMIZER",
    "STEP_RE",
    "TRACKER",
    "read_tracker",
    "tracker_of",
]

#: `_DIRECTORY_FORMAT`: the folder `global_steps` names.
STEP_RE = re.compile(r"^global_step_(\d+)$")
#: `get_checkpoint_tracker_filename`.
TRACKER = "latest_checkpointed_iteration.txt"
MODEL = "model"
OPTIMIZER = "optimizer"
EXTRA_STATE = "extra_state"
#: The folders of the state dicts ByteCheckpoint writes with DCP's metadata over raw bytes.
COMPONENT_FOLDERS = (MODEL, OPTIMIZER)
#: `_EXTRA_STATE_FORMAT`.
EXTRA_STATE_RE = re.compile(r"^extra_state_rank_(\d+)\.pt$")
#: The tracker holds the step as decimal digits; anything longer is not one.
_MAX_TRACKER = 64


def read_tracker(url: str, entries: Sequence[DirEntry]) -> int | None:
    """The step the tracker in the save path `url` names, if it holds one."""
    if not any(e.name == TRACKER and not e.is_dir for e in entries):
        return None
    try:
        value = io.read_bytes(io.join(url, TRACKER), 0, _MAX_TRACKER).strip()
    except CkptctlError:
        return None
    return int(value) if value.isdigit() and len(value) < 19 else None


def tracker_of(run: str) -> int | None:
    """The step the tracker of the save path `run` names, if any."""
    entries = peek_dir(run)
    return None if entries is None else read_tracker(run, entries)
