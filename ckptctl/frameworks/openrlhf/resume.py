"""How OpenRLHF resumes (`--load_checkpoint`): the actor's and the critic's DeepSpeed tags, each from its
own `latest`, under one `--ckpt_path`.

With `--use_ds_universal_ckpt` (>= v0.10.2 `--ds.use_universal_ckpt`; OpenRLHF @ 3c3be623,
`utils/deepspeed/deepspeed_utils.py` sets `"checkpoint": {"load_universal": ...}`) both load the universal
checkpoint their own `latest_universal` names. OpenRLHF's `examples/scripts/ckpt_ds_zero_to_universal.sh
CKPT_PATH` converts the tag `latest` names in `_actor/` and `_critic/` into `{tag}_uni` and writes
`latest_universal`.
"""

from __future__ import annotations

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState
from ckptctl.errors import CkptctlError
from ckptctl.frameworks.deepspeed import resume as deepspeed
from ckptctl.frameworks.deepspeed.names import UNIVERSAL_LATEST_NAME, read_latest
from ckptctl.layouts.resume import PlanContext, ResumeProfile

__all__ = ["PROFILE"]

_UNIVERSAL_FLAG = "--use_ds_universal_ckpt"
_UNIVERSAL_FLAG_NEW = "--ds.use_universal_ckpt"


def _run(url: str) -> str:
    parent = io.parent_of(url)
    return io.parent_of(parent) if io.name_of(parent) in ("_actor", "_critic") else parent


def _critic(ref: CheckpointRef) -> bool:
    return io.name_of(io.parent_of(ref.url)) == "_critic"


def _notes(ctx: PlanContext) -> list[str]:
    """The critic loads from `_critic/latest` along with the actor: say when the two are out of step."""
    critic = next((r for r in ctx.refs if _critic(r) and r.latest), None)
    if critic is None:
        return []
    if critic.state is not CheckpointState.COMPLETE:
        return [f"the critic's `latest` names {io.name_of(critic.url)}, which is {critic.state.value}: its load fails"]
    if critic.step != ctx.checkpoint.ref.step:
        return [
            f"the critic resumes from {io.name_of(critic.url)} (step {critic.step}) and the actor from "
            f"{io.name_of(ctx.url)} (step {ctx.checkpoint.ref.step}): they are out of step"
        ]
    return []


def _hint(ctx: PlanContext) -> str:
    ckpt_path = _run(ctx.url)
    actor = io.name_of(io.parent_of(ctx.url)) == "_actor"
    if deepspeed.is_universal(ctx.checkpoint):
        pointer = f"_actor/{UNIVERSAL_LATEST_NAME}" if actor else UNIVERSAL_LATEST_NAME
        return (
            f"--load_checkpoint --ckpt_path {ckpt_path} {_UNIVERSAL_FLAG} (OpenRLHF >= 0.10.2: --ckpt.load_enable "
            f"--ckpt.path {ckpt_path} {_UNIVERSAL_FLAG_NEW})" + deepspeed.universal_pointer_caveat(ctx, pointer)
        )
    pointer = "_actor/latest" if actor else "latest"
    return (
        f"--load_checkpoint --ckpt_path {ckpt_path} (OpenRLHF >= 0.10.2: --ckpt.load_enable --ckpt.path {ckpt_path})"
        + deepspeed.pointer_caveat(ctx, pointer)
    )


def _universal_fix(ctx: PlanContext, tag_url: str, conversion: deepspeed.Conversion | None) -> str:
    """OpenRLHF's script converts the tags `latest` names, the actor's and the critic's, then a flag loads them."""
    flags = f"add {_UNIVERSAL_FLAG} (OpenRLHF >= 0.10.2: {_UNIVERSAL_FLAG_NEW})"
    if conversion is not None and not conversion.problem:
        return f"load {io.name_of(conversion.url)}, its universal conversion: {flags}"
    fix = (
        f"bash examples/scripts/ckpt_ds_zero_to_universal.sh {_run(tag_url)} (OpenRLHF's script: ds_to_universal on "
        f"the tag `latest` names in _actor/ and _critic/, into <tag>_uni, writing {UNIVERSAL_LATEST_NAME}); then {flags}"
    )
    if conversion is not None:
        return f"delete {io.name_of(conversion.url)} ({conversion.problem}); {fix}"
    return fix


def _critic_universal(ctx: PlanContext) -> list[str]:
    """With the universal flag the critic loads what `_critic/latest_universal` names, too."""
    critic = io.join(_run(ctx.url), "_critic")
    if not deepspeed.is_universal(ctx.checkpoint) or not io.is_dir(critic):
        return []
    try:
        entries = io.list_dir(critic)
    except CkptctlError:
        return []
    named = read_latest(critic, entries, UNIVERSAL_LATEST_NAME)
    if named is not None and any(e.name == named and e.is_dir for e in entries):
        return []
    what = "there is none" if named is None else f"it names {named}, which does not exist"
    return [
        f"{_UNIVERSAL_FLAG} makes the critic load what _critic/{UNIVERSAL_LATEST_NAME} names too, and {what}: its load "
        "fails; convert the critic's tag as well (OpenRLHF's script does both)"
    ]


def _all_notes(ctx: PlanContext) -> list[str]:
    return [*_notes(ctx), *_critic_universal(ctx)]


PROFILE = ResumeProfile(
    framework="OpenRLHF",
    hint=_hint,
    world_size=deepspeed.zero_world_size(_universal_fix),
    run_of=_run,
    companion=_critic,
    notes=_all_notes,
    impacts=deepspeed.IMPACTS,
    follows_pointer=True,
)
