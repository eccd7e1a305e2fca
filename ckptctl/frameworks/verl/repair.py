"""verl's pointer: `trainer.resume_mode=auto` resumes from `find_latest_ckpt_path(default_local_dir)`
(verl/utils/checkpoint/checkpoint_manager.py), the `global_step_{N}` its tracker names, which the trainer
writes as the bare step (SkyRL's tracker alike). A step is its roles (`actor/`, `critic/`): each verifies."""

from __future__ import annotations

from ckptctl import io
from ckptctl.contract.capabilities import Pointer
from ckptctl.families.pointers import FollowsPointer
from ckptctl.frameworks.verl.files import STEP_RE, TRACKERS, read_tracker


def _roles(step: str) -> tuple[str, ...]:
    """The step folder, then each role folder in it."""
    return (step, *(io.join(step, e.name) for e in sorted(io.list_dir(step), key=lambda e: e.name) if e.is_dir))


def _tracker(step: str) -> tuple[Pointer, ...]:
    found = STEP_RE.match(io.name_of(step))
    if found is None:
        return ()
    run = io.parent_of(step)
    current = read_tracker(run, io.list_dir(run))
    name = current[0] if current is not None else TRACKERS[0]
    return (Pointer(io.join(run, name), found.group(1)),)


POINTER_WRITER = FollowsPointer(_tracker, _roles)
