"""A ZeRO tag folder as a checkpoint: its ref from its listing, and the checkpoint its rank-0 files make.

The layouts whose checkpoints are tags (DeepSpeed's own, OpenRLHF's, open-instruct's) read them with
`tag_ref` and `open_tag`, and add what their framework saves around the tag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import cache

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, TensorEntry
from ckptctl.contract.base import folder_size, newest_mtime, step_from_name, timestamp
from ckptctl.errors import CorruptCheckpoint, UnknownLayout
from ckptctl.families.zero_tag.names import is_universal, missing_note, read_latest, tag_files
from ckptctl.families.zero_tag.tag import missing_rank_files, read_tag
from ckptctl.families.zero_tag.tensor_index import tag_index
from ckptctl.io import DirEntry

__all__ = ["open_tag", "tag_ref"]


def tag_ref(url: str, entries: Sequence[DirEntry], layout: str) -> CheckpointRef | None:
    """A ref (of `layout`) when the folder holds DeepSpeed model/optim states and is no universal checkpoint
    (`universal`); BROKEN when it lacks a rank file (`missing_rank_files`: the names, and the world size
    its rank-0 model states record)."""
    files = tag_files(entries)
    if files is None or is_universal(entries):
        return None
    missing = missing_rank_files(url, files)
    return CheckpointRef(
        url=url,
        layout=layout,
        step=step_from_name(io.name_of(url)),
        epoch=None,
        created=timestamp(newest_mtime(entries)),
        state=CheckpointState.BROKEN if missing else CheckpointState.COMPLETE,
        size_bytes=folder_size(url, entries),
        note=missing_note(missing),
    )


def open_tag(url: str, layout: str) -> Checkpoint:
    """Read the rank-0 model and optim states; the tensor index reads the other ranks' `data.pkl`.

    A tag whose rank-0 files do not parse still opens (so that `verify` can say why), as BROKEN,
    with a tensor index that raises the reason.
    """
    entries = io.list_dir(url)
    ref = tag_ref(url, entries, layout)
    files = tag_files(entries)
    if ref is None or files is None:
        raise UnknownLayout(f"{url} is not a DeepSpeed checkpoint (no *_model_states.pt or *_optim_states.pt)")
    all_files = {e.name: e.size for e in entries if not e.is_dir}
    try:
        tag = read_tag(url, files)
    except CorruptCheckpoint as exc:
        return Checkpoint.unreadable(ref, exc, all_files)
    epoch = tag.client_state().get("epoch")
    ref = replace(
        ref,
        step=tag.global_steps if tag.global_steps is not None else ref.step,
        epoch=float(epoch) if isinstance(epoch, int | float) and not isinstance(epoch, bool) else None,
        latest=read_latest(io.parent_of(url), io.list_dir(io.parent_of(url))) == io.name_of(url),
    )

    @cache
    def tensor_index() -> tuple[TensorEntry, ...]:
        return tag_index(tag)

    metadata = tag.metadata()
    return Checkpoint(
        ref=ref,
        components=tag.components(),
        world_size=tag.world_size,
        metadata=metadata,
        tensor_index=tensor_index,
        files=all_files,
        progress=metadata["progress"],
    )
