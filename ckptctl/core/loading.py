"""Loading a committed native checkpoint from a local folder into a live training state (the body of
`CheckpointManager.restore`, once the step is chosen and its files are local)."""

from __future__ import annotations

import os
import warnings
from collections.abc import MutableMapping
from typing import Any

import torch

from ckptctl import io
from ckptctl.core import distributed as dist_
from ckptctl.core import rng
from ckptctl.core.entries import CheckpointWarning, kind_of, load_into
from ckptctl.core.snapshot import SHARDED_KINDS
from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats import state_tree
from ckptctl.formats.manifest import MANIFEST_NAME, Manifest, parse_manifest

__all__ = ["load"]


def load(state: MutableMapping[str, Any], folder: str, world: dist_.World, name: str) -> None:
    """Load the checkpoint in the local `folder` into `state` and restore this rank's generators.

    Objects are loaded in place; plain values replace `state[key]`; entries the checkpoint does not hold
    keep their state, with a `CheckpointWarning` that names the checkpoint `name` (its step folder).

    Raises:
        CorruptCheckpoint: the manifest or a file is unreadable, or an entry's kind does not match.
    """
    manifest = parse_manifest(io.read_bytes(os.path.join(folder, MANIFEST_NAME)), folder)
    modules = {key: obj for key, obj in state.items() if isinstance(obj, torch.nn.Module)}
    sharded: dict[str, tuple[str, Any]] = {}
    missing = []
    for key, obj in list(state.items()):
        component = manifest.components.get(key)
        if component is None or component.kind == "rng":
            missing.append(key)
            continue
        kind = kind_of(key, obj)
        if component.storage == "dcp":
            if kind not in SHARDED_KINDS:
                raise CorruptCheckpoint(f"{folder}: entry {key!r} is stored with DCP but state[{key!r}] is a {kind}")
            sharded[key] = (kind, obj)
            continue
        stored = state_tree.read_files(folder, key)
        if kind == "value":
            state[key] = stored.value
        elif world.multi and kind == "module":
            dist_.load_full_module(obj, stored.value)
        elif world.multi and kind == "optimizer":
            dist_.load_full_optimizer(dist_.owner_of(key, obj, modules), obj, stored.value)
        else:
            load_into(kind, obj, stored.value, stored.extra)
    if sharded:
        dist_.load_dcp(os.path.join(folder, "dcp"), sharded, modules)
    _restore_rng(folder, manifest, world)
    if missing:
        warnings.warn(
            f"{name} holds no entry {', '.join(map(repr, missing))}; it keeps its current state",
            CheckpointWarning,
            stacklevel=3,
        )


def _restore_rng(folder: str, manifest: Manifest, world: dist_.World) -> None:
    # A rank restores its own generators; a single process restoring a multi-rank save takes rank 0's.
    for stem in (f"rng.rank-{world.rank}", "rng"):
        if f"{stem}.json" in manifest.files:
            rng.restore(state_tree.read_files(folder, stem).value, source=f"{folder}/{stem}.json")
            return
    warnings.warn(
        f"{folder} holds no random generator state for rank {world.rank}; the generators keep their current state",
        CheckpointWarning,
        stacklevel=4,
    )
