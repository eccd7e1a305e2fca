"""The resume rules of a ZeRO tag, which every framework that saves one shares: `engine.load_checkpoint`
follows `latest`, and ZeRO 1-3 load only on the data-parallel size they were saved with (else a universal
checkpoint first). A universal checkpoint loads on any data-parallel size with
`"checkpoint": {"load_universal": true}`, which makes `load_checkpoint` follow `latest_universal` instead.

The frameworks built on DeepSpeed (DeepSpeed itself, OpenRLHF, open-instruct, the Trainer, accelerate and
Lightning with DeepSpeed) use `world_size` (or `zero_world_size` with their own way to convert), `IMPACTS`,
`pointer_caveat` and `is_universal` in their own profiles.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Component
from ckptctl.contract.resume import PlanContext, WorldSizeCheck, target_ranks
from ckptctl.errors import CkptctlError
from ckptctl.families.zero_tag.names import (
    MODEL_STATES,
    OPTIM_STATES,
    UNIVERSAL_LATEST_NAME,
    UNIVERSAL_LAYOUT,
    read_latest,
)
from ckptctl.quoting import comment, shell

__all__ = [
    "IMPACTS",
    "LOAD_UNIVERSAL",
    "Conversion",
    "is_universal",
    "pointer_caveat",
    "universal_conversion",
    "universal_pointer_caveat",
    "world_size",
    "zero_facts",
    "zero_world_size",
]

#: The DeepSpeed config that makes `load_checkpoint` load universal checkpoints (and follow `latest_universal`).
LOAD_UNIVERSAL = '"checkpoint": {"load_universal": true}'


def zero_facts(checkpoint: Checkpoint) -> Mapping[str, Any]:
    """The tag's facts (`tag`, `zero_stage`, `dp_world_size`, ...) as the layouts record them: at the top of
    a tag's metadata, under `deepspeed` in a Trainer checkpoint's; empty when it holds no DeepSpeed tag."""
    metadata = checkpoint.metadata
    if "zero_stage" in metadata:
        return metadata
    inner = metadata.get("deepspeed")
    return inner if isinstance(inner, Mapping) else {}


def _tag_url(checkpoint: Checkpoint) -> str:
    """The DeepSpeed tag folder: the checkpoint itself, or the one inside a Trainer checkpoint."""
    tag = zero_facts(checkpoint).get("tag")
    if isinstance(tag, str) and tag != io.name_of(checkpoint.url) and io.is_dir(io.join(checkpoint.url, tag)):
        return io.join(checkpoint.url, tag)
    return checkpoint.url


@dataclass(frozen=True, slots=True)
class Conversion:
    """A universal checkpoint converted from a ZeRO tag, among the run's checkpoints.

    Attributes:
        url: its folder.
        problem: why it cannot be loaded ("" when it can).
    """

    url: str
    problem: str


def is_universal(checkpoint: Checkpoint) -> bool:
    """Whether the checkpoint is a DeepSpeed universal checkpoint (which its framework loads with its
    universal setting)."""
    return checkpoint.layout == UNIVERSAL_LAYOUT


def _conversion_refs(ctx: PlanContext) -> list[CheckpointRef]:
    """The universal checkpoints of the run converted from the chosen tag."""
    tag_url = _tag_url(ctx.checkpoint)
    return [
        ref
        for ref in ctx.refs
        if ref.layout == UNIVERSAL_LAYOUT
        and ctx.layout_of(ref.layout).resume_profile().converted_from(ref.url) == tag_url
    ]


def universal_conversion(ctx: PlanContext) -> Conversion | None:
    """The universal conversion of the chosen tag beside it, verified (one that loads first), or None."""
    found = [Conversion(ref.url, _why_unusable(ctx, ref)) for ref in _conversion_refs(ctx)]
    return next((c for c in found if not c.problem), found[0] if found else None)


def _why_unusable(ctx: PlanContext, ref: CheckpointRef) -> str:
    if ref.state is not CheckpointState.COMPLETE:
        return f"{ref.state.value}: {ref.note}"
    layout = ctx.layout_of(ref.layout)
    try:
        problems = [p for p in layout.verify(layout.open(ref.url)) if p.severity == "error"]
    except CkptctlError as exc:
        return exc.message
    errors = [p for p in problems if not p.path.startswith("../")]
    if not errors:
        return ""
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"fails verify: {errors[0].path}: {errors[0].message}{more}"


#: How a framework converts the chosen tag for another data-parallel size: (the plan, the tag folder, its
#: universal conversion beside it if any) -> what to do, for `WorldSizeCheck.fix`.
ConversionFix = Callable[[PlanContext, str, Conversion | None], str]


def zero_world_size(fix: ConversionFix) -> Callable[[PlanContext], WorldSizeCheck]:
    """The world-size rule of ZeRO tags (`world_size`), with `fix` saying what to do when the target
    data-parallel size differs from the saved one."""

    def check(ctx: PlanContext) -> WorldSizeCheck:
        info = zero_facts(ctx.checkpoint)
        stage, dp, mp = info.get("zero_stage"), info.get("dp_world_size"), info.get("mp_world_size") or 1
        saved = dp * mp if isinstance(dp, int) and isinstance(mp, int) else ctx.checkpoint.world_size
        target = target_ranks(ctx, saved)
        files = ctx.checkpoint.files
        model = [s for n, s in files.items() if MODEL_STATES.match(n.rpartition("/")[2])]
        optim = [s for n, s in files.items() if OPTIM_STATES.match(n.rpartition("/")[2])]
        per_rank = (sum(model) // len(model) if model else 0) + (sum(optim) // len(optim) if optim else 0)
        if target is None or saved is None or not isinstance(stage, int):
            return WorldSizeCheck(saved, target, None, "the DeepSpeed data-parallel size is not recorded")
        if stage == 0:
            ok = target % mp == 0
            note = f"without ZeRO the optimizer state is whole in the model-states file: any multiple of the model-parallel size ({mp}) loads it"
            return WorldSizeCheck(saved, target, ok, note, bytes_per_rank=per_rank if ok else None)
        if target == saved:
            note = f"the same data-parallel size ({dp}) as saved: each rank reads its own rank files"
            converted = [r for r in _conversion_refs(ctx) if r.state is CheckpointState.COMPLETE]
            if converted:
                note += (
                    f"; {io.name_of(converted[0].url)}, its universal conversion, loads on other data-parallel sizes "
                    f"({LOAD_UNIVERSAL})"
                )
            return WorldSizeCheck(saved, target, True, note, bytes_per_rank=per_rank)
        note = (
            f"ZeRO-{stage} partitions the optimizer state over {dp} data-parallel rank(s) and cannot load on {target} "
            "(DeepSpeed#2898): convert it to a universal checkpoint first"
        )
        return WorldSizeCheck(
            saved, target, False, note, fix=fix(ctx, _tag_url(ctx.checkpoint), universal_conversion(ctx))
        )

    return check


def _convert_command(tag_url: str, output: str) -> str:
    """DeepSpeed's own conversion of a tag into a universal checkpoint (which writes `latest_universal`).

    A plain engine's tags record no `universal_checkpoint_info` (only Megatron-DeepSpeed's models set it), and
    ds_to_universal refuses them unless `--inject_missing_state` adds an empty one, as open-instruct and
    OpenRLHF's script pass it.
    """
    return shell(
        "python",
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        tag_url,
        "--output_folder",
        output,
        "--inject_missing_state",
    )


def _deepspeed_fix(ctx: PlanContext, tag_url: str, conversion: Conversion | None) -> str:
    if conversion is not None and not conversion.problem:
        return f"load {io.name_of(conversion.url)}, its universal conversion, with {LOAD_UNIVERSAL} in the DeepSpeed config"
    universal = f"{tag_url.rstrip('/')}_universal"
    first = (
        ""
        if conversion is None
        else f"first delete {io.name_of(conversion.url)}, its universal conversion, which cannot be loaded "
        f"({conversion.problem})"
    )
    then = (
        f"then set {LOAD_UNIVERSAL} in the DeepSpeed config (load_checkpoint then follows "
        f"{io.join(io.parent_of(universal), 'latest_universal')})"
    )
    # ckptctl writes the same files without DeepSpeed installed, into a folder of their own (DST must be empty,
    # so not beside the tag the way ds_to_universal writes them): offered second, since a wrapper's resume (the
    # HF Trainer's resume_from_checkpoint) looks for latest_universal in the folder it already loads.
    without = (
        "or, without DeepSpeed and the same files: "
        + shell("ckptctl", "reshard", tag_url, "NEW_DIR", "--to", "deepspeed-universal")
        + ", then load_checkpoint(NEW_DIR)"
    )
    return _convert_command(tag_url, universal) + comment(first, then, without)


#: Without ZeRO any multiple of the model-parallel size loads the tag; with ZeRO only the saved data-parallel
#: size does, unless the tag is converted to a universal checkpoint first (or already was: that one loads).
world_size = zero_world_size(_deepspeed_fix)


IMPACTS: Mapping[Component, str] = {
    Component.RNG: "DeepSpeed saves no RNG state: dropout and sampling draw other numbers than an uninterrupted "
    "run (save them in client_state to keep them)",
    Component.DATALOADER: "no data sampler state (DeepSpeed saves one only for its own data loader): the data "
    "order restarts unless the training code skips consumed samples",
}


def pointer_caveat(ctx: PlanContext, pointer: str) -> str:
    """What to do first when the framework follows `latest` and it names another tag than the chosen one (a
    remark for `quoting.comment`; "" when nothing is needed)."""
    named = next((r for r in ctx.refs if r.latest and io.parent_of(r.url) == io.parent_of(ctx.url)), None)
    if named is not None and named.url == ctx.url:
        return ""
    return f"it loads the tag `{pointer}` names: write {io.name_of(ctx.url)} into {pointer} first"


def universal_pointer_caveat(ctx: PlanContext, pointer: str) -> str:
    """What to do first when a framework that follows `latest_universal` would load another folder than
    the chosen universal checkpoint (`pointer`: how the hint names that file); a remark for `quoting.comment`."""
    save_dir = io.parent_of(ctx.url)
    try:
        named = read_latest(save_dir, io.list_dir(save_dir), UNIVERSAL_LATEST_NAME)
    except CkptctlError:
        named = None
    if named == io.name_of(ctx.url):
        return ""
    return f"it loads the folder `{pointer}` names: write {io.name_of(ctx.url)} into {pointer} first"
