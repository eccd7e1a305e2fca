"""The metadata of a DCP folder: its `.metadata`, or the merge of the per-rank `__{rank}.metadata` files of
a save without collectives, parsed once (a small cache keyed by each file's version), and the torch.save
archives it places (every item of the folder, for the CRC check).

Here rather than beside the DCP folder reader (`families.dcp_folder`) because the contract's
`Layout.torch_archives` default (`contract.base`) reads the items of any DCP folder a checkpoint holds, and the
contract sits below the shared readers: this module needs nothing of the layouts, only `formats` and `io`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from ckptctl import io
from ckptctl.errors import CheckpointInProgress
from ckptctl.formats.dcp_metadata import (
    MAX_METADATA_BYTES,
    METADATA_NAME,
    RANK_METADATA,
    DcpMetadata,
    merge_rank_metadata,
    parse_dcp_metadata,
)
from ckptctl.formats.torch_zip import TorchArchive
from ckptctl.io import DirEntry

__all__ = ["dcp_item_archives", "in_progress_error", "load_dcp_metadata", "parse_cached", "rank_metadata"]

#: A parse cache owned by this module for the whole process, not by a scan (`layouts.ScanContext`): it is
#: keyed by the file's version (URL, size, mtime), so it serves only the bytes it parsed, whichever operation
#: asks. A store that reports no mtime is not cached. Object stores report whole seconds, so a `.metadata`
#: rewritten in place with the same size within one second of an earlier read could be served stale.
_CACHE_SIZE = 2
_cache: OrderedDict[tuple[str, int, float], DcpMetadata] = OrderedDict()
_cache_lock = threading.Lock()


def load_dcp_metadata(url: str, entry: DirEntry | None = None) -> DcpMetadata:
    """Read and parse the `.metadata` of the DCP folder at `url` (a small cache keyed by size and mtime), or,
    without one, the merge of its per-rank `__{rank}.metadata` files (a save without collectives).

    Args:
        url: the DCP folder.
        entry: its `.metadata` listing entry when the caller has it (saves a listing).

    Raises:
        CheckpointInProgress: there is neither `.metadata` nor a per-rank one (the save has not finished).
        UnsafePickle: the file asks for a global outside the allowlist.
        CorruptCheckpoint: it does not parse or validate.
    """
    if entry is None:
        listing = io.list_dir(url)
        entry = next((e for e in listing if e.name == METADATA_NAME and not e.is_dir), None)
        if entry is None:
            ranks = rank_metadata(listing)
            if not ranks:
                raise in_progress_error(url)
            return merge_rank_metadata([(e.name, parse_cached(io.join(url, e.name), e)) for e in ranks])
    return parse_cached(io.join(url, METADATA_NAME), entry)


def rank_metadata(entries: Sequence[DirEntry]) -> list[DirEntry]:
    """The per-rank `__{rank}.metadata` files of a listing, in rank order (a save without collectives)."""
    found = [(int(m.group(1)), e) for e in entries if not e.is_dir and (m := RANK_METADATA.match(e.name))]
    return [e for _, e in sorted(found, key=lambda item: item[0])]


def parse_cached(path: str, entry: DirEntry) -> DcpMetadata:
    """The parsed metadata file at `path` (`entry` its listing entry), from the cache when its version is there."""
    key = (path, entry.size, entry.mtime)
    with _cache_lock:
        cached = _cache.get(key)
        if cached is not None:
            _cache.move_to_end(key)
            return cached
    parsed = parse_dcp_metadata(io.read_bytes(path, max_size=MAX_METADATA_BYTES), path)
    if entry.mtime:  # a store that reports no mtime could not tell a rewritten file from the cached one
        with _cache_lock:
            _cache[key] = parsed
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return parsed


def in_progress_error(url: str) -> CheckpointInProgress:
    """What reading the metadata of the DCP folder `url` raises when it has none yet."""
    return CheckpointInProgress(
        f"{url} has no {METADATA_NAME}: the DCP save has not finished (or was interrupted)",
        "wait for the save, or pick another checkpoint",
    )


def dcp_item_archives(url: str, path_prefix: str = "") -> tuple[TorchArchive, ...]:
    """The torch.save archive of every item of the DCP folder at `url`, in file order, for the CRC check.

    torch's FileSystemWriter writes each item, a tensor chunk and a bytes item alike, as a torch.save zip
    archive (`torch.save(tensor, stream)` in `filesystem._write_item`; the planner torch.saves bytes items),
    whose records carry CRC-32s. Items written with a stream transform (a compression extension) are left
    out: their stored bytes are not the archive.

    Args:
        url: the DCP folder.
        path_prefix: prepended to the file names (the archives' files are relative to an outer checkpoint).

    Raises:
        CheckpointInProgress, UnsafePickle, CorruptCheckpoint: as `load_dcp_metadata`.
    """
    archives = [
        TorchArchive(
            path_prefix + record.relative_path,
            record.offset,
            record.length,
            key,
            "" if offsets is None else f"chunk at {list(offsets)}",
        )
        for (key, offsets), record in load_dcp_metadata(url).storage.items()
        if not record.transforms
    ]
    archives.sort(key=lambda a: (a.file, a.offset))
    return tuple(archives)
