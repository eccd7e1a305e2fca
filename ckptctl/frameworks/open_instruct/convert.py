"""What `convert` reads from open-instruct's checkpoints beyond their tensor index (`ConvertSource`): a tag's
master weights, and the HF snapshots that hold the config a tag lacks."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ckptctl import io
from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import ConvertSource, MasterWeights, default_config_folders
from ckptctl.families.zero_tag.master_weights import checkpoint_master_weights, tag_prefix
from ckptctl.frameworks.open_instruct.layout import SNAPSHOT_RE, SNAPSHOTS_SUFFIX, listing_or_empty

__all__ = ["SOURCE"]

_RUN_TIME = re.compile(r"__(\d+)_checkpoints$")
#: How many sibling folders of a checkpoint state folder `config_folders` looks into for snapshot folders.
_MAX_SIBLINGS = 64


def _master_weights(checkpoint: Checkpoint, *, required: bool, notes: list[str]) -> MasterWeights | None:
    """A tag's fp32 master weights, as DeepSpeed's zero_to_fp32 rebuilds them; a snapshot has none."""
    prefix = tag_prefix(checkpoint)
    return checkpoint_master_weights(checkpoint, prefix, required=required, notes=notes)


def _config_folders(checkpoint: Checkpoint) -> Sequence[str]:
    """A tag: open-instruct's HF snapshots (`{output_dir}/{run_name}_checkpoints/step_{training_step}/`, each
    saved with the model's config and tokenizer), the one of the tag's training step first, then the
    others newest first; a tag keeps neither. A snapshot: its own folder.

    Nothing on disk ties `--checkpoint_state_dir` to `--output_dir`, so the snapshots are looked for where
    people put them: in `*_checkpoints` folders beside the checkpoint state folder, or one folder below
    its siblings (`run/state/` beside `run/output/{run_name}_checkpoints/`)."""
    url = checkpoint.ref.url
    if SNAPSHOT_RE.match(io.name_of(url)):
        return default_config_folders(checkpoint)
    state_dir = io.parent_of(url)
    snapshots: list[tuple[int, str, str]] = []
    for folder in _snapshot_folders(io.parent_of(state_dir), state_dir):
        snapshots += [
            (int(m.group(1)), io.name_of(folder), io.join(folder, e.name))
            for e in listing_or_empty(folder)
            if e.is_dir and (m := SNAPSHOT_RE.match(e.name))
        ]
    step = checkpoint.ref.step
    # Same step first; then by step, newest first; between runs, the newest (run names end in a Unix time).
    snapshots.sort(key=lambda s: (s[0] != step, -s[0], -_run_time(s[1])))
    return (*(path for _, _, path in snapshots), *default_config_folders(checkpoint))


def _snapshot_folders(base: str, state_dir: str) -> list[str]:
    """The `*_checkpoints` folders in `base` and in its child folders other than `state_dir` (the first
    `_MAX_SIBLINGS` of them)."""
    children = [e.name for e in listing_or_empty(base) if e.is_dir]
    found = [io.join(base, name) for name in children if name.endswith(SNAPSHOTS_SUFFIX)]
    siblings = [n for n in children if not n.endswith(SNAPSHOTS_SUFFIX) and io.join(base, n) != state_dir]
    for name in siblings[:_MAX_SIBLINGS]:
        folder = io.join(base, name)
        found += [
            io.join(folder, e.name) for e in listing_or_empty(folder) if e.is_dir and e.name.endswith(SNAPSHOTS_SUFFIX)
        ]
    return found


def _run_time(folder_name: str) -> int:
    """The Unix time a run's snapshot folder name ends with (`{exp_name}__{seed}__{time}_checkpoints`)."""
    m = _RUN_TIME.search(folder_name)
    return int(m.group(1)) if m else 0


SOURCE = ConvertSource(master_weights=_master_weights, config_folders=_config_folders)
