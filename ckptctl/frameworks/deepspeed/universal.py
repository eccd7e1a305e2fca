"""DeepSpeed universal checkpoints: what `deepspeed.checkpoint.ds_to_universal` writes (LAYOUTS.md, DeepSpeed).

```
SAVE_DIR/latest_universal        names the folder `"checkpoint": {"load_universal": true}` loads;
                                 ds_to_universal writes it last, naming its output folder
SAVE_DIR/{output}/               its --output_folder: `{tag}_universal` in DeepSpeed's docs,
                                 `ds_universal_{tag}` when open-instruct converts, `{tag}_uni` from OpenRLHF's script
    zero/{param}/fp32.pt, exp_avg.pt, exp_avg_sq.pt, [step.pt]   one folder per parameter (`universal_states`)
    zero/optimizer_state.pt      the optimizer's global state, written after the parameters
    *_model_states.pt            copied from the tag, last (ZeRO-3: every DP rank's)
    [tmp/]                       the per-rank fragments, removed at the end (kept with --keep_temp_folder)
```

A universal checkpoint loads on any number of data-parallel ranks, where a ZeRO tag loads only on the number
it was saved with (DeepSpeed#2898). It is told from a tag by its `zero/` folder and the absence of
optim-states files.

It holds the training state of the tag it was converted from. When that tag lies beside it (a folder whose
name its own contains, with the same model-states files: ds_to_universal copies them), its step, epoch,
counters and components are the tag's as the tag's own layout reads them (an open-instruct tag's step is its
training step, not DeepSpeed's count), and `resume-plan` resumes the framework that wrote the tag
(`universal_host`). Without it, the step is DeepSpeed's `global_steps`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import cache, partial
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Component, Problem, ProblemKind, TensorEntry
from ckptctl.contract.base import (
    LISTED_ABSENT,
    Layout,
    every_child_folder,
    folder_size,
    list_files,
    newest_mtime,
    timestamp,
)
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.families.in_progress import unfinished_state
from ckptctl.families.torch_file import torch_file_problems
from ckptctl.families.zero_tag.names import (
    MODEL_STATES,
    UNIVERSAL_LATEST_NAME,
    UNIVERSAL_LAYOUT,
    TagFiles,
    latest_problem,
    read_latest,
    tag_files,
    tag_markers,
)
from ckptctl.families.zero_tag.tag import DeepSpeedTag, base_state, read_tag
from ckptctl.formats.safe_pickle import StandIn, state_fields
from ckptctl.frameworks.deepspeed.universal_states import (
    MOMENTS,
    OPTIMIZER_STATE,
    ZERO_DIR,
    UniversalStates,
    universal_index,
    verify_states,
)
from ckptctl.io import DirEntry
from ckptctl.layouts import get_layout, peek_dir

# The host's resume facts (`contract.resume`) and the run the conversion came from are asked of a universal
# checkpoint found, not imported by every scan that tries this reader.
if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile
    from ckptctl.frameworks.deepspeed.universal_host import Source

__all__ = ["DeepSpeedUniversalLayout"]

#: The per-rank fragments ds_to_universal gathers before merging them into `zero/`.
_TEMP_DIR = "tmp"
#: DeepSpeed's default tag, `global_step{N}`, inside the name of a conversion of it.
_TAG_STEP = re.compile(r"global_step(\d+)")
_OPTIMIZER_STATE_NAME = OPTIMIZER_STATE.rpartition("/")[2]


def _holds_states(url: str, zero: Sequence[DirEntry]) -> bool:
    """Whether a `zero/` folder is a universal checkpoint's: its optimizer state, or parameter folders."""
    if any(e.name == _OPTIMIZER_STATE_NAME and not e.is_dir for e in zero):
        return True
    first = next((e for e in zero if e.is_dir), None)
    return first is not None and any(e.name == "fp32.pt" for e in peek_dir(io.join(url, ZERO_DIR, first.name)) or [])


def _missing_model_states(files: TagFiles) -> list[str]:
    """The model-states files the names of the others promise (a universal checkpoint has no optim files)."""
    return [name for name in files.missing_from_names() if MODEL_STATES.match(name)]


