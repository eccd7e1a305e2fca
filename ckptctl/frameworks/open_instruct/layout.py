"""open-instruct checkpoints: a DeepSpeed save folder with the policy trainer's extras (LAYOUTS.md, open-instruct).

```
CHECKPOINT_STATE_DIR/                  (--checkpoint_state_dir)
    latest, zero_to_fp32.py
    global_step{N}/                    a DeepSpeed tag (bf16 optim files); N counts optimizer steps
        [driver_state.pt]              rank 0's dataloader / data-prep state (open-instruct PR #1647)
    ref_policy/pytorch_model.bin       the reference policy, one file shared by every tag
    [ds_universal_global_step{N}/, latest_universal]
OUTPUT_DIR/{exp}__{seed}__{time}_checkpoints/step_{training_step}/   HF snapshots + .checkpoint_complete
```

A tag is read with `families.zero_tag`; it is open-instruct's when it holds `driver_state.pt`, when
`ref_policy/` lies beside it, or when its client state holds open-instruct's own keys (a tag that lost
`driver_state.pt` stays a torn open-instruct tag, never a whole DeepSpeed one). Its step is the `training_step` of the client state (or of
`driver_state.pt`), not the N of its name, which counts optimizer steps; so `identify` reads the rank-0
`data.pkl` (small: references, no weights) and keeps what it found for `open`.

open-instruct's start-up deletes every `global_step*` folder with fewer entries than the fullest one and
rewrites `latest` (`calibrate_checkpoint_state_dir`): such a folder lists as broken (in progress while it
is fresh) and fails verify, naming the entries it lacks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Component, Problem, ProblemKind, Role
from ckptctl.contract.base import Layout, every_child_folder, folder_size, newest_mtime, timestamp
from ckptctl.contract.load_set import LoadMember, MemberKind
from ckptctl.errors import CkptctlError
from ckptctl.families.hf_folder import HfFolderLayout, has_weights, model_markers, verify_model_files
from ckptctl.families.in_progress import recently_written
from ckptctl.families.torch_file import torch_file_problems
from ckptctl.families.zero_tag.folder import open_tag
from ckptctl.families.zero_tag.names import (
    missing_note,
    read_latest,
    tag_files,
    tag_markers,
)
from ckptctl.families.zero_tag.tag import ENGINE_KEYS, missing_rank_files
from ckptctl.families.zero_tag.verify import verify_tag
from ckptctl.formats.parse_cache import ParseCache
from ckptctl.formats.torch_pickle import open_torch_pickle
from ckptctl.io import DirEntry
from ckptctl.layouts import peek, peek_dir
from ckptctl.quoting import comment, shell

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = [
    "COMPLETE_MARKER",
    "DRIVER_STATE_NAME",
    "REF_POLICY",
    "SNAPSHOTS_SUFFIX",
    "SNAPSHOT_RE",
    "OpenInstructLayout",
    "listing_or_empty",
]

DRIVER_STATE_NAME = "driver_state.pt"
REF_POLICY = "ref_policy/pytorch_model.bin"
COMPLETE_MARKER = ".checkpoint_complete"
_TAG = re.compile(r"^global_step(\d+)$")
#: An HF snapshot folder (`{run_name}_checkpoints/step_{N}/`).
SNAPSHOT_RE = re.compile(r"^step_(\d+)$")
#: The suffix of the folder open-instruct writes its HF snapshots to (`{output_dir}/{run_name}_checkpoints/`).
SNAPSHOTS_SUFFIX = "_checkpoints"
_COUNTERS = ("training_step", "episode", "num_total_tokens")
_RNG_KEY = "rng_states"
_DATALOADER_KEYS = ("dataloader_state", "data_prep_actor_state")
#: Client-state keys only open-instruct's `grpo_fast.py` passes to `save_checkpoint` (beside `rng_states`, `rank`):
#: evidence of an open-instruct tag that survives losing `driver_state.pt`.
_CLIENT_EVIDENCE = frozenset({"training_step", "num_total_tokens", "ref_policy_saved"})


@dataclass(frozen=True)
class _ClientState:
    """What the rank-0 model states and `driver_state.pt` of a tag say (scalars and key names only)."""

    scalars: dict[str, Any] = field(default_factory=dict)
    keys: frozenset[str] = frozenset()
    driver_keys: frozenset[str] = frozenset()
    rng_keys: tuple[str, ...] = ()
    error: str = ""

    @property
    def training_step(self) -> int | None:
        value = self.scalars.get("training_step")
        return value if type(value) is int else None


#: The top-level dicts read (`formats.parse_cache`: keyed by the file's version, so that `identify`, which reads
#: the rank-0 states for the training step, and `open`, which needs them again, parse them once).
_cache: ParseCache[dict[str, Any]] = ParseCache(64)


def _read_dict(url: str, entry: DirEntry) -> dict[str, Any]:
    """The top-level dict of a torch.save file (its `data.pkl` only), cached by size and mtime.

    Raises:
        UnsafePickle, CorruptCheckpoint: the file does not parse safely.
    """

    def parse() -> dict[str, Any]:
        root = open_torch_pickle(url, entry.size).root
        return dict(root) if isinstance(root, dict) else {}

    return _cache.get(url, entry, parse)


def _client_state(url: str, entries: Sequence[DirEntry]) -> _ClientState:
    """The counters and state keys of a tag: `driver_state.pt` first, then the rank-0 model states."""
    by_name = {e.name: e for e in entries if not e.is_dir}
    scalars: dict[str, Any] = {}
    keys: set[str] = set()
    driver_keys: frozenset[str] = frozenset()
    rng: tuple[str, ...] = ()
    try:
        driver = by_name.get(DRIVER_STATE_NAME)
        if driver is not None:
            state = _read_dict(io.join(url, DRIVER_STATE_NAME), driver)
            driver_keys = frozenset(k for k in state if isinstance(k, str))
            scalars.update({k: v for k, v in state.items() if k in _COUNTERS and _scalar(v)})
            rng = _rng_keys(state.get(_RNG_KEY))
        files = tag_files(entries)
        rank0 = files.rank0_model() if files is not None else None
        if rank0 is not None:
            states = _read_dict(io.join(url, rank0), by_name[rank0])
            client = {k: v for k, v in states.items() if isinstance(k, str) and k not in ENGINE_KEYS}
            keys = set(client)
            for k, v in client.items():
                if _scalar(v):
                    scalars.setdefault(k, v)
            rng = rng or _rng_keys(client.get(_RNG_KEY))
    except CkptctlError as exc:
        return _ClientState(scalars, frozenset(keys), driver_keys, rng, exc.message)
    return _ClientState(scalars, frozenset(keys), driver_keys, rng)


def _scalar(value: Any) -> bool:
    return type(value) in (int, float, str, bool)


def _rng_keys(value: Any) -> tuple[str, ...]:
    return tuple(sorted(k for k in value if isinstance(k, str))) if isinstance(value, dict) else ()


def _fullest(save_dir: str, entries: Sequence[DirEntry]) -> tuple[str, int] | None:
    """The `global_step*` folder of a save folder with the most entries (counted as open-instruct counts)."""
    counts = {}
    for entry in entries:
        if entry.is_dir and _TAG.match(entry.name):
            listing = peek_dir(io.join(save_dir, entry.name))
            if listing is not None:
                counts[entry.name] = len(listing)
    if not counts:
        return None
    name = max(counts, key=lambda n: (counts[n], n))
    return name, counts[name]


def _fuller_sibling(url: str, own_count: int) -> tuple[str, int] | None:
    """The fullest `global_step*` folder beside `url` when it holds more entries than `url` does."""
    fullest = peek(io.parent_of(url), _fullest)
    return fullest if fullest is not None and fullest[1] > own_count else None


def _has_ref_policy(save_dir: str, entries: Sequence[DirEntry]) -> bool:
    return any(e.name == "ref_policy" and e.is_dir for e in entries)


def _unfinished(entries: Sequence[DirEntry], note: str) -> tuple[CheckpointState, str]:
    newest = newest_mtime(entries)
    if recently_written(newest):
        return CheckpointState.IN_PROGRESS, f"still being written, or cut short: {note}"
    return CheckpointState.BROKEN, note


def listing_or_empty(url: str) -> list[DirEntry]:
    """The folder's entries; none when it cannot be listed (missing, not a folder, unreadable)."""
    try:
        return io.list_dir(url)
    except CkptctlError:
        return []


