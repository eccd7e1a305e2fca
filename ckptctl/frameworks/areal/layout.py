"""AReaL checkpoints: the Saver's HF exports and the recover slot (LAYOUTS.md, AReaL).

```
{fileroot}/checkpoints/{user}/{experiment}/{trial}/
    default/                                    one folder per trained model ("critic/" likewise)
        epoch{E}epochstep{S}globalstep{G}/      HF export per save, never pruned (Archon: `*.tmp` until renamed)
        recover_checkpoint/                     ONE torch DCP slot, overwritten in place (Megatron: + metadata.json, common.pt)
    recover_info/                               step_info.json, saver_info.json, evaluator_info.json,
                                                stats_logger_info.json, checkpoint_info.json, dataloader_info.pkl
                                                (+ an empty recover_checkpoint/ that AReaL's recover check creates)
```

The recover slot and `recover_info/` form one logical checkpoint, which is what `recover.mode=on` loads:
its URL is the slot (what `prune` and `verify --write-manifest` act on, and what its size counts), and
`open`/`verify` read `../../recover_info/` as part of it (step, epoch, counters, data loader state). With a
critic, `default/recover_checkpoint` and `critic/recover_checkpoint` are two checkpoints sharing that
`recover_info/`, as the Saver writes them. Steps are AReaL's own 0-based `global_step`, in the export
names and in `step_info.json` alike (the last completed step; a resume continues at the next one).

Nothing marks a finished save: the slot is overwritten first, then the info files one by one. So a slot
counts as complete only when `.metadata` is newer than its data files (else an in-place overwrite did not
finish), `recover_info/` holds a `step_info.json` with a valid step, and every info file is newer than
`.metadata` (else the save was torn between weights and counters: AReaL would pair new weights with old
counters, or restart from step 0 when an info file does not parse). While the newest file is fresh the
slot is in progress instead of broken. Times compare with a little slack (`dcp_folder.MTIME_SLACK_S`); a copy that
did not keep modification times can trip these checks.

`dataloader_info.pkl` is a plain pickle (one data loader state per rank) read through the allowlisting
unpickler: torch tensors inside (a sampler's generator state, pickled as `torch.storage._load_from_bytes`)
stay opaque bytes and are never loaded.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import (
    Checkpoint,
    CheckpointRef,
    CheckpointState,
    Component,
    Problem,
    ProblemKind,
    Role,
    TensorEntry,
    raising_index,
)
from ckptctl.contract.base import Layout, newest_mtime, timestamp
from ckptctl.contract.load_set import LoadMember, MemberKind
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.families.dcp_folder import (
    DISTCP_RE,
    component_classifier,
    data_newer_than_metadata,
    index_from_metadata,
    verify_dcp,
    world_size_of,
)
from ckptctl.families.hf_folder import HfFolderLayout, has_weights, model_markers, verify_model_files
from ckptctl.families.in_progress import unfinished_state
from ckptctl.formats.dcp_folder_metadata import load_dcp_metadata
from ckptctl.formats.dcp_metadata import METADATA_NAME
from ckptctl.formats.documents import MAX_INT, read_json
from ckptctl.formats.safe_pickle import MAX_DIMS, check_nesting, safe_loads
from ckptctl.formats.torch_pickle_classes import TORCH_PICKLE_GLOBALS
from ckptctl.frameworks.areal.files import (
    DATALOADER_INFO,
    INFO_FILES,
    RECOVER_INFO,
    RECOVER_SLOT,
    STEP_INFO,
    torn_info_files,
)
from ckptctl.io import DirEntry
from ckptctl.layouts import peek_dir

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = ["EXPORT_RE", "ArealLayout", "read_dataloader_info"]

#: An HF export of a save (`epoch{E}epochstep{S}globalstep{G}`; Archon's ends in `.tmp` until renamed).
EXPORT_RE = re.compile(r"^epoch(\d+)epochstep(\d+)globalstep(\d+)(\.tmp)?$")
_STEP_FIELDS = ("epoch", "epoch_step", "global_step", "steps_per_epoch")
_MEGATRON_FILES = frozenset({"metadata.json", "common.pt"})
_MAX_INFO_BYTES = 64 << 20
_INFO_PREFIX = f"../../{RECOVER_INFO}/"
#: What an export's tokenizer is saved as (`ArealLayout.load_set`).
_EXPORT_TOKENIZER = frozenset({"tokenizer.json", "tokenizer_config.json"})
_NO_WEIGHTS = (
    "the export holds no model weights (model.safetensors, or its shards and index): transformers from_pretrained "
    "fails on it"
)


# --------------------------------------------------------------------------------------------------
# dataloader_info.pkl: a plain pickle, read with stand-ins for the torch pieces a data loader state holds.
# --------------------------------------------------------------------------------------------------


class InlineStorage:
    """Stand-in for `torch.storage._load_from_bytes(data)`: the size of the torch.save bytes, never loaded."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class InlineTensor:
    """Stand-in for a tensor pickled inline (`torch._utils._rebuild_tensor_v2` over an `InlineStorage`)."""

    __slots__ = ("shape",)

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def __repr__(self) -> str:
        return f"<tensor {list(self.shape)}>"


