"""OpenRLHF checkpoints: DeepSpeed save folders with OpenRLHF's extras (LAYOUTS.md, OpenRLHF).

```
CKPT_PATH/                          (--ckpt_path; >= v0.10.2 --ckpt.path)
    _actor/                         a DeepSpeed save folder: latest, zero_to_fp32.py, and per save
        global_step{N}/             a DeepSpeed tag (+ metric.json >= v0.9.9, written after the save)
        best_global_step{N}/        the best one so far (>= v0.9.9; `latest` names it right after it is saved)
    _critic/                        the same for the critic, when one is trained
    global_step{N}_hf/              HF export of the actor (--save_hf_ckpt)
SFT/DPO/RM: the tags and `{tag}_hf` exports directly in CKPT_PATH.
```

A tag is read with `families.zero_tag`; what makes it OpenRLHF's is the evidence around it: a `_actor` or
`_critic` parent, its `metric.json`, a `best_` name, or `best_global_step*`/`*_hf` folders beside it (one
listing of the save folder per scan, see `peek_dir`). The actor and the critic of one step are two
checkpoints, as OpenRLHF writes them: two save folders, each with its own `latest` and its own rotation.

The step is OpenRLHF's `global_step` (client state of PPO >= v0.9.5, else the number in the tag name),
not DeepSpeed's `global_steps`, which counts optimizer steps (many per PPO step). `metric.json`
(`{"metric_key", "metric_value"}`) becomes the checkpoint's `metrics` for `prune --keep-best`, which also
keeps every `best*` folder.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Component, Problem, ProblemKind, Role
from ckptctl.contract.base import (
    Layout,
    Protections,
    every_child_folder,
    folder_size,
    newest_mtime,
    timestamp,
)
from ckptctl.errors import CkptctlError
from ckptctl.families.hf_folder import HfFolderLayout, has_weights, model_markers, verify_model_files
from ckptctl.families.zero_tag.folder import open_tag
from ckptctl.families.zero_tag.names import (
    missing_note,
    read_latest,
    tag_files,
    tag_markers,
)
from ckptctl.families.zero_tag.tag import missing_rank_files
from ckptctl.families.zero_tag.verify import verify_tag
from ckptctl.formats.documents import as_real, read_json
from ckptctl.io import DirEntry
from ckptctl.layouts import peek, peek_dir

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = ["EXPORT_RE", "METRIC_NAME", "TAG_RE", "OpenRlhfLayout", "role_of"]

METRIC_NAME = "metric.json"
#: A DeepSpeed tag of OpenRLHF's (`global_step{N}`, `best_` for the best metric's), and its HF export.
TAG_RE = re.compile(r"^(best_)?global_step(\d+)$")
EXPORT_RE = re.compile(r"^(best_)?global_step(\d+)_hf$")
_ROLES = {"_actor": "actor", "_critic": "critic"}
#: Client-state counters OpenRLHF saves (PPO >= v0.9.5; older PPO and SFT/DPO/RM: consumed_samples).
_COUNTERS = ("global_step", "episode", "total_consumed_prompts", "consumed_samples")
_DATALOADER_KEY = "data_loader_state_dict"
_MAX_METRIC_BYTES = 1 << 16


def _is_tag_evidence(url: str, names: set[str]) -> bool:
    """Whether a DeepSpeed tag folder is OpenRLHF's, from its own files, its name and its save folder."""
    name = io.name_of(url)
    parent = io.parent_of(url)
    if METRIC_NAME in names or name.startswith("best_") or io.name_of(parent) in _ROLES:
        return True
    return peek(parent, _holds_openrlhf_folders) is True


def _holds_openrlhf_folders(url: str, entries: Sequence[DirEntry]) -> bool:
    """Whether a save folder holds `best_global_step*` tags or `*_hf` exports beside its tags."""
    return any(e.is_dir and (e.name.startswith("best_global_step") or EXPORT_RE.match(e.name)) for e in entries)


def role_of(url: str) -> str | None:
    """`actor` or `critic` for a tag inside `_actor/` or `_critic/` (PPO's save folders), else None."""
    return _ROLES.get(io.name_of(io.parent_of(url)))


def _read_metric(url: str) -> dict[str, Any] | None:
    """The `metric.json` payload of a tag, or None when it is missing or unreadable."""
    try:
        payload = read_json(io.join(url, METRIC_NAME), max_bytes=_MAX_METRIC_BYTES)
    except CkptctlError:
        return None
    return payload if isinstance(payload, dict) else None


def _metrics(payload: dict[str, Any] | None) -> dict[str, float]:
    """`{metric_key: metric_value}` for `prune --keep-best` (nothing when OpenRLHF recorded no value)."""
    if payload is None:
        return {}
    value = as_real(payload.get("metric_value"))
    if value is None:
        return {}
    key = payload.get("metric_key")
    return {key if isinstance(key, str) and key else "metric": value}