def _unfinished(files: TagFiles | None, zero: Sequence[DirEntry]) -> str:
    """Why the listings show a conversion that did not finish ("" when they do not)."""
    if files is None:
        # Named as DeepSpeed's `load_checkpoint` asks for them (deepspeed/runtime/engine.py: _get_all_ckpt_names;
        # it fails on a folder without them): the files a torn conversion lost.
        return (
            "no model states (mp_rank_00_model_states.pt, or zero_pp_rank_0_mp_rank_00_model_states.pt under ZeRO-3): "
            "ds_to_universal copies them from the tag last (the conversion did not finish)"
        )
    missing = _missing_model_states(files)
    if missing:
        return f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
    if not any(e.name == _OPTIMIZER_STATE_NAME for e in zero):
        return f"no {OPTIMIZER_STATE}: ds_to_universal writes it after every parameter (the conversion did not finish)"
    return ""


def _name_step(url: str) -> int | None:
    found = _TAG_STEP.search(io.name_of(url))
    return int(found.group(1)) if found else None


class DeepSpeedUniversalLayout(Layout):
    """A DeepSpeed universal checkpoint (`ds_to_universal`'s output folder); its parent holds `latest_universal`."""

    name = UNIVERSAL_LAYOUT

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A ref when the folder holds `zero/` with parameter states and no optim-states files; BROKEN (in
        progress while fresh) when the model states or `zero/optimizer_state.pt` are missing."""
        if not any(e.name == ZERO_DIR and e.is_dir for e in entries):
            return None
        files = tag_files(entries)
        if files is not None and files.optim:
            return None
        zero = peek_dir(io.join(url, ZERO_DIR)) or []
        if files is None and not _holds_states(url, zero):
            return None
        note = _unfinished(files, zero)
        newest = newest_mtime([*entries, *zero])
        state = CheckpointState.COMPLETE
        if note:
            state = unfinished_state(newest)
        from ckptctl.frameworks.deepspeed.universal_host import source_of

        source = source_of(url)
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=source.ref.step if source is not None else _name_step(url),
            epoch=source.ref.epoch if source is not None else None,
            created=timestamp(newest),
            state=state,
            size_bytes=folder_size(url, entries),
            note=note,
        )

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """The conversion the save folder's `latest_universal` names."""
        return read_latest(url, entries, UNIVERSAL_LATEST_NAME)

    def members(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """Every child folder: `zero/`, and the `tmp/` of an unfinished conversion."""
        return every_child_folder(entries)

    def open(self, url: str) -> Checkpoint:
        """Read the rank-0 model states and `zero/`'s listing (the tensor index reads each state file's
        `data.pkl`); the tag it was converted from, when beside it, gives the training progress.

        A folder whose model states do not parse still opens (so that `verify` can say why), as BROKEN,
        with a tensor index that raises the reason.
        """
        entries = io.list_dir(url)
        ref = self.identified(url, entries, "a DeepSpeed universal checkpoint (no zero/ folder of parameter states)")
        files = list_files(url)
        listing = tag_files(entries)
        try:
            if listing is None:
                raise CorruptCheckpoint(f"{url}: {ref.note}")
            tag = read_tag(url, listing)
        except CorruptCheckpoint as exc:
            return Checkpoint.unreadable(ref, exc, files, {"format": UNIVERSAL_LAYOUT})
        states = UniversalStates(url, files)
        from ckptctl.frameworks.deepspeed.universal_host import source_of

        source = source_of(url)
        tag_ckpt = _open_source(source)
        metadata = _metadata(url, tag, states, source)
        components = set(tag_ckpt.components if tag_ckpt is not None else tag.components())
        if any(state in held for held in states.zero.params.values() for state in MOMENTS[1:]):
            components.add(Component.OPTIMIZER)
        else:
            components.discard(Component.OPTIMIZER)
        progress = dict(tag_ckpt.progress) if tag_ckpt is not None else metadata["progress"]
        metadata["progress"] = progress
        rng_keys = tag_ckpt.rng_keys if tag_ckpt is not None else None
        if rng_keys is not None:
            metadata["rng_keys"] = sorted(rng_keys)
        epoch = tag.client_state().get("epoch")
        parent = io.parent_of(url)
        ref = replace(
            ref,
            step=ref.step if source is not None else (tag.global_steps if tag.global_steps is not None else ref.step),
            epoch=ref.epoch if source is not None else _epoch(epoch),
            latest=read_latest(parent, io.list_dir(parent), UNIVERSAL_LATEST_NAME) == io.name_of(url),
        )

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            return universal_index(tag, states)

        return Checkpoint(
            ref=ref,
            components=frozenset(components),
            world_size=tag.world_size,
            metadata=metadata,
            tensor_index=tensor_index,
            files=files,
            progress=progress,
            rng_keys=rng_keys,
        )

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """The model states (every file for the model-parallel size, and every DP rank's under ZeRO-3, each
        parsing safely and whole), `zero/` (`universal_states.verify_states`), a leftover `tmp/`, and the
        save folder's `latest_universal` naming an existing folder."""
        url = checkpoint.url
        entries = io.list_dir(url)
        problems = _model_state_problems(url, entries)
        if not any(p.severity == "error" for p in problems):
            tag = read_tag(url, tag_files(entries))
            problems += verify_states(tag, UniversalStates(url, checkpoint.files))
        if any(e.name == _TEMP_DIR and e.is_dir for e in entries):
            problems.append(
                Problem(
                    ProblemKind.UNEXPECTED_FILE,
                    _TEMP_DIR,
                    "ds_to_universal's per-rank fragments are still here (--keep_temp_folder, or it stopped before "
                    "removing them): they are not loaded, delete them to save space",
                    severity="warning",
                )
            )
        pointer = latest_problem(io.parent_of(url), f"../{UNIVERSAL_LATEST_NAME}", UNIVERSAL_LATEST_NAME)
        if pointer is not None:
            problems.append(pointer)
        return problems

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """`zero/optimizer_state.pt`, then the rank-0 model states: ds_to_universal writes them after every
        parameter's states, in this order."""
        top = {name: size for name, size in files.items() if "/" not in name}
        return (*((OPTIMIZER_STATE,) if OPTIMIZER_STATE in files else ()), *tag_markers(top))

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.deepspeed.universal_host`."""
        from ckptctl.frameworks.deepspeed.universal_host import UNIVERSAL_PROFILE

        return UNIVERSAL_PROFILE


def _epoch(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _open_source(source: Source | None) -> Checkpoint | None:
    """The tag it was converted from, opened by its own layout (None when absent or unreadable)."""
    if source is None:
        return None
    try:
        return get_layout(source.layout).open(source.url)
    except CkptctlError:
        return None


def _metadata(url: str, tag: DeepSpeedTag, states: UniversalStates, source: Source | None) -> dict[str, Any]:
    info = tag.metadata()
    for key in ("partition_count", "optim_states_files"):  # a conversion has no partitions
        info.pop(key, None)
    info.update(
        format=UNIVERSAL_LAYOUT,
        tag=io.name_of(url),
        converted_from=None if source is None else {"tag": io.name_of(source.url), "layout": source.layout},
        parameters=len(states.zero.params),
        loads_on="any number of data-parallel ranks",
    )
    try:
        info.update(_optimizer_info(states.optimizer_state()))
    except CkptctlError as exc:
        info["optimizer_state_error"] = exc.message
    return info


def _optimizer_info(state: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = {}
    scaler = state.get("loss_scaler")
    if isinstance(scaler, StandIn):
        scale = state_fields(scaler, "loss_scaler").get("cur_scale")
        if type(scale) in (int, float):
            info["loss_scale"] = scale
    groups = state.get("param_groups") or base_state(state).get("param_groups")
    if isinstance(groups, list) and groups and isinstance(groups[0], dict):
        first = groups[0]
        info["optimizer"] = {k: first[k] for k in ("lr", "weight_decay", "eps") if type(first.get(k)) in (int, float)}
        info["param_groups"] = len(groups)
    return info


def _model_state_problems(url: str, entries: Sequence[DirEntry]) -> list[Problem]:
    """The model states: present for every model-parallel rank (and every DP rank under ZeRO-3), parsing
    safely, holding every storage they name."""
    files = tag_files(entries)
    if files is None:
        return [Problem(ProblemKind.MISSING_FILE, "mp_rank_00_model_states.pt", _unfinished(None, ()))]
    problems = [Problem(ProblemKind.MISSING_FILE, name, f"{name} is missing") for name in _missing_model_states(files)]
    try:
        tag = read_tag(url, files)
    except CkptctlError as exc:
        return [*problems, Problem.from_error(exc, files.rank0_model() or files.model_name(0, 0))]
    expected = {
        files.model_name(dp, mp) if files.per_dp_model_files else files.model_name_0(mp)
        for mp in range(tag.mp_world_size)
        for dp in range(tag.dp_world_size)
    }
    reported = {p.path for p in problems}
    problems += [
        Problem(ProblemKind.MISSING_FILE, name, f"{name} is missing (dp_world_size {tag.dp_world_size})")
        for name in sorted(expected - set(files.sizes) - reported)[:LISTED_ABSENT]
    ]
    for name in sorted(expected & set(files.sizes)):
        _, found = torch_file_problems(name, partial(tag.open_file, name))
        problems += found
    return problems
