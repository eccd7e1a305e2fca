"""OpenRLHF's pointers: `--load_checkpoint` loads `_actor/` and `_critic/` each through DeepSpeed's
`load_checkpoint(save_dir)`, which follows that folder's own `latest` (openrlhf/trainer/ray/ppo_actor.py,
ppo_critic.py). A resume lands on a PPO step only when the actor's and the critic's tags of that step both
load, so both `latest` files are written, naming tags of the same name."""

from __future__ import annotations

from ckptctl import io
from ckptctl.contract.capabilities import Pointer
from ckptctl.families.pointers import FollowsPointer
from ckptctl.families.zero_tag.names import LATEST_NAME

_OTHER_ROLE = {"_actor": "_critic", "_critic": "_actor"}


def _roles(tag: str) -> tuple[str, ...]:
    """The tag, then the other PPO role's tag of the same name when the run trains that role."""
    save_dir = io.parent_of(tag)
    other = _OTHER_ROLE.get(io.name_of(save_dir))
    if other is None:
        return (tag,)
    other_dir = io.join(io.parent_of(save_dir), other)
    return (tag, io.join(other_dir, io.name_of(tag))) if io.is_dir(other_dir) else (tag,)


def _pointers(tag: str) -> tuple[Pointer, ...]:
    return tuple(Pointer(io.join(io.parent_of(role), LATEST_NAME), io.name_of(role)) for role in _roles(tag))


POINTER_WRITER = FollowsPointer(_pointers, _roles)
