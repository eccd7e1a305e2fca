"""How AReaL resumes (`recover.mode=on`): the trial's recover slot with `recover_info/`, on the
parallelism it was saved with; the critic only when the training script hands it over."""

from __future__ import annotations

from collections.abc import Mapping

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, Component
from ckptctl.contract.resume import PlanContext, ResumeProfile, WorldSizeCheck, target_ranks
from ckptctl.errors import CkptctlError
from ckptctl.families.dcp_resume import overwrite_warnings
from ckptctl.formats.dcp_metadata import METADATA_NAME
from ckptctl.frameworks.areal.files import RECOVER_INFO, torn_info_files
from ckptctl.quoting import comment, shell

__all__ = ["PROFILE"]


def _trial(url: str) -> str | None:
    """The trial folder (`.../{experiment}/{trial}/`, holding `recover_info/`) at or above `url`."""
    folder = url
    for _ in range(4):
        if io.is_dir(io.join(folder, RECOVER_INFO)):
            return folder
        parent = io.parent_of(folder)
        if parent == folder:
            break
        folder = parent
    return None


def _run(url: str) -> str:
    """The trial folder: its recover slots, HF exports and `recover_info/` are one run."""
    return _trial(url) or io.parent_of(url)


def _critic(ref: CheckpointRef) -> bool:
    """The critic's recover slot loads along with the actor's (same `recover_info/`)."""
    return io.name_of(io.parent_of(ref.url)) == "critic"


def _hint(ctx: PlanContext) -> str:
    trial = _trial(ctx.url)
    if trial is None:
        return "recover.mode=on with the experiment_name and trial_name of the run that saved it"
    experiment = io.name_of(io.parent_of(trial))
    words = ["recover.mode=on", f"experiment_name={experiment}", f"trial_name={io.name_of(trial)}"]
    marker = "/checkpoints/"
    if marker in trial:
        words.append(f"cluster.fileroot={trial.split(marker, 1)[0]}")
    return shell(*words) + comment("older releases: recover.mode=auto or resume")


def _world_size(ctx: PlanContext) -> WorldSizeCheck:
    saved = ctx.checkpoint.world_size
    target = target_ranks(ctx, saved)
    ok = None if saved is None or target is None else saved == target
    note = "AReaL reloads its recover checkpoint only with the parallelism (allocation_mode) it was saved with"
    return WorldSizeCheck(saved, target, ok, note)


def _mtime(folder: str, name: str) -> float | None:
    try:
        entries = io.list_dir(folder)
    except CkptctlError:
        return None
    return next((e.mtime for e in entries if e.name == name and not e.is_dir), None)


def _notes(ctx: PlanContext) -> list[str]:
    """The torn-save rule of the layout (`torn_info_files`), on the chosen slot and its trial's info files."""
    trial = _trial(ctx.url)
    if trial is None:
        return []
    weights = _mtime(ctx.url, METADATA_NAME)
    try:
        info = io.list_dir(io.join(trial, RECOVER_INFO))
    except CkptctlError:
        return []
    torn = [] if weights is None else torn_info_files(weights, info)
    if not torn:
        return []
    return [
        f"{RECOVER_INFO}/{', '.join(torn)} {'is' if len(torn) == 1 else 'are'} older than the recover checkpoint's "
        f"{METADATA_NAME}: the last save rewrote the weights but not the counters (a torn save); AReaL would pair "
        "the older step with newer weights, or restart from step 0 if the info files do not parse"
    ]


def _extras(ctx: PlanContext) -> dict[str, str]:
    trial = _trial(ctx.url)
    if trial is None or not io.is_dir(io.join(trial, "critic")):
        return {}
    return {
        "critic": "the critic is saved under critic/, but AReaL's recover reloads only the engines the training "
        "script hands to RecoverHandler.load: unless yours passes the critic, it restarts from its initial weights"
    }


_IMPACTS: Mapping[Component, str] = {
    Component.SCHEDULER: "AReaL's recover checkpoint holds no LR scheduler: the schedule restarts from its first step",
    Component.RNG: "AReaL's recover checkpoint holds no RNG state: sampling and dropout draw other numbers",
}

PROFILE = ResumeProfile(
    framework="AReaL",
    hint=_hint,
    world_size=_world_size,
    impacts=_IMPACTS,
    run_of=_run,
    companion=_critic,
    traps=overwrite_warnings,
    notes=_notes,
    extras=_extras,
)
