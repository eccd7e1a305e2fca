"""The resume rules of a torch DCP folder, for the profile of every plugin that keeps one (the DCP plugin,
the core's `dcp/`, the Trainer's and accelerate's FSDP folders, AReaL's recover slot, Megatron, ROLL,
Lightning, torchtitan): `dcp.load` reshards onto any number of ranks (`reshards`), and a folder
overwritten in place can hold new data under its old `.metadata` (`overwrite_warnings`).
"""

from __future__ import annotations

import os

from ckptctl import io
from ckptctl.contract.resume import PlanContext, WorldSizeCheck, target_ranks
from ckptctl.errors import CkptctlError
from ckptctl.families.dcp_folder import RANK_METADATA_KEY, data_newer_than_metadata
from ckptctl.formats.dcp_metadata import METADATA_NAME
from ckptctl.quoting import comment, shell

__all__ = ["overwrite_warnings", "reshards"]


def reshards(ctx: PlanContext) -> WorldSizeCheck:
    """DCP reshards at load: any number of ranks loads it, each reading its part of the tensors. A save
    without collectives does not: each rank loads from its own `__{rank}.metadata` alone."""
    saved = ctx.checkpoint.world_size
    target = target_ranks(ctx, saved) or 1
    total = sum(e.nbytes for e in ctx.checkpoint.tensors())
    if ctx.checkpoint.metadata.get(RANK_METADATA_KEY):
        note = (
            f"saved without collectives: each of the {saved} rank(s) loads only what its own __{{rank}}.metadata "
            "describes, so only the same ranks with the same sharding load it"
        )
        if target == saved:
            return WorldSizeCheck(saved, target, True, note, bytes_per_rank=total // max(1, target))
        fix = shell("ckptctl", "convert", ctx.url, "NEW_DIR", "--to", "dcp") + comment(
            "writes its model weights with one global .metadata, which reshards"
        )
        return WorldSizeCheck(saved, target, False, note, fix=fix)
    return WorldSizeCheck(
        saved,
        target,
        True,
        f"torch DCP reshards at load: {target} rank(s) each read their part",
        bytes_per_rank=total // target,
    )


def overwrite_warnings(ctx: PlanContext) -> list[str]:
    """A DCP folder whose data files are newer than its `.metadata`: an in-place overwrite that did not
    finish left the OLD metadata over (partly) NEW data, and structural verify cannot tell."""
    checkpoint = ctx.checkpoint
    folders = sorted({os.path.dirname(f) for f in checkpoint.files if os.path.basename(f) == METADATA_NAME})
    found = []
    for folder in folders:
        url = io.join(checkpoint.url, folder) if folder else checkpoint.url
        try:
            entries = io.list_dir(url)
        except CkptctlError:
            continue
        newer = set(data_newer_than_metadata(entries))
        if newer:
            meta = next(e.mtime for e in entries if e.name == METADATA_NAME and not e.is_dir)
            gap = max(e.mtime for e in entries if e.name in newer) - meta
            where = f"{folder}/" if folder else ""
            found.append(
                f"{where}.metadata is older than its data files ({gap:.0f} s): the DCP folder was "
                "overwritten in place and the save did not finish, so the data may not match the metadata; "
                "`ckptctl verify --deep` reads every tensor back (file copies that did not keep mtimes also cause this)"
            )
    return found
