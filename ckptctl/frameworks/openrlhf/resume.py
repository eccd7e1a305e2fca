"""How OpenRLHF resumes (`--load_checkpoint`): the actor's and the critic's DeepSpeed tags, each from its
own `latest`, under one `--ckpt_path`.

With `--ckpt.load_enable`, `PolicyModelActor.init_model_from_pretrained` loads `{ckpt.path}/_actor` and
`CriticModelActor.init_model_from_pretrained` loads `{ckpt.path}/_critic` (`trainer/ray/ppo_actor.py`,
`ppo_critic.py`, openrlhf 0.11.2), each through `engine.load_checkpoint(save_dir)`, which follows that
folder's `latest`. A plan for one of them therefore also verifies the tag the other's `latest` names.

With `--use_ds_universal_ckpt` (>= v0.10.2 `--ds.use_universal_ckpt`; OpenRLHF @ 3c3be623,
`utils/deepspeed/deepspeed_utils.py` sets `"checkpoint": {"load_universal": ...}`) both load the universal
checkpoint their own `latest_universal` names. OpenRLHF's `examples/scripts/ckpt_ds_zero_to_universal.sh
CKPT_PATH` converts the tag `latest` names in `_actor/` and `_critic/` into `{tag}_uni` and writes
`latest_universal`.
"""

from __future__ import annotations

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState
from ckptctl.contract.resume import LoadedAlong, PlanContext, ResumeProfile
from ckptctl.errors import CkptctlError
from ckptctl.families.zero_tag import resume as zero_resume
from ckptctl.families.zero_tag.names import LATEST_NAME, UNIVERSAL_LATEST_NAME, read_latest
from ckptctl.layouts import detect, peek_dir, scan_run
from ckptctl.quoting import comment, shell

__all__ = ["PROFILE"]

_OTHER_ROLE = {"_actor": "_critic", "_critic": "_actor"}
_ROLE_NAME = {"_actor": "actor", "_critic": "critic"}
_UNIVERSAL_FLAG = "--use_ds_universal_ckpt"
_UNIVERSAL_FLAG_NEW = "--ds.use_universal_ckpt"


def _run(url: str) -> str:
    parent = io.parent_of(url)
    return io.parent_of(parent) if io.name_of(parent) in _OTHER_ROLE else parent


def _critic(ref: CheckpointRef) -> bool:
    return io.name_of(io.parent_of(ref.url)) == "_critic"


def _role_dir(ctx: PlanContext) -> str | None:
    """`_actor` or `_critic` when the chosen tag lies in one of PPO's save folders."""
    role = io.name_of(io.parent_of(ctx.url))
    return role if role in _OTHER_ROLE else None


def _loaded_with(ctx: PlanContext) -> list[LoadedAlong]:
    """The tag the other save folder's `latest` names (the critic's for an actor tag, and the reverse):
    `--load_checkpoint` loads it too. None when the run trains no critic (no `_critic` folder)."""
    role = _role_dir(ctx)
    if role is None:
        return []
    other = io.join(_run(ctx.url), _OTHER_ROLE[role])
    entries = peek_dir(other)
    if entries is None:
        return []
    tag = read_latest(other, entries)
    if tag is None:
        return []
    pointer = f"{_OTHER_ROLE[role]}/{LATEST_NAME}"
    url = io.join(other, tag)
    return [LoadedAlong(url, f"the {_ROLE_NAME[_OTHER_ROLE[role]]}'s `latest` tag", _fix(ctx, other, pointer, url))]


def _complete_tags(save_dir: str) -> dict[str, CheckpointRef]:
    """The complete tags of a save folder, by name."""
    try:
        refs = scan_run(save_dir, max_depth=1)
    except CkptctlError:
        return {}
    return {
        io.name_of(r.url): r
        for r in refs
        if r.url != save_dir and r.state is CheckpointState.COMPLETE and r.step is not None
    }


def _created(ref: CheckpointRef) -> float:
    return ref.created.timestamp() if ref.created is not None else 0.0


def _fix(ctx: PlanContext, save_dir: str, pointer: str, failing: str) -> str:
    """What to write into the `latest` files when the other role's tag (`failing`) does not load: the other
    role's complete tag of the chosen step, else the newest tag both roles saved whole (both resume there)."""
    step = ctx.checkpoint.ref.step
    others = {name: ref for name, ref in _complete_tags(save_dir).items() if ref.url != failing}
    same = [r for r in others.values() if r.step == step]
    if same:
        pick = max(same, key=_created)
        return f"write {io.name_of(pick.url)} into {pointer}"
    own_dir = io.parent_of(ctx.url)
    own = _complete_tags(own_dir)
    both = [name for name in own.keys() & others.keys() if step is None or (own[name].step or 0) < step]
    if not both:
        return f"{io.name_of(save_dir)} holds no complete tag to resume from with {io.name_of(ctx.url)}"
    name = max(both, key=lambda n: (own[n].step or 0, _created(own[n])))
    return (
        f"write {name} into {pointer} and into {io.name_of(own_dir)}/{LATEST_NAME} (both resume from step "
        f"{own[name].step}, the newest both saved whole)"
    )