def _load_from_bytes(data: Any) -> InlineStorage:
    if type(data) is not bytes:
        raise ValueError("_load_from_bytes takes bytes")
    return InlineStorage(len(data))


def _inline_tensor(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    metadata: Any = None,
) -> InlineTensor:
    if type(storage) is not InlineStorage or type(storage_offset) is not int:
        raise ValueError("an inline tensor needs inline storage bytes")
    if type(size) is not tuple or len(size) > MAX_DIMS or not all(type(d) is int for d in size):
        raise ValueError("a tensor size must be a short tuple of integers")
    return InlineTensor(size)


#: What a plain-pickled data loader state may name: the whole-file allowlist (numpy RNG states, ordered
#: dicts, sets), with tensors pickled inline kept as opaque bytes.
DATALOADER_GLOBALS: Mapping[tuple[str, str], Any] = collections.ChainMap(
    {
        ("torch.storage", "_load_from_bytes"): _load_from_bytes,
        ("torch._utils", "_rebuild_tensor_v2"): _inline_tensor,
    },
    TORCH_PICKLE_GLOBALS,  # type: ignore[arg-type]
)


def read_dataloader_info(url: str) -> Any:
    """The unpickled `dataloader_info.pkl` (a list with one state per rank, or one state).

    Raises:
        UnsafePickle: the pickle names a global outside `DATALOADER_GLOBALS` (nothing of it ran).
        CorruptCheckpoint: it does not parse, or is larger than any data loader state.
    """
    data = io.read_bytes(url, 0, _MAX_INFO_BYTES + 1)
    if len(data) > _MAX_INFO_BYTES:
        raise CorruptCheckpoint(f"{url}: larger than {_MAX_INFO_BYTES >> 20} MiB, not a data loader state")
    states = safe_loads(data, DATALOADER_GLOBALS, url)
    check_nesting(states, url)  # a data loader state is user data: nothing else bounds its shape
    return states


# --------------------------------------------------------------------------------------------------
# recover_info/
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RecoverInfo:
    """`recover_info/` as far as a listing and `step_info.json` tell (None: the folder is missing)."""

    url: str
    entries: dict[str, DirEntry] | None
    step_info: dict[str, Any] | None
    error: str = ""

    @property
    def global_step(self) -> int | None:
        value = (self.step_info or {}).get("global_step")
        return value if type(value) is int else None

    @property
    def epoch(self) -> float | None:
        value = (self.step_info or {}).get("epoch")
        return float(value) if type(value) is int and value >= 0 else None


