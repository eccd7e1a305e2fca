"""Which framework resumes from a DeepSpeed universal checkpoint: the one that wrote the tag it was converted
from (`source_of`, `host_layout`), and that framework's resume profile with the world-size rule of universal
checkpoints (`UNIVERSAL_PROFILE`).

A module of its own because both the universal reader (`universal`: a conversion's step is its tag's) and
`convert` (the config lies where the tag's framework keeps it) ask it, and the profile names the tags' own
layout (`layout`) while that layout does not name universal checkpoints: so nothing here loops back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef
from ckptctl.contract.resume import PlanContext, ResumeProfile, WorldSizeCheck, target_ranks
from ckptctl.errors import CkptctlError
from ckptctl.families.zero_tag.names import MODEL_STATES, UNIVERSAL_LAYOUT, read_latest, tag_files
from ckptctl.families.zero_tag.resume import IMPACTS, LOAD_UNIVERSAL, zero_facts
from ckptctl.frameworks.deepspeed.layout import DeepSpeedLayout
from ckptctl.frameworks.deepspeed.universal_states import OPTIMIZER_STATE, ZERO_DIR
from ckptctl.io import DirEntry
from ckptctl.layouts import detect, get_layout, peek, peek_dir

__all__ = ["UNIVERSAL_PROFILE", "Source", "conversion_source", "host_layout", "source_of"]


@dataclass(frozen=True, slots=True)
class Source:
    """The tag a universal checkpoint was converted from, as its own layout identifies it.

    Attributes:
        url: the tag folder.
        layout: the layout that identified it (whose framework resumes from the conversion).
        ref: its ref (its step as that framework counts).
    """

    url: str
    layout: str
    ref: CheckpointRef


def _name_contains(name: str, part: str) -> bool:
    """Whether `part` occurs in `name` between non-alphanumeric characters (`global_step4` in
    `ds_universal_global_step4` and in `global_step4_universal`, not in `global_step40_universal`)."""
    start = name.find(part)
    while start >= 0:
        before, after = name[start - 1 : start], name[start + len(part) : start + len(part) + 1]
        if not before.isalnum() and not after.isalnum():
            return True
        start = name.find(part, start + 1)
    return False


def conversion_source(url: str, entries: Sequence[DirEntry]) -> Source | None:
    """The tag beside the universal checkpoint at `url` that it was converted from: a folder whose name its
    own contains (the longest such) holding optim-states files and the same model-states files, of the same
    sizes (ds_to_universal copies them). Reads the listings of the folders around it (once per scan)."""
    files = tag_files(entries)
    if files is None:
        return None
    name, parent = io.name_of(url), io.parent_of(url)
    own = {file: files.sizes[file] for file in files.model.values()}
    siblings = [e.name for e in peek_dir(parent) or [] if e.is_dir and e.name != name and _name_contains(name, e.name)]
    for sibling in sorted(siblings, key=len, reverse=True):
        tag_url = io.join(parent, sibling)
        theirs = tag_files(peek_dir(tag_url) or [])
        if theirs is None or not theirs.optim or any(theirs.sizes.get(f) != size for f, size in own.items()):
            continue
        try:
            layout, ref = detect(tag_url, explain=False)
        except CkptctlError:
            continue
        return Source(tag_url, layout.name, ref)
    return None


def source_of(url: str) -> Source | None:
    """`conversion_source` of the folder at `url` (listed once per scan context)."""
    return peek(url, conversion_source)


def host_layout(url: str) -> str:
    """The layout whose framework resumes from the universal checkpoint at `url`: that of the tag it was
    converted from, else of the ZeRO tag its save folder's `latest` names, else of another ZeRO tag beside
    it; `deepspeed` when the folder holds none."""
    source = source_of(url)
    if source is not None:
        return source.layout
    return peek(io.parent_of(url), _tags_layout) or DeepSpeedLayout.name


def _tags_layout(save_dir: str, entries: Sequence[DirEntry]) -> str | None:
    named = read_latest(save_dir, entries)
    for name in [*([named] if named else []), *sorted(e.name for e in entries if e.is_dir)]:
        url = io.join(save_dir, name)
        files = tag_files(peek_dir(url) or [])
        if files is None or not files.optim:
            continue
        try:
            layout, _ = detect(url, explain=False)
        except CkptctlError:
            continue
        if layout.name != UNIVERSAL_LAYOUT:
            return layout.name
    return None


def universal_world_size(ctx: PlanContext) -> WorldSizeCheck:
    """A universal checkpoint loads on any number of data-parallel ranks: each reads the rank-0 model states
    and its share of the parameters' states (under ZeRO-3 every parameter's files whole, then keeps its
    partition)."""
    info = zero_facts(ctx.checkpoint)
    stage, dp, mp = info.get("zero_stage"), info.get("dp_world_size"), info.get("mp_world_size") or 1
    saved = dp * mp if isinstance(dp, int) and isinstance(mp, int) else ctx.checkpoint.world_size
    target = target_ranks(ctx, saved)
    files = ctx.checkpoint.files
    model = [size for name, size in files.items() if "/" not in name and MODEL_STATES.match(name)]
    states = sum(size for name, size in files.items() if name.startswith(f"{ZERO_DIR}/") and name != OPTIMIZER_STATE)
    share = states if stage == 3 or not target else -(-states // target)
    per_rank = max(model, default=0) + files.get(OPTIMIZER_STATE, 0) + share
    if mp > 1:
        note = (
            f"saved with {mp} model-parallel ranks: a universal checkpoint reshapes data parallelism; other tensor or "
            "pipeline sizes load only where the model states record how to split each parameter "
            "(universal_checkpoint_info)"
        )
        return WorldSizeCheck(saved, target, None, note, bytes_per_rank=per_rank)
    note = f"a universal checkpoint loads on any number of data-parallel ranks ({LOAD_UNIVERSAL}; saved on {dp})"
    return WorldSizeCheck(saved, target, True, note, bytes_per_rank=per_rank)


def _host(url: str) -> ResumeProfile:
    """The profile of the framework that resumes from the universal checkpoint at `url`."""
    return get_layout(host_layout(url)).resume_profile()


def _universal_hint(ctx: PlanContext) -> str:
    return _host(ctx.url).hint(ctx)


def _universal_run(url: str) -> str:
    return _host(url).run_of(url)


def _universal_companion(ref: CheckpointRef) -> bool:
    return _host(ref.url).companion(ref)


def _universal_traps(ctx: PlanContext) -> list[str]:
    return _host(ctx.url).traps(ctx)


def _universal_notes(ctx: PlanContext) -> list[str]:
    return _host(ctx.url).notes(ctx)


def _converted_from(url: str) -> str | None:
    source = source_of(url)
    return None if source is None else source.url


UNIVERSAL_PROFILE = ResumeProfile(
    framework="DeepSpeed (universal checkpoint)",
    hint=_universal_hint,
    world_size=universal_world_size,
    impacts=IMPACTS,
    run_of=_universal_run,
    companion=_universal_companion,
    traps=_universal_traps,
    notes=_universal_notes,
    converted_from=_converted_from,
)
