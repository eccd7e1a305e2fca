"""How `CheckpointManager.restore` resumes from what the core wrote: the full state on one process, the
DCP part resharded on several, the RNG state per rank."""

from __future__ import annotations

import re

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointState, Component
from ckptctl.contract.resume import PlanContext, ResumeProfile, WorldSizeCheck, target_ranks
from ckptctl.errors import CkptctlError
from ckptctl.families.dcp_resume import overwrite_warnings
from ckptctl.formats.documents import read_json
from ckptctl.formats.manifest import MANIFEST_NAME
from ckptctl.formats.native import DCP_FOLDER, read_native_manifest
from ckptctl.quoting import Code, python_call

__all__ = ["PROFILE"]


#: What `CheckpointManager.restore(state)` passes over by itself: no step is needed to skip these.
_PASSED_OVER = (CheckpointState.IN_PROGRESS, CheckpointState.ABANDONED, CheckpointState.SUPERSEDED)


def _hint(ctx: PlanContext) -> str:
    root = io.parent_of(ctx.url)
    picked = all(s.state in _PASSED_OVER for s in ctx.skipped)
    step = {} if picked or ctx.checkpoint.ref.step is None else {"step": ctx.checkpoint.ref.step}
    return python_call(f"{python_call('CheckpointManager', root)}.restore", Code("state"), **step)


def _world_size(ctx: PlanContext) -> WorldSizeCheck:
    checkpoint = ctx.checkpoint
    saved = checkpoint.world_size
    target = target_ranks(ctx, saved) or 1
    manifest = read_native_manifest(ctx.url)
    sharded = any(c.storage == "dcp" for c in manifest.components.values())
    rng_ranks = sorted(int(m.group(1)) for f in checkpoint.files if (m := re.fullmatch(r"rng\.rank-(\d+)\.json", f)))
    if not sharded:
        per_rank = sum(size for name, size in checkpoint.files.items() if name != MANIFEST_NAME)
        note = "a single-process save: every rank reads all of it and loads the full state"
        if target > 1:
            note += "; every rank restores the same RNG state, so ranks draw identical random numbers"
        return WorldSizeCheck(saved, target, True, note, bytes_per_rank=per_rank)
    prefix = f"{DCP_FOLDER}/"
    dcp_bytes = sum(e.nbytes for e in checkpoint.tensors() if e.chunks and e.chunks[0].file.startswith(prefix))
    other = sum(
        size
        for name, size in checkpoint.files.items()
        if not name.startswith(prefix) and not re.match(r"rng\.rank-(?!0\.)\d+\.", name)
    )
    note = f"model and optimizer are torch DCP: they reshard onto {target} rank(s)"
    if rng_ranks and target > len(rng_ranks):
        note += (
            f"; ranks {len(rng_ranks)}..{target - 1} find no RNG state of their own and keep their seeded generators"
        )
    return WorldSizeCheck(saved, target, True, note, bytes_per_rank=dcp_bytes // target + other)


def _rng_keys(checkpoint: Checkpoint) -> frozenset[str] | None:
    """The keys of rank 0's `rng*.json` tree (a small JSON file, read on demand)."""
    name = next((f for f in sorted(checkpoint.files) if re.fullmatch(r"rng(\.rank-0)?\.json", f)), None)
    if name is None:
        return None
    try:
        tree = read_json(io.join(checkpoint.url, name)).get("tree")
    except (AttributeError, CkptctlError):
        return None
    return frozenset(tree) if isinstance(tree, dict) else None


PROFILE = ResumeProfile(
    framework="ckptctl",
    hint=_hint,
    world_size=_world_size,
    impacts={
        Component.DATALOADER: "no data loader/sampler state was saved: pass a stateful sampler in `state` to "
        "keep the data order; as it is the order restarts",
    },
    rng_keys=_rng_keys,
    traps=overwrite_warnings,
)