def _recover_info(slot_url: str) -> _RecoverInfo:
    """The trial's `recover_info/` for the slot at `slot_url` (`<trial>/<model>/recover_checkpoint`)."""
    url = io.join(io.parent_of(io.parent_of(slot_url)), RECOVER_INFO)
    try:  # listed afresh (not `peek_dir`): AReaL rewrites these files in place, and their times matter here
        listing = io.list_dir(url)
    except CkptctlError:
        listing = None
    if listing is None:
        return _RecoverInfo(url, None, None, f"no {RECOVER_INFO}/ beside the model folders")
    entries = {e.name: e for e in listing if not e.is_dir}
    if STEP_INFO not in entries:
        return _RecoverInfo(url, entries, None, f"no {RECOVER_INFO}/{STEP_INFO}")
    try:
        step_info = read_json(io.join(url, STEP_INFO), max_bytes=_MAX_INFO_BYTES)
    except CkptctlError as exc:
        return _RecoverInfo(url, entries, None, f"{RECOVER_INFO}/{STEP_INFO} does not parse: {exc.message}")
    if not isinstance(step_info, dict) or not all(_is_counter(step_info.get(k)) for k in _STEP_FIELDS):
        return _RecoverInfo(url, entries, None, f"{RECOVER_INFO}/{STEP_INFO} lacks {', '.join(_STEP_FIELDS)}")
    if step_info["epoch"] < 0 or step_info["global_step"] < 0:
        return _RecoverInfo(url, entries, step_info, f"{RECOVER_INFO}/{STEP_INFO} records no finished step")
    return _RecoverInfo(url, entries, step_info)


def _slot_problem(entries: Sequence[DirEntry], info: _RecoverInfo) -> str:
    """Why the slot and its info do not make a finished save ("" when they do), from listings."""
    by_name = {e.name: e for e in entries if not e.is_dir}
    meta = by_name.get(METADATA_NAME)
    if meta is None:
        return f"no {METADATA_NAME}: the save has not finished"
    if METADATA_NAME + ".tmp" in by_name:
        return f"{METADATA_NAME}.tmp present: the slot is being overwritten"
    newer = data_newer_than_metadata(list(by_name.values()))
    if newer:
        return (
            f"{newer[0]} is newer than {METADATA_NAME}: an in-place overwrite of the slot did not finish (the data "
            "files no longer match the metadata)"
        )
    if info.error:
        return f"{info.error}: AReaL would start from scratch"
    torn = torn_info_files(meta.mtime, (info.entries or {}).values())
    if torn:
        return (
            f"{RECOVER_INFO}/{torn[0]} is older than the weights: the save was torn between the slot and its info "
            "files (AReaL would pair the new weights with the old counters)"
        )
    return ""


def _unfinished(entries: Sequence[DirEntry], info: _RecoverInfo) -> CheckpointState:
    """In progress while the newest file of the save is fresh, else broken."""
    times = [newest_mtime(entries) or 0.0, *(e.mtime for e in (info.entries or {}).values())]
    return unfinished_state(max(times))


def _is_counter(value: Any) -> bool:
    """An int as AReaL's counters are (-1 before the first step), within 64 bits."""
    return type(value) is int and -MAX_INT <= value <= MAX_INT


def _read_json(url: str) -> Any:
    try:
        return read_json(url, max_bytes=_MAX_INFO_BYTES)
    except CkptctlError:
        return None


# --------------------------------------------------------------------------------------------------
# The layout.
# --------------------------------------------------------------------------------------------------