class OpenRlhfLayout(Layout):
    """An OpenRLHF DeepSpeed tag (`_actor/global_stepN`, `best_global_stepN`) or HF export (`global_stepN_hf`)."""

    name = "openrlhf"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A tag folder with OpenRLHF evidence around it, or an `*_hf` export holding model weights."""
        name = io.name_of(url)
        names = {e.name for e in entries if not e.is_dir}
        if m := EXPORT_RE.match(name):
            if not has_weights(names):
                return None
            ref = HfFolderLayout().identify(url, entries)
            return None if ref is None else replace(ref, layout=self.name, step=int(m.group(2)))
        m = TAG_RE.match(name)
        if m is None:
            return None
        files = tag_files(entries)
        if files is None or not _is_tag_evidence(url, names):
            return None
        missing = missing_rank_files(url, files)
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=int(m.group(2)),
            epoch=None,
            created=timestamp(newest_mtime(entries)),
            state=CheckpointState.BROKEN if missing else CheckpointState.COMPLETE,
            size_bytes=folder_size(url, entries),
            note=missing_note(missing),
        )

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """The tag the save folder's DeepSpeed `latest` file names (OpenRLHF resumes from it)."""
        return read_latest(url, entries)

    def members(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """A tag: every child folder, as DeepSpeed's; an `*_hf` export: none, as an HF model folder's."""
        return frozenset() if EXPORT_RE.match(io.name_of(url)) else every_child_folder(entries)

    def open(self, url: str) -> Checkpoint:
        """A tag: DeepSpeed's reading, with OpenRLHF's step, role, counters and metric; an export: the
        model folder."""
        entries = io.list_dir(url)
        ref = self.identified(url, entries, "an OpenRLHF checkpoint (a DeepSpeed tag or *_hf export of OpenRLHF)")
        if EXPORT_RE.match(io.name_of(url)):
            model = HfFolderLayout().open(url)
            export = {"format": "openrlhf", "kind": "hf_export", **model.metadata}
            return replace(model, ref=replace(ref, created=model.ref.created), metadata=export, role=Role.EXPORT)
        inner = open_tag(url, self.name)
        progress = dict(inner.progress)
        global_step = progress.get("global_step")
        payload = _read_metric(url) if any(e.name == METRIC_NAME for e in entries) else None
        counters = {k: progress[k] for k in _COUNTERS if k in progress}
        metrics = _metrics(payload)
        metadata: dict[str, Any] = {
            **inner.metadata,
            "format": "openrlhf",
            "kind": "best" if io.name_of(url).startswith("best_") else "tag",
            "role": role_of(url),
            "progress": counters,
            "optimizer_steps": progress.get("global_steps"),
        }
        if payload is not None:
            metadata["metrics"] = metrics
            metadata["metric_key"] = payload.get("metric_key")
        metadata["resume_setting"] = "--load_checkpoint (>= v0.10.2: --ckpt.load_enable) with the same --ckpt_path"
        # DeepSpeed lists the client state's non-scalar keys; PPO's data loader state is one of them.
        client_keys = {k.strip() for k in str(inner.metadata.get("client_state_keys") or "").split(",")}
        components = set(inner.components) | ({Component.DATALOADER} if _DATALOADER_KEY in client_keys else set())
        return replace(
            inner,
            components=frozenset(components),
            ref=replace(
                inner.ref,
                layout=self.name,
                step=global_step if type(global_step) is int else ref.step,
                state=inner.ref.state if inner.ref.state is not CheckpointState.COMPLETE else ref.state,
                note=inner.ref.note or ref.note,
            ),
            metadata=metadata,
            progress=counters,
            metrics=metrics,
        )

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """DeepSpeed's rules for a tag (every rank file, `latest` naming a tag) plus `metric.json` parsing,
        and a warning for a tag without one when the tags beside it have one (the save was cut off after
        DeepSpeed finished and before OpenRLHF wrote the metric, which retention then evicts first).
        An export: the HF model rules."""
        url = checkpoint.url
        if EXPORT_RE.match(io.name_of(url)):
            return verify_model_files(url, checkpoint.files)
        problems = verify_tag(url, latest=True)
        if METRIC_NAME in checkpoint.files:
            if _read_metric(url) is None:
                problems.append(Problem(ProblemKind.BAD_METADATA, METRIC_NAME, f"{METRIC_NAME} is not a JSON object"))
        elif others := _tags_with_metric(url):
            problems.append(
                Problem(
                    ProblemKind.MISSING_FILE,
                    METRIC_NAME,
                    f"no {METRIC_NAME} while {others[0]} has one: OpenRLHF writes it after the DeepSpeed save, so "
                    "this save was cut off in between (the weights may be whole; retention evicts it first)",
                    severity="warning",
                )
            )
        return problems

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """A tag: DeepSpeed's markers, then `metric.json`, which OpenRLHF writes after the DeepSpeed save; an
        export: the model folder's."""
        top = {name: size for name, size in files.items() if "/" not in name}
        if tag := tag_markers(top):
            return (*tag, *((METRIC_NAME,) if METRIC_NAME in top else ()))
        return model_markers(top)

    def protections(self, series: Sequence[CheckpointRef]) -> Protections:
        """`best*` folders: OpenRLHF saves its best checkpoint so far as `best_global_stepN` and never rotates
        it out; any checkpoint named so is kept likewise."""
        best = [ref.url for ref in series if io.name_of(ref.url).lower().startswith("best")]
        return Protections(
            reasons=dict.fromkeys(best, ("a best checkpoint (best* folders are kept, as OpenRLHF does)",))
        )

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.openrlhf.resume`."""
        from ckptctl.frameworks.openrlhf.resume import PROFILE

        return PROFILE


def _tags_with_metric(url: str) -> list[str]:
    """The other tags of the save folder that hold a `metric.json`."""
    own = io.name_of(url)
    return [name for name in peek(io.parent_of(url), _metric_tags) or [] if name != own]


def _metric_tags(save_dir: str, entries: Sequence[DirEntry]) -> list[str]:
    found = []
    for entry in entries:
        if entry.is_dir and TAG_RE.match(entry.name):
            listing = peek_dir(io.join(save_dir, entry.name)) or []
            if any(e.name == METRIC_NAME for e in listing):
                found.append(entry.name)
    return sorted(found)
