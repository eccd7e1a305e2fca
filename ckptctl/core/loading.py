"""Loading a committed native checkpoint from a local folder into a live training state (the body of
`CheckpointManager.restore`, once the step is chosen and its files are local)."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch

from ckptctl.core import distributed as dist_
from ckptctl.core import rng
from ckptctl.core.entries import CheckpointWarning, kind_of, load_into
from ckptctl.core.snapshot import SHARDED_KINDS
from ckptctl.errors import CorruptCheckpoint, StateMismatch
from ckptctl.formats import state_tree
from ckptctl.formats.manifest import MANIFEST_NAME, Manifest, load_manifest

__all__ = ["load"]


def load(state: MutableMapping[str, Any], folder: str, world: dist_.World, name: str) -> None:
    """Load the checkpoint in the local `folder` into `state` and restore this rank's generators.

    Objects are loaded in place; plain values replace `state[key]`; entries the checkpoint does not hold
    keep their state, and entries of the checkpoint that `state` does not ask for stay unrestored, each
    with a `CheckpointWarning` that names the checkpoint `name` (its step folder).

    Raises:
        CorruptCheckpoint: the manifest or a file is unreadable, or an entry's kind does not match.
        StateMismatch: a module's parameter names or shapes, or an optimizer's parameter groups, differ
            from the checkpoint's (before anything of that entry is loaded).
    """
    manifest = load_manifest(os.path.join(folder, MANIFEST_NAME))
    # Restoring a model without its optimizer is sometimes meant (fine-tuning from a checkpoint), often
    # not (a key renamed in the training script): say so rather than drop the entry silently.
    unasked = [key for key, c in manifest.components.items() if c.kind != "rng" and key not in state]
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
        _check_fit(name, key, kind, obj, stored.value)
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
    if unasked:
        kinds = ", ".join(f"{key!r} ({manifest.components[key].kind})" for key in unasked)
        warnings.warn(
            f"{name} holds {kinds}, which the state does not ask for: not restored (add the entry to the "
            "state to restore it)",
            CheckpointWarning,
            stacklevel=3,
        )


#: How many mismatching tensors or keys a `StateMismatch` names one by one.
_LISTED = 5


def _check_fit(name: str, key: str, kind: str, obj: Any, stored: Any) -> None:
    """Raise a `StateMismatch` naming the entry, the keys and both shapes when the stored state of a module
    or an optimizer cannot load into `obj` (torch would say `RuntimeError: Error(s) in loading state_dict`,
    or load an optimizer into the wrong parameters)."""
    if kind == "module" and isinstance(stored, dict):
        problems = _module_mismatches(obj.state_dict(), stored)
        what = "parameters and buffers"
    elif kind == "optimizer" and isinstance(stored, dict) and isinstance(stored.get("param_groups"), list):
        problems = _optimizer_mismatches(obj.param_groups, stored["param_groups"])
        what = "parameter groups"
    else:
        return
    if problems:
        more = f" (+{len(problems) - _LISTED} more)" if len(problems) > _LISTED else ""
        raise StateMismatch(
            f"{name}: state[{key!r}] does not fit the checkpoint's {what}: {'; '.join(problems[:_LISTED])}{more}",
            f"build state[{key!r}] as it was when the checkpoint was saved (same model configuration), or "
            "restore another checkpoint",
        )


def _module_mismatches(live: Mapping[str, Any], stored: Mapping[str, Any]) -> list[str]:
    problems = []
    for k, tensor in stored.items():
        here = live.get(k)
        if isinstance(tensor, torch.Tensor) and isinstance(here, torch.Tensor) and tensor.shape != here.shape:
            problems.append(f"{k} is {_shape(tensor)} in the checkpoint and {_shape(here)} in the state")
    absent = [k for k in live if k not in stored]
    extra = [k for k in stored if k not in live]
    if absent:
        problems.append(f"{len(absent)} key(s) of the state missing from the checkpoint ({_names(absent)})")
    if extra:
        problems.append(f"{len(extra)} key(s) of the checkpoint not in the state ({_names(extra)})")
    return problems


def _optimizer_mismatches(live: list[dict[str, Any]], stored: list[Any]) -> list[str]:
    if len(live) != len(stored):
        return [f"{len(stored)} parameter group(s) in the checkpoint, {len(live)} in the state"]
    problems = []
    for i, (here, saved) in enumerate(zip(live, stored, strict=True)):
        params = saved.get("params") if isinstance(saved, dict) else None
        if isinstance(params, list) and len(params) != len(here["params"]):
            problems.append(
                f"group {i} holds {len(params)} parameter(s) in the checkpoint, {len(here['params'])} in the state"
            )
    return problems


def _shape(tensor: torch.Tensor) -> str:
    return str(tuple(tensor.shape))


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:_LISTED]) + (", ..." if len(keys) > _LISTED else "")


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
    first mismatch raises. A state that does not fit (a different model) is found before, by `_check_fit`.
    """
    try:
        yield
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        raise CorruptCheckpoint(
            f"{os.path.join(folder, name)}.json: the stored state does not load into state[{name!r}] "
            f"({type(exc).__name__}: {exc})",
            "the checkpoint is damaged, or was saved from a different kind of object; restore another step",
        ) from exc
