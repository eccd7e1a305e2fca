"""How open-instruct resumes (`--checkpoint_state_dir`): the DeepSpeed tag `latest` names, after a
start-up that deletes the tags it deems incomplete.

With `--deepspeed_checkpoint_load_universal` (open-instruct @ e6c3044a, `grpo_utils.py`, which sets
`"checkpoint": {"load_universal": ...}` in `grpo_fast.py`) its start-up
(`utils.ensure_universal_checkpoint_exists`) loads `ds_universal_{tag}` for the tag `latest` names: it
points `latest_universal` at that folder when it exists, whatever it holds, and otherwise runs
`python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state` on the tag to make it.
"""

from __future__ import annotations

from ckptctl import io
from ckptctl.contract.resume import PlanContext, ResumeProfile
from ckptctl.errors import CkptctlError
from ckptctl.families.zero_tag import resume as zero_resume
from ckptctl.families.zero_tag.names import read_latest
from ckptctl.quoting import comment, shell

__all__ = ["PROFILE"]

#: Loads a DeepSpeed universal checkpoint of the tag `latest` names, converting the tag first when needed.
_UNIVERSAL_FLAG = "--deepspeed_checkpoint_load_universal"


def _universal_folder(tag: str) -> str:
    """The folder open-instruct loads (and converts `tag` into) with `_UNIVERSAL_FLAG`."""
    return f"ds_universal_{tag}"


def _hint(ctx: PlanContext) -> str:
    save_dir = io.parent_of(ctx.url)
    if not zero_resume.is_universal(ctx.checkpoint):
        return shell("--checkpoint_state_dir", save_dir) + comment(zero_resume.pointer_caveat(ctx, "latest"))
    name = io.name_of(ctx.url)
    latest = _latest(save_dir)
    setting = shell("--checkpoint_state_dir", save_dir, _UNIVERSAL_FLAG)
    if latest is not None and _universal_folder(latest) == name:
        return setting
    return setting + comment(
        f"it loads {_universal_folder(latest or '<tag>')} for the tag `latest` names{f' ({latest})' if latest else ''}, "
        f"converting that tag when the folder is missing: {name} is not that folder"
    )


def _latest(save_dir: str) -> str | None:
    try:
        return read_latest(save_dir, io.list_dir(save_dir))
    except CkptctlError:
        return None


def _universal_fix(ctx: PlanContext, tag_url: str, conversion: zero_resume.Conversion | None) -> str:
    """open-instruct converts the tag `latest` names itself, at start-up, when asked to load universal
    checkpoints; an existing `ds_universal_{tag}` is loaded as it is."""
    save_dir, tag = io.parent_of(tag_url), io.name_of(tag_url)
    folder = _universal_folder(tag)
    setting = shell("--checkpoint_state_dir", save_dir, _UNIVERSAL_FLAG)
    if conversion is not None and not conversion.problem:
        return setting + comment(f"loads {io.name_of(conversion.url)}, its universal conversion")
    stale = conversion is not None and io.name_of(conversion.url) == folder
    return setting + comment(
        f"first delete {folder} ({conversion.problem}): open-instruct loads an existing {folder} as it is"
        if stale and conversion is not None
        else "",
        "" if _latest(save_dir) == tag else f"first write {tag} into latest",
        f"at start-up open-instruct converts the tag `latest` names into {folder} (ds_to_universal) and loads it",
    )


def _notes(ctx: PlanContext) -> list[str]:
    """Its start-up deletes every `global_step*` folder with fewer entries than the fullest one."""
    save_dir = io.parent_of(ctx.url)
    try:
        tags = [e.name for e in io.list_dir(save_dir) if e.is_dir and e.name.startswith("global_step")]
        counts = {name: len(io.list_dir(io.join(save_dir, name))) for name in tags}
    except CkptctlError:
        return []
    if not counts:
        return []
    fullest = max(counts.values())
    doomed = sorted(name for name, count in counts.items() if count < fullest)
    if not doomed:
        return []
    chosen = io.name_of(ctx.url)
    what = f"{', '.join(doomed)}" + (
        f" (including {chosen}, the one this plan resumes from)" if chosen in doomed else ""
    )
    return [
        f"open-instruct's start-up deletes every global_step* folder with fewer entries than the fullest "
        f"({fullest}) and rewrites `latest`: it would delete {what}; copy them elsewhere first if you need them"
    ]


PROFILE = ResumeProfile(
    framework="open-instruct",
    hint=_hint,
    world_size=zero_resume.zero_world_size(_universal_fix),
    notes=_notes,
    impacts=zero_resume.IMPACTS,
    follows_pointer=True,
    export_name="an HF snapshot",
)
