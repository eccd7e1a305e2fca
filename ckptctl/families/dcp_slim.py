"""Slimming a torch DCP folder (`slim`): the DCP plugin's folders (plain DCP, FSDP2 `get_state_dict` saves),
torchtitan's `step-N/` and Megatron dist-ckpt's `iter_N/` (torch_dist backend).

The model and the training-only state of a DCP save share its data files (`__R_K.distcp`, each item a byte
range of one of them) and one `.metadata` indexing them all. The slim version keeps every item but the
training-only ones, decided by the state-dict key's first segment (`TRAINING_ONLY`: the optimizer of
`get_state_dict` (`optim.*`), torchtitan's and Megatron's (`optimizer.*`), schedulers, dataloaders, RNG
states); the model, counters (`train_state.*`, `trainer_state.*`) and any key it does not know stay. Each data
file holding a kept item is written anew under its own name with only the kept items, their stored bytes
copied as they are, one after another, streamed; a file holding none is dropped; and a new `.metadata`
(`formats.dcp_metadata_write`) places the kept items at their new offsets. `dcp.load` of the kept keys and
`convert` read the same bytes as before.

Kept whole, with the reason: a save without collectives (per-rank `__R.metadata`: torch loads it rank by rank
from files naming each rank's items), a `.metadata` with planner data ckptctl does not know (a custom
planner's: it could describe the dropped items), and a save holding no training-only item (a model-only
save, Megatron's `--no-save-optim` release: nothing to slim).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ckptctl import io
from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import SlimRecipe, SlimRewrite
from ckptctl.contract.rewrites import OneLookSlimmer
from ckptctl.errors import CkptctlError
from ckptctl.formats.dcp_folder_metadata import load_dcp_metadata
from ckptctl.formats.dcp_metadata import (
    METADATA_NAME,
    DcpBytesItem,
    DcpMetadata,
    DcpTensor,
    StorageKey,
    StorageRecord,
)
from ckptctl.formats.dcp_metadata_write import write_dcp_metadata

__all__ = ["TRAINING_ONLY", "DcpSlimmer", "slim_dcp_folder", "training_only"]

#: A key's first segment (up to `.` or `/`) -> what the items under it are: the state only a resume needs.
TRAINING_ONLY: Mapping[str, str] = {
    "optim": "optimizer",  # torch's get_state_dict layout: `optim.state.<fqn>.exp_avg`, `optim.param_groups...`
    "optimizer": "optimizer",  # torchtitan's, Megatron dist-ckpt's
    "optimizers": "optimizer",
    "lr_scheduler": "scheduler",  # torchtitan's
    "lr_schedulers": "scheduler",
    "scheduler": "scheduler",
    "dataloader": "dataloader",  # torchtitan's
    "rng_state": "rng",  # Megatron's `rng_state/shard_R_N`
    "rng": "rng",
}

_FIRST_SEGMENT = re.compile(r"[./]")
#: Bytes copied at a time from an item of the original data file into the new one.
_COPY_BLOCK = 16 << 20


def training_only(key: str) -> str | None:
    """What the item `key` holds when it is training-only state (`optimizer`, `scheduler`, `dataloader`,
    `rng`), else None (the model, counters, anything else: kept)."""
    return TRAINING_ONLY.get(_FIRST_SEGMENT.split(key, maxsplit=1)[0])


@dataclass(frozen=True, slots=True)
class _Plan:
    """The slim version of one DCP folder: kept entries, their records at the new offsets, and per kept data
    file the byte ranges (offset, length) of the original to copy, in order."""

    metadata: DcpMetadata
    entries: dict[str, DcpTensor | DcpBytesItem]
    storage: dict[StorageKey, StorageRecord]
    copies: dict[str, list[tuple[int, int]]]
    drop_files: tuple[str, ...]
    dropped: tuple[str, ...]
    shed_bytes: int


class DcpSlimmer(OneLookSlimmer):
    """The `Slimmer` of the DCP-based layouts (see the module): the checkpoint folder is the DCP folder.

    Args:
        classify: what an item holds when it is training-only state, else None (`training_only` by default;
            AReaL's slot wraps every key in `dcp.`, Lightning's sharded folder names its optimizers
            `optimizer_0`, ...).
    """

    def __init__(self, classify: Callable[[str], str | None] = training_only) -> None:
        self._classify = classify

    def decide(self, checkpoint: Checkpoint) -> SlimRecipe | str:
        return slim_dcp_folder(checkpoint.url, checkpoint.files, self._classify)


def slim_dcp_folder(
    url: str, files: Mapping[str, int], classify: Callable[[str], str | None] = training_only, prefix: str = ""
) -> str | SlimRecipe:
    """The recipe that slims the DCP folder at `url` (see the module), or why it is kept whole.

    Args:
        url: the DCP folder (local).
        files: the checkpoint's files by path relative to the checkpoint folder, with sizes.
        classify: what an item holds when it is training-only state (`training_only`), else None.
        prefix: where the DCP folder lies inside the checkpoint (`dcp/`, `critic/dcp/`; "" when it is the
            checkpoint): the recipe's paths are relative to the checkpoint.
    """
    found = _plan(url, files, classify, prefix)
    if isinstance(found, str):
        return found
    source = io.local_path(url)
    rewrites = [
        SlimRewrite(prefix + name, _copier(os.path.join(source, *name.split("/")), ranges))
        for name, ranges in found.copies.items()
    ]
    planner_data = found.metadata.planner_data
    kept_paths = {k: v for k, v in planner_data.items() if k in found.entries} or None

    def write_metadata(target: str) -> None:
        write_dcp_metadata(
            target, found.metadata, entries=found.entries, storage=found.storage, planner_data=kept_paths
        )

    rewrites.append(SlimRewrite(prefix + METADATA_NAME, write_metadata))
    drop = tuple(prefix + name for name in found.drop_files)
    return SlimRecipe(drop, found.dropped, tuple(rewrites), shed_bytes=found.shed_bytes)


def _plan(url: str, files: Mapping[str, int], classify: Callable[[str], str | None], prefix: str) -> str | _Plan:
    """The slim version of the DCP folder `url`, or why it is kept whole. Reads `.metadata` only."""
    if prefix + METADATA_NAME not in files:
        return (
            "a save without collectives (per-rank .metadata files) or without a .metadata: torch loads it "
            "rank by rank, so its items are not rewritten"
        )
    metadata = load_dcp_metadata(url)
    raw = metadata.raw_planner_data
    if raw is not None and not (type(raw) is dict and len(metadata.planner_data) == len(raw)):
        return "its .metadata holds a custom planner's data, which could describe the items slim would drop"
    what = {key: classify(key) for key in metadata.entries}
    dropped = tuple(sorted({w for w in what.values() if w is not None}))
    if not dropped:
        return "it holds no training-only state (a model-only save): nothing to slim"
    entries = {key: item for key, item in metadata.entries.items() if what[key] is None}
    if not any(isinstance(item, DcpTensor) for item in entries.values()):
        return "it holds no model tensors beside its training-only state: nothing to keep a model of"
    # Each kept record's bytes go, in their original order, to the same-named new file.
    kept = sorted(
        ((key, record) for key, record in metadata.storage.items() if what[key[0]] is None),
        key=lambda kr: (kr[1].relative_path, kr[1].offset),
    )
    storage: dict[StorageKey, StorageRecord] = {}
    copies: dict[str, list[tuple[int, int]]] = {}
    placed: dict[tuple[str, int, int], int] = {}  # one copy of a byte range two records share
    ends: dict[str, int] = {}
    for key, record in kept:
        span = (record.relative_path, record.offset, record.length)
        if span not in placed:
            placed[span] = ends.get(record.relative_path, 0)
            ends[record.relative_path] = placed[span] + record.length
            copies.setdefault(record.relative_path, []).append((record.offset, record.length))
        storage[key] = record._replace(offset=placed[span])
    # The new `.metadata` lists the records in the original's order.
    storage = {key: storage[key] for key in metadata.storage if key in storage}
    referenced = metadata.referenced_files()
    drop_files = tuple(sorted(name for name in referenced if name not in copies))
    sizes = {name: files.get(prefix + name, 0) for name in referenced}
    shed = sum(sizes[name] - ends[name] for name in copies)
    return _Plan(metadata, entries, storage, copies, drop_files, dropped, max(shed, 0))


def _copier(source: str, ranges: list[tuple[int, int]]) -> Callable[[str], None]:
    """A `SlimRewrite.write` that copies `ranges` of `source` one after another into its target: in the kernel
    (`copy_file_range`, which a filesystem may serve by sharing extents) where it can, else block by block."""

    def write(target: str) -> None:
        # Unbuffered: the kernel's copy and the writes here move one file position.
        with open(source, "rb") as src, open(target, "xb", buffering=0) as dst:
            in_kernel = hasattr(os, "copy_file_range")
            for offset, length in ranges:
                done = 0
                while done < length:
                    n = 0
                    if in_kernel:
                        try:
                            n = os.copy_file_range(
                                src.fileno(), dst.fileno(), min(length - done, _COPY_BLOCK), offset + done
                            )
                        except OSError:  # not across these filesystems, or not in this kernel: copy it here
                            in_kernel = False
                            continue
                    else:
                        src.seek(offset + done)
                        block = src.read(min(length - done, _COPY_BLOCK))
                        n = (dst.write(block) or 0) if block else 0
                    if n == 0:
                        raise CkptctlError(f"{source} ends inside an item it should hold: the file is truncated")
                    done += n
            io.count_read(sum(length for _, length in ranges))

    return write