class ArealLayout(Layout):
    """AReaL's recover slot (`<model>/recover_checkpoint` + `recover_info/`) or a Saver export
    (`<model>/epoch{E}epochstep{S}globalstep{G}`)."""

    name = "areal"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """The slot by its name and DCP files (reads `recover_info/step_info.json`); an export by its name."""
        name = io.name_of(url)
        if m := EXPORT_RE.match(name):
            return self._export(url, entries, m)
        if name != RECOVER_SLOT or io.name_of(io.parent_of(url)) == RECOVER_INFO:
            return None
        names = {e.name for e in entries if not e.is_dir}
        if not (names & {METADATA_NAME, METADATA_NAME + ".tmp"} or names & _MEGATRON_FILES) and not any(
            DISTCP_RE.match(n) for n in names
        ):
            return None
        info = _recover_info(url)
        note = _slot_problem(entries, info)
        meta = next((e for e in entries if e.name == METADATA_NAME and not e.is_dir), None)
        state = _unfinished(entries, info) if note else CheckpointState.COMPLETE
        if note and meta is not None and (unreadable := _unreadable_metadata(url)):
            # Read only when the times already say unfinished: they cannot tell a save under way from a damaged
            # `.metadata`, its contents can.
            state, note = CheckpointState.BROKEN, unreadable
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=info.global_step,
            epoch=info.epoch,
            created=timestamp(meta.mtime if meta is not None else newest_mtime(entries)),
            state=state,
            size_bytes=sum(e.size for e in entries if not e.is_dir),
            note=note,
        )

    def _export(self, url: str, entries: Sequence[DirEntry], m: re.Match[str]) -> CheckpointRef | None:
        epoch, global_step = int(m.group(1)), int(m.group(3))
        if m.group(4):
            return CheckpointRef(
                url,
                self.name,
                global_step,
                float(epoch),
                timestamp(newest_mtime(entries)),
                unfinished_state(newest_mtime(entries)),
                sum(e.size for e in entries if not e.is_dir),
                note="an export still named *.tmp: not renamed into place yet",
            )
        ref = HfFolderLayout().identify(url, entries)
        if ref is None:
            # Named as the Saver's export but without weights: a torn export, never nothing (`FSDPEngine.
            # _save_model_to_hf` writes into this folder itself, under no staging name).
            newest = newest_mtime(entries)
            return CheckpointRef(
                url,
                self.name,
                global_step,
                float(epoch),
                timestamp(newest),
                unfinished_state(newest),
                sum(e.size for e in entries if not e.is_dir),
                note=_NO_WEIGHTS,
            )
        return replace(ref, layout=self.name, step=global_step, epoch=float(epoch))

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """`recover_checkpoint` in a model folder whose trial has `recover_info/step_info.json`: the slot is
        what `recover.mode=on` resumes from."""
        if io.name_of(url) == RECOVER_INFO or not any(e.name == RECOVER_SLOT and e.is_dir for e in entries):
            return None
        info = peek_dir(io.join(io.parent_of(url), RECOVER_INFO)) or []
        return RECOVER_SLOT if any(e.name == STEP_INFO for e in info) else None

    def companions(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """`recover_info/` of a trial folder: part of its recover slots, not a checkpoint of its own.

        The slot (a flat DCP folder) and the exports (HF model folders) have no member folders of their
        own (`Layout.members`' default)."""
        return frozenset({RECOVER_INFO}) if any(e.name == RECOVER_INFO and e.is_dir for e in entries) else frozenset()

    def open(self, url: str) -> Checkpoint:
        """The slot: DCP components and world size, `recover_info/` counters and data loader state, a lazy
        DCP tensor index. An export: the model folder."""
        entries = io.list_dir(url)
        ref = self.identified(url, entries, "an AReaL checkpoint (recover_checkpoint/ or epoch*epochstep*globalstep*/)")
        if EXPORT_RE.match(io.name_of(url)):
            return self._open_export(url, ref)
        info = _recover_info(url)
        files = {e.name: e.size for e in entries if not e.is_dir}
        components: set[Component] = set()
        progress = dict(info.step_info or {})
        metadata: dict[str, Any] = {
            "format": "areal",
            "kind": "recover",
            "model": io.name_of(io.parent_of(url)),
            "progress": progress,
            "resume_setting": "recover.mode=on (same experiment_name, trial_name and allocation_mode)",
        }
        metadata.update(self._info_summary(info, components))
        if _MEGATRON_FILES & set(files):
            metadata["megatron"] = _read_json(io.join(url, "metadata.json")) if "metadata.json" in files else True
        referenced: dict[str, int] | None = None
        try:
            dcp = load_dcp_metadata(url)
        except CkptctlError as exc:
            metadata["error"] = exc.message
            tensor_index = raising_index(exc)
            if ref.state is CheckpointState.COMPLETE:
                ref = replace(ref, state=CheckpointState.BROKEN, note=exc.message)
        else:
            classify = component_classifier(dcp.entries)
            components |= classify.components
            referenced = dcp.referenced_files()
            metadata.update(dcp_version=dcp.version, keys=len(dcp.entries), storage_files=len(referenced))

            @cache
            def tensor_index() -> tuple[TensorEntry, ...]:
                return index_from_metadata(dcp, classify)

        return Checkpoint(
            ref=ref,
            components=frozenset(components),
            world_size=world_size_of(entries, referenced),
            metadata=metadata,
            tensor_index=tensor_index,
            files=files,
            progress=progress,
        )

    @staticmethod
    def _info_summary(info: _RecoverInfo, components: set[Component]) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        present = info.entries or {}
        if info.step_info is not None:
            components.add(Component.TRAINER_STATE)
        stats = _read_json(io.join(info.url, "stats_logger_info.json")) if "stats_logger_info.json" in present else None
        if isinstance(stats, dict) and "last_commit_step" in stats:
            summary["last_commit_step"] = stats["last_commit_step"]
        if any(n in present for n in ("saver_info.json", "evaluator_info.json", "checkpoint_info.json")):
            components.add(Component.EXTRA)
        summary["recover_info"] = sorted(n for n in present if n in INFO_FILES)
        if DATALOADER_INFO in present:
            try:
                states = read_dataloader_info(io.join(info.url, DATALOADER_INFO))
            except CkptctlError as exc:
                summary["dataloader_error"] = exc.message
            else:
                components.add(Component.DATALOADER)
                summary["dataloader_ranks"] = len(states) if isinstance(states, list) else 1
        return summary

    def _open_export(self, url: str, ref: CheckpointRef) -> Checkpoint:
        m = EXPORT_RE.match(io.name_of(url))
        assert m is not None
        progress = {"epoch": int(m.group(1)), "epoch_step": int(m.group(2)), "global_step": int(m.group(3))}
        metadata = {"format": "areal", "kind": "hf_export", "progress": progress}
        files = {e.name: e.size for e in io.list_dir(url) if not e.is_dir}
        if m.group(4) or not has_weights(files):  # not renamed into place yet, or torn: nothing to index
            return Checkpoint(ref, frozenset(), None, metadata, tuple, files, role=Role.EXPORT, progress=progress)
        model = HfFolderLayout().open(url)
        return replace(model, ref=ref, metadata={**metadata, **model.metadata}, role=Role.EXPORT, progress=progress)

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """The slot: DCP's rules, the in-place overwrite and torn-save checks, and every `recover_info/`
        file present and parsing (`dataloader_info.pkl` safely, one state per rank). An export: the HF
        model rules."""
        url = checkpoint.url
        if EXPORT_RE.match(io.name_of(url)):
            if io.name_of(url).endswith(".tmp"):
                return [Problem(ProblemKind.IN_PROGRESS, "", "the export has not been renamed into place")]
            if not has_weights(checkpoint.files):
                return [Problem(ProblemKind.MISSING_FILE, "model.safetensors", _NO_WEIGHTS)]
            return verify_model_files(url, checkpoint.files)
        entries = io.list_dir(url)
        problems = verify_dcp(url)
        info = _recover_info(url)
        meta = next((e for e in entries if e.name == METADATA_NAME and not e.is_dir), None)
        if meta is not None:
            newer = data_newer_than_metadata(entries)
            if newer:
                problems.append(
                    Problem(
                        ProblemKind.BAD_METADATA,
                        METADATA_NAME,
                        f"{', '.join(newer[:4])} {'is' if len(newer) == 1 else 'are'} newer than {METADATA_NAME}: the "
                        "slot was overwritten in place and the save did not finish, so the data no longer matches "
                        "the metadata (a copy that did not keep file times looks the same)",
                    )
                )
        problems += _info_problems(info, meta, checkpoint.world_size)
        return problems

    def load_set(self, checkpoint: Checkpoint) -> Sequence[LoadMember]:
        """An export's tokenizer, when it has one: AReaL's tokenizer is a fast one (areal/utils/hf_utils.py:
        `load_hf_tokenizer`, `AutoTokenizer.from_pretrained`), which `FSDPEngine._save_model_to_hf`
        (areal/engine/fsdp_engine.py) saves beside the weights (`tokenizer.save_pretrained`) as tokenizer.json
        and tokenizer_config.json. `AutoTokenizer.from_pretrained` fails without tokenizer.json (the config
        names a fast-only class), and without tokenizer_config.json loads it with the special tokens lost.
        The slot's files are `verify`'s own rules (DCP's and `recover_info/`'s)."""
        if checkpoint.role is not Role.EXPORT or not checkpoint.files.keys() & _EXPORT_TOKENIZER:
            return ()
        return [
            LoadMember(name, MemberKind.JSON, f"the tokenizer's {name}", "transformers AutoTokenizer.from_pretrained")
            for name in sorted(_EXPORT_TOKENIZER)
        ]

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """The slot: DCP's `.metadata` and Megatron's `metadata.json`; an export: the model folder's."""
        top = {name: size for name, size in files.items() if "/" not in name}
        slot = tuple(name for name in (METADATA_NAME, "metadata.json") if name in top)
        return slot or model_markers(top)

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.areal.resume`."""
        from ckptctl.frameworks.areal.resume import PROFILE

        return PROFILE


def _unreadable_metadata(url: str) -> str:
    """Why the slot's `.metadata` does not parse ("" when it does). torch DCP writes it under `.metadata.tmp`
    and renames it into place (torch/distributed/checkpoint/filesystem.py: `_FileSystemWriter.finish`), so one
    that does not parse is damage, never a save under way."""
    try:
        load_dcp_metadata(url)
    except CkptctlError as exc:
        return f"{METADATA_NAME} does not parse: {exc.message}"
    return ""


def _info_problems(info: _RecoverInfo, meta: DirEntry | None, world_size: int | None) -> list[Problem]:
    if info.entries is None:
        return [
            Problem(
                ProblemKind.MISSING_FILE,
                _INFO_PREFIX,
                f"{RECOVER_INFO}/ is missing: AReaL finds nothing to recover and starts from scratch",
            )
        ]
    problems = []
    torn = set(torn_info_files(meta.mtime, info.entries.values())) if meta is not None else set()
    for name in INFO_FILES:
        path = _INFO_PREFIX + name
        entry = info.entries.get(name)
        if entry is None:
            problems.append(
                Problem(ProblemKind.MISSING_FILE, path, f"{name} is missing: AReaL's recover fails and starts over")
            )
            continue
        if name in torn:
            problems.append(
                Problem(
                    ProblemKind.BAD_METADATA,
                    path,
                    f"{name} is older than the slot's {METADATA_NAME}: the save was torn between the weights and "
                    "the info files, so a recover pairs the new weights with the old counters",
                )
            )
        if name == DATALOADER_INFO:
            problems += _dataloader_problems(io.join(info.url, name), path, world_size)
        elif _read_json(io.join(info.url, name)) is None:
            problems.append(Problem(ProblemKind.BAD_METADATA, path, f"{name} is not valid JSON"))
    if STEP_INFO in info.entries and info.error:
        problems.append(Problem(ProblemKind.BAD_METADATA, _INFO_PREFIX + STEP_INFO, info.error))
    return problems


def _dataloader_problems(url: str, path: str, world_size: int | None) -> list[Problem]:
    try:
        states = read_dataloader_info(url)
    except CkptctlError as exc:
        return [Problem.of_unreadable(exc, path, ProblemKind.BAD_METADATA)]
    if isinstance(states, list) and world_size is not None and len(states) != world_size:
        return [
            Problem(
                ProblemKind.BAD_METADATA,
                path,
                f"holds {len(states)} data loader states but the slot was written by {world_size} ranks: a recover "
                "on this world size fails its length check",
                severity="warning",
            )
        ]
    return []
