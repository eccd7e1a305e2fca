"""The native format's slimmer (`SLIMMER`): the entries a resume alone needs (optimizers, schedulers, RNG,
data loaders) are dropped with their files and the manifest is rewritten without them, so that the slim
checkpoint is a committed native checkpoint holding the model (and the other entries) with their digests."""

from __future__ import annotations

import functools
from dataclasses import replace

from ckptctl.checkpoint import Checkpoint, Problem
from ckptctl.contract.capabilities import SlimRecipe, SlimRewrite
from ckptctl.formats.manifest import MANIFEST_NAME, Manifest
from ckptctl.formats.native import read_native_manifest

__all__ = ["SLIMMER", "NativeSlimmer"]

#: Kinds of state entries (`ComponentRecord.kind`) that only a resume reads.
TRAINING_ONLY_KINDS = frozenset({"optimizer", "scheduler", "rng", "dataloader"})


class NativeSlimmer:
    """See the module docstring."""

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        manifest = read_native_manifest(checkpoint.url)
        if any(c.storage == "dcp" for c in manifest.components.values()):
            return (
                "a multi-rank native checkpoint holds every entry in one DCP folder: dropping entries needs its "
                "items rewritten, which slim cannot do safely yet"
            )
        if not any(c.kind in TRAINING_ONLY_KINDS for c in manifest.components.values()):
            return "it holds no training-only state"
        return None

    def recipe(self, checkpoint: Checkpoint) -> SlimRecipe:
        manifest = read_native_manifest(checkpoint.url)
        dropped = {name: c for name, c in manifest.components.items() if c.kind in TRAINING_ONLY_KINDS}
        kept_files = {f for name, c in manifest.components.items() if name not in dropped for f in c.files}
        # A file two entries share stays while a kept entry names it.
        drop = sorted({f for c in dropped.values() for f in c.files} - kept_files)
        slim = replace(
            manifest,
            components={name: c for name, c in manifest.components.items() if name not in dropped},
            files={rel: record for rel, record in manifest.files.items() if rel not in drop},
        )
        return SlimRecipe(
            drop=tuple(drop),
            dropped=tuple(sorted(dropped)),
            rewrites=(SlimRewrite(MANIFEST_NAME, functools.partial(_write, manifest=slim)),),
        )

    def expected(self, problem: Problem) -> bool:
        return False


def _write(path: str, *, manifest: Manifest) -> None:
    with open(path, "wb") as f:
        f.write(manifest.to_json())


SLIMMER = NativeSlimmer()