def _notes(ctx: PlanContext) -> list[str]:
    """The other role loads from its own `latest` along with the chosen tag: say when the two are out of
    step, or when the critic has tags but no `latest` (DeepSpeed then finds nothing to load and OpenRLHF
    trains the critic from its initial weights). A tag that does not load is a blocker, not a note."""
    role = _role_dir(ctx)
    if role is None:
        return []
    other_role = _ROLE_NAME[_OTHER_ROLE[role]]
    ref = next((r for r in ctx.refs if r.latest and io.name_of(io.parent_of(r.url)) == _OTHER_ROLE[role]), None)
    if ref is None:
        along = _loaded_with(ctx)
        if not along:
            other = peek_dir(io.join(_run(ctx.url), _OTHER_ROLE[role])) or []
            if role == "_actor" and any(e.is_dir for e in other):
                return [
                    "the critic's save folder has tags but no readable `latest`: --load_checkpoint finds no "
                    "critic checkpoint and trains the critic from its initial weights"
                ]
            return []
        try:
            _, ref = detect(along[0].url, explain=False)
        except CkptctlError:
            return []  # a blocker says why
    if ref.state is CheckpointState.COMPLETE and ref.step != ctx.checkpoint.ref.step:
        own_role = _ROLE_NAME[role]
        return [
            f"the {other_role} resumes from {io.name_of(ref.url)} (step {ref.step}) and the {own_role} from "
            f"{io.name_of(ctx.url)} (step {ctx.checkpoint.ref.step}): they are out of step"
        ]
    return []


def _hint(ctx: PlanContext) -> str:
    ckpt_path = _run(ctx.url)
    role = _role_dir(ctx)
    if zero_resume.is_universal(ctx.checkpoint):
        pointer = f"{role}/{UNIVERSAL_LATEST_NAME}" if role is not None else UNIVERSAL_LATEST_NAME
        return shell("--load_checkpoint", "--ckpt_path", ckpt_path, _UNIVERSAL_FLAG) + comment(
            f"OpenRLHF >= 0.10.2: {shell('--ckpt.load_enable', '--ckpt.path', ckpt_path, _UNIVERSAL_FLAG_NEW)}",
            zero_resume.universal_pointer_caveat(ctx, pointer),
        )
    pointer = f"{role}/{LATEST_NAME}" if role is not None else LATEST_NAME
    return shell("--load_checkpoint", "--ckpt_path", ckpt_path) + comment(
        f"OpenRLHF >= 0.10.2: {shell('--ckpt.load_enable', '--ckpt.path', ckpt_path)}",
        zero_resume.pointer_caveat(ctx, pointer),
    )


def _universal_fix(ctx: PlanContext, tag_url: str, conversion: zero_resume.Conversion | None) -> str:
    """OpenRLHF's script converts the tags `latest` names, the actor's and the critic's, then a flag loads them."""
    flags = f"add {_UNIVERSAL_FLAG} (OpenRLHF >= 0.10.2: {_UNIVERSAL_FLAG_NEW})"
    if conversion is not None and not conversion.problem:
        return f"load {io.name_of(conversion.url)}, its universal conversion: {flags}"
    return shell("bash", "examples/scripts/ckpt_ds_zero_to_universal.sh", _run(tag_url)) + comment(
        "" if conversion is None else f"first delete {io.name_of(conversion.url)} ({conversion.problem})",
        f"OpenRLHF's script: ds_to_universal on the tag `latest` names in _actor/ and _critic/, into <tag>_uni, "
        f"writing {UNIVERSAL_LATEST_NAME}",
        f"then {flags}",
    )


def _critic_universal(ctx: PlanContext) -> list[str]:
    """With the universal flag the critic loads what `_critic/latest_universal` names, too."""
    critic = io.join(_run(ctx.url), "_critic")
    if not zero_resume.is_universal(ctx.checkpoint) or not io.is_dir(critic):
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
    world_size=zero_resume.zero_world_size(_universal_fix),
    run_of=_run,
    companion=_critic,
    loaded_with=_loaded_with,
    notes=_all_notes,
    impacts=zero_resume.IMPACTS,
    follows_pointer=True,
)