class OpenInstructLayout(Layout):
    """An open-instruct DeepSpeed tag (`global_stepN` beside `ref_policy/`, or holding `driver_state.pt`),
    or one of its HF snapshots (`*_checkpoints/step_N`)."""

    name = "open_instruct"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A tag with open-instruct evidence (reads its rank-0 `data.pkl` for the training step), or a
        snapshot folder with model weights or the completion marker."""
        name = io.name_of(url)
        names = {e.name for e in entries if not e.is_dir}
        if m := SNAPSHOT_RE.match(name):
            return self._snapshot(url, entries, names, int(m.group(1)))
        m = _TAG.match(name)
        if m is None:
            return None
        files = tag_files(entries)
        if files is None:
            return None
        client = None
        if DRIVER_STATE_NAME not in names and peek(io.parent_of(url), _has_ref_policy) is not True:
            # A tag that lost `driver_state.pt` and sits alone is still open-instruct's: its client state says so.
            client = _client_state(url, entries)
            if not client.keys >= _CLIENT_EVIDENCE:
                return None
        state, note = CheckpointState.COMPLETE, ""
        missing = files.missing_from_names()
        client = client or _client_state(url, entries)
        if missing:
            state, note = CheckpointState.BROKEN, missing_note(missing)
        elif client.error:
            state, note = CheckpointState.BROKEN, client.error
        elif fuller := _fuller_sibling(url, len(entries)):
            state, note = _unfinished(
                entries,
                f"{len(entries)} entries, fewer than {fuller[0]}'s {fuller[1]}: open-instruct deletes this folder at "
                "start-up",
            )
        elif missing := missing_rank_files(url, files):  # the highest rank's: no sibling is fuller
            state, note = _unfinished(entries, missing_note(missing))
        elif DRIVER_STATE_NAME not in names and not any(k in client.keys for k in _DATALOADER_KEYS):
            state, note = _unfinished(entries, f"no {DRIVER_STATE_NAME}: the data loader state is nowhere")
        step = client.training_step
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=step if step is not None else int(m.group(1)),
            epoch=None,
            created=timestamp(newest_mtime(entries)),
            state=state,
            size_bytes=folder_size(url, entries),
            note=note,
        )

    def _snapshot(self, url: str, entries: Sequence[DirEntry], names: set[str], step: int) -> CheckpointRef | None:
        marked = COMPLETE_MARKER in names
        if not marked and not (io.name_of(io.parent_of(url)).endswith("_checkpoints") and has_weights(names)):
            return None
        ref = HfFolderLayout().identify(url, entries)
        if ref is None:
            size = sum(e.size for e in entries if not e.is_dir)
            ref = CheckpointRef(
                url, self.name, step, None, timestamp(newest_mtime(entries)), CheckpointState.BROKEN, size
            )
        state, note = ref.state, ref.note
        if not marked and state is CheckpointState.COMPLETE:
            state, note = _unfinished(
                entries, f"no {COMPLETE_MARKER}: open-instruct writes it once the snapshot is saved"
            )
        elif marked and not has_weights(names):
            state, note = CheckpointState.BROKEN, f"{COMPLETE_MARKER} but no model weights"
        return replace(ref, layout=self.name, step=step, state=state, note=note)

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """The tag the checkpoint state folder's `latest` names (what `--checkpoint_state_dir` resumes)."""
        return read_latest(url, entries)

    def members(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """A tag: every child folder, as DeepSpeed's; a snapshot: none, as an HF model folder's."""
        if SNAPSHOT_RE.match(io.name_of(url)):
            return frozenset()
        return every_child_folder(entries)

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """A tag: DeepSpeed's markers; a snapshot: the model folder's, then `.checkpoint_complete`, which
        open-instruct writes once the snapshot is saved."""
        top = {name: size for name, size in files.items() if "/" not in name}
        if tag := tag_markers(top):
            return tag
        return (*model_markers(top), *((COMPLETE_MARKER,) if COMPLETE_MARKER in top else ()))

    def companions(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """`ref_policy/` of a checkpoint state folder: shared by its tags, not a checkpoint of its own."""
        dirs = {e.name for e in entries if e.is_dir}
        if "ref_policy" in dirs and any(_TAG.match(d) for d in dirs):
            return frozenset({"ref_policy"})
        return frozenset()

    def open(self, url: str) -> Checkpoint:
        """A tag: DeepSpeed's reading with open-instruct's training step, counters, RNG and data state;
        a snapshot: the model folder."""
        entries = io.list_dir(url)
        ref = self.identified(url, entries, "an open-instruct checkpoint (a DeepSpeed tag beside ref_policy/)")
        if SNAPSHOT_RE.match(io.name_of(url)):
            model = HfFolderLayout().open(url)
            snapshot = {"format": "open_instruct", "kind": "hf_snapshot", **model.metadata}
            return replace(model, ref=ref, metadata=snapshot, role=Role.EXPORT)
        inner = open_tag(url, self.name)
        client = _client_state(url, entries)
        components = set(inner.components)
        if client.rng_keys or _RNG_KEY in client.keys | client.driver_keys:
            components.add(Component.RNG)
        if any(k in client.keys | client.driver_keys for k in _DATALOADER_KEYS):
            components.add(Component.DATALOADER)
        ref_policy = self._ref_policy(url)
        progress = {k: client.scalars[k] for k in _COUNTERS if k in client.scalars}
        progress["optimizer_steps"] = inner.progress.get("global_steps")
        metadata: dict[str, Any] = {
            **inner.metadata,
            "format": "open_instruct",
            "kind": "tag",
            "progress": progress,
            "rng_keys": list(client.rng_keys),
            "driver_state": sorted(client.driver_keys) if DRIVER_STATE_NAME in {e.name for e in entries} else None,
            "ref_policy": ref_policy,
            "resume_setting": shell("--checkpoint_state_dir", io.parent_of(url)) + comment("reads `latest`"),
        }
        if client.error:
            metadata["client_state_error"] = client.error
        if ref_policy is not None:
            components.add(Component.EXTRA)
        return replace(
            inner,
            ref=replace(
                inner.ref,
                layout=self.name,
                step=ref.step,
                state=_worse(inner.ref, ref),
                note=ref.note or inner.ref.note,
            ),
            components=frozenset(components),
            metadata=metadata,
            progress=progress,
            rng_keys=frozenset(client.rng_keys),
        )

    @staticmethod
    def _ref_policy(url: str) -> dict[str, Any] | None:
        for entry in peek_dir(io.join(io.parent_of(url), "ref_policy")) or []:
            if entry.name == "pytorch_model.bin" and not entry.is_dir:
                return {"path": f"../{REF_POLICY}", "size_bytes": entry.size}
        return None

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """DeepSpeed's rules, `latest` naming a tag, `driver_state.pt` and the reference policy parsing
        safely (the latter present when the client state says it was saved), and no fewer entries than the
        fullest `global_step*` folder beside it. A snapshot: the HF model rules and its completion marker."""
        url = checkpoint.url
        if SNAPSHOT_RE.match(io.name_of(url)):
            problems = verify_model_files(url, checkpoint.files)
            if COMPLETE_MARKER not in checkpoint.files:
                problems.append(
                    Problem(
                        ProblemKind.MISSING_FILE,
                        COMPLETE_MARKER,
                        f"{COMPLETE_MARKER} is missing: the save did not finish",
                    )
                )
            return problems
        problems = verify_tag(url, latest=True)
        if DRIVER_STATE_NAME in checkpoint.files:
            problems += _pickle_problems(io.join(url, DRIVER_STATE_NAME), DRIVER_STATE_NAME)
        ref_policy = io.join(io.parent_of(url), *REF_POLICY.split("/"))
        if io.exists(ref_policy):
            problems += _pickle_problems(ref_policy, f"../{REF_POLICY}")
        elif _client_state(url, io.list_dir(url)).scalars.get("ref_policy_saved") is True:
            problems.append(
                Problem(
                    ProblemKind.MISSING_FILE,
                    f"../{REF_POLICY}",
                    "the client state says the reference policy was saved, but it is missing: a resume with "
                    "--load_ref_policy starts the reference from the initial model (which only matters when it was "
                    "being updated, --ref_policy_update_freq)",
                    severity="warning",
                )
            )
        entries = io.list_dir(url)
        fuller = _fuller_sibling(url, len(entries))
        if fuller is not None:
            own = {e.name for e in entries}
            theirs = {e.name for e in peek_dir(io.join(io.parent_of(url), fuller[0])) or []}
            lacking = sorted(theirs - own) or [f"{fuller[1] - len(entries)} entries"]
            problems.append(
                Problem(
                    ProblemKind.MISSING_FILE,
                    "",
                    f"holds {len(entries)} entries, fewer than {fuller[0]}'s {fuller[1]} (lacks {', '.join(lacking[:6])}"
                    f"{' ...' if len(lacking) > 6 else ''}): open-instruct deletes it at start-up and rewrites `latest`",
                )
            )
        return problems

    def load_set(self, checkpoint: Checkpoint) -> Sequence[LoadMember]:
        """A tag's `driver_state.pt` where the client state carries no data state of its own (the DeepSpeed
        files are `verify_tag`'s rules).

        Since open-instruct PR #1647, `grpo_fast.py` saves the data loader's and the data-prep actor's state
        (`dataloader_state`, `data_prep_actor_state`) in rank 0's `driver_state.pt` and no longer in the client
        state, and its resume from `--checkpoint_state_dir` restores them from there: without the file the
        resumed run draws its prompts from the start of the data again, state it saved lost. An error. (Read
        from open-instruct's source: it does not install here.)
        """
        if SNAPSHOT_RE.match(io.name_of(checkpoint.url)):
            return ()
        client = _client_state(checkpoint.url, io.list_dir(checkpoint.url))
        if any(k in client.keys for k in _DATALOADER_KEYS):
            return ()
        return (
            LoadMember(
                DRIVER_STATE_NAME,
                MemberKind.TORCH_SAVE,
                "the data loader and data-prep state (rank 0's driver state)",
                "open-instruct grpo_fast.py's resume (else the data starts over)",
            ),
        )

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.open_instruct.resume`."""
        from ckptctl.frameworks.open_instruct.resume import PROFILE

        return PROFILE


def _worse(a: CheckpointRef, b: CheckpointRef) -> CheckpointState:
    order = (CheckpointState.COMPLETE, CheckpointState.IN_PROGRESS, CheckpointState.BROKEN)
    return max(a.state, b.state, key=order.index)


def _pickle_problems(url: str, path: str) -> list[Problem]:
    _, problems = torch_file_problems(path, partial(open_torch_pickle, url))
    return problems
