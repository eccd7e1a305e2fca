"""AReaL's slimmer (`SLIMMER`): the recover slot's optimizer items dropped, its model items kept.

The slot is one DCP save of `{"dcp": DCPState(model, optimizer)}` (areal 1.0.4 `engine/fsdp_engine.py`
`FSDPEngine._save_to_dcp`; `engine/fsdp_utils/checkpoint.py` `DCPState.state_dict` gives `{"model": ...,
"optim": ...}`), so every key starts with `dcp.`: `dcp.model.<fqn>` is the model, `dcp.optim.*` the
optimizer, dropped as `families.dcp_slim` drops a plain DCP save's. AReaL's Megatron slot
(dist-checkpointing, `metadata.json` + `common.pt`) names its items as Megatron does (`optimizer.*`).

AReaL tells a finished save by file times (`frameworks.areal.files.torn_info_files`: `recover_info/` newer than
the slot's `.metadata`, the data files older than it): the rewritten files keep the times of the files they
replace, so that the slim slot is read as the same finished save.

A slot is what `recover.mode=on` loads, so `slim` keeps it whole while it is one (`ops.slim`'s resume rule):
this slims the slot of a trial no resume will read (`slim_checkpoint` on it, or a copy kept as an archive).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, Problem
from ckptctl.contract.capabilities import SlimRecipe, SlimRewrite
from ckptctl.errors import CkptctlError
from ckptctl.families.dcp_slim import slim_dcp_folder, training_only

__all__ = ["SLIMMER", "ArealSlimmer"]

_WRAPPER = "dcp."


def areal_training_only(key: str) -> str | None:
    """What an item of the slot holds when it is training-only state (`dcp.optim.*`: `optimizer`), else None."""
    return training_only(key.removeprefix(_WRAPPER))


class ArealSlimmer:
    """See the module docstring."""

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        if checkpoint.metadata.get("kind") != "recover":
            return "an HF export holds the model only"
        found = slim_dcp_folder(checkpoint.url, checkpoint.files, areal_training_only)
        return found if isinstance(found, str) else None

    def recipe(self, checkpoint: Checkpoint) -> SlimRecipe:
        found = slim_dcp_folder(checkpoint.url, checkpoint.files, areal_training_only)
        if isinstance(found, str):
            raise CkptctlError(f"{checkpoint.url} cannot be slimmed: {found}")
        source = io.local_path(checkpoint.url)
        rewrites = tuple(
            SlimRewrite(r.path, _keeping_times(r.write, os.path.join(source, *r.path.split("/"))))
            for r in found.rewrites
        )
        return SlimRecipe(found.drop, found.dropped, rewrites, found.shed_bytes)

    def expected(self, problem: Problem) -> bool:
        return False


def _keeping_times(write: Callable[[str], None], original: str) -> Callable[[str], None]:
    """`write`, then the written file given the access and modification times of the file it replaces."""

    def written(target: str) -> None:
        write(target)
        st = os.stat(original)
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))

    return written


SLIMMER = ArealSlimmer()
