"""Loading a committed native checkpoint from a local folder into a live training state (the body of
`CheckpointManager.restore`, once the step is chosen and its files are local)."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from ckptctl.core import distributed as dist_
from ckptctl.core import rng
from ckptctl.core.entries import CheckpointWarning, kind_of, load_into
from ckptctl.core.snapshot import SHARDED_KINDS
from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats import state_tree
from ckptctl.formats.manifest import MANIFEST_NAME, Manifest, load_manifest

__all__ = ["load"]


def load(state: MutableMapping[str, Any], folder: str, world: dist_.World, name: str) -> None:
    """Load the checkpoint in the local `folder` into `state` and restore this rank's generators.

    Objects are loaded in place; plain values replace `state[key]`; entries the checkpoint does not hold
    keep their state, with a `CheckpointWarning` that names the checkpoint `name` (its step folder).

    Raises:
        CorruptCheckpoint: the manifest or a file is unreadable, or an entry's kind does not match.
    """
    manifest = load_manifest(os.path.join(folder, MANIFEST_NAME))
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
        with _fits(folder, key):
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


@contextlib.contextmanager
def _fits(folder: str, name: str) -> Iterator[None]:
    """Turn the errors of `load_state_dict` on a stored state of the wrong shape into a `CorruptCheckpoint`.

    A tree that decodes but is not what the object saved (a damaged or hand-edited `{name}.json`: a list
    where a dict belongs, a missing key, a string for a number) fails inside torch with whatever error the
    first mismatch raises. Errors torch raises for tensors that do not fit (RuntimeError: a different model)
    are left as they are.
    """
    try:
        yield
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        raise CorruptCheckpoint(
            f"{os.path.join(folder, name)}.json: the stored state does not load into state[{name!r}] "
            f"({type(exc).__name__}: {exc})",
            "the checkpoint is damaged, or was saved from a different kind of object; restore another step",
        ) from exc
