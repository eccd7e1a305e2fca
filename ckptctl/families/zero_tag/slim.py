"""Slimming a ZeRO tag folder (`slim`), for every framework that saves ZeRO tags: the optimizer partitions
(`*_optim_states.pt`: fp32 masters, Adam moments) go, and the fp32 master weights that `convert` writes by
default (`master_weights`: what zero_to_fp32 reconstructs) are first written beside the model states as
`KEPT_MASTERS`, a safetensors file `checkpoint_master_weights` reads instead of the partitions, so that
`convert` of the slim tag writes the same bytes. The model-states files (module weights, counters,
the client state) stay."""

from __future__ import annotations

import functools
import json
import os

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, Problem, ProblemKind
from ckptctl.contract.capabilities import MasterWeights, OneLookSlimmer, SlimRecipe, SlimRewrite
from ckptctl.families.zero_tag.kept_masters import KEPT_MASTERS, NOTES_KEY, UPCAST_KEY
from ckptctl.families.zero_tag.master_weights import master_weights
from ckptctl.families.zero_tag.names import OPTIM_STATES
from ckptctl.families.zero_tag.tag import read_tag
from ckptctl.formats.chunks import read_tensor
from ckptctl.formats.safetensors import build_header, tensor_bytes

__all__ = ["TagSlimmer", "expected_tag_problem", "tag_slim"]


def tag_slim(checkpoint: Checkpoint, prefix: str = "") -> SlimRecipe | str:
    """The recipe that slims the ZeRO tag at `prefix` in `checkpoint` (`""`: the checkpoint is the tag), or
    why it cannot be slimmed safely."""
    tag = read_tag(io.join(checkpoint.url, prefix.rstrip("/")) if prefix else checkpoint.url)
    if not tag.files.optim or tag.optim_kind is None:
        return (
            f"ZeRO stage {tag.zero_stage} keeps the optimizer inside the model-states file: slim would have to "
            "rewrite that pickle, which it does not do yet"
        )
    if tag.mp_world_size > 1:
        return f"it holds {tag.mp_world_size} model-parallel ranks, whose master weights slim cannot assemble"
    masters = master_weights(tag, prefix)
    return SlimRecipe(
        drop=tuple(sorted(prefix + name for name in tag.files.optim.values())),
        dropped=("optimizer",),
        rewrites=(
            SlimRewrite(prefix + KEPT_MASTERS, functools.partial(_write_masters, checkpoint.url, masters=masters)),
        ),
    )


def _write_masters(checkpoint_url: str, path: str, *, masters: MasterWeights) -> None:
    """Write the master weights into the safetensors file `path`, one tensor at a time, as stored (the
    buffers `convert` upcasts are named in the metadata, with the notes about them)."""
    metadata = {
        "format": "pt",
        UPCAST_KEY: json.dumps(sorted(masters.upcast)),
        NOTES_KEY: json.dumps(list(masters.notes)),
    }
    header = build_header([(e.name, e.dtype, e.shape) for e in masters.entries], metadata)
    with open(path, "wb") as out:
        out.write(header)
        for entry in masters.entries:
            out.write(tensor_bytes(read_tensor(checkpoint_url, entry)))
        out.flush()
        os.fsync(out.fileno())


def expected_tag_problem(problem: Problem) -> bool:
    """Whether a problem of a slim tag is its missing optimizer partitions (the reader names them without
    their `bf16_` prefix once none is left to show it)."""
    return problem.kind == ProblemKind.MISSING_FILE and OPTIM_STATES.match(problem.path.rpartition("/")[2]) is not None


class TagSlimmer(OneLookSlimmer):
    """The `Slimmer` of a framework whose checkpoints are ZeRO tag folders (DeepSpeed, OpenRLHF, open-instruct)."""

    def decide(self, checkpoint: Checkpoint) -> SlimRecipe | str:
        return tag_slim(checkpoint)

    def expected(self, problem: Problem) -> bool:
        return expected_tag_problem(problem)
