"""ROLL checkpoints: `checkpoint-N` folders merged from every worker's upload (LAYOUTS.md, ROLL).

```
{checkpoint_config.output_dir}/{YYYYmmdd-HHMMSS}/      a new timestamp folder per launch
    checkpoint-{global_step}/                          no completion marker
        pipeline/worker_state_pipeline.json            {"kv": {...}, "log_history": [...], "step": N}
        pipeline/rng_state_pipeline.pth                the driver's RNG state
        FSDP2:    HF weights + config + tokenizer, dcp/ (torch DCP: model keys, optimizer.*, scheduler.*, rng_state.*)
        Megatron: mca_config.json, latest_checkpointed_iteration.txt, iter_0000001/ (mp_rank_*/model_optim_rng.pt,
                  or dist_model/ + dist_optimizer/ Megatron dist-ckpt), scheduler.pt, rng_state/rng_state_{rank}.pth
        critic/                                        the same for the critic (GAE only)
```

The actor (the folder's top) and the critic (`critic/`) of one step are ONE checkpoint: ROLL uploads them
into the same folder, resumes both from the one `resume_from_checkpoint` path, and prunes the folder as a
whole. The critic's tensors are indexed as `critic.<name>` with chunk files under `critic/`.

Uploads run in the background on every node, so a folder may hold only some ranks' files; there is no
marker to say it is done. `list` checks what listings can tell (the pipeline state, DCP `.metadata` and
data files of ranks 0..max, HF shards by name, Megatron's tracker and per-rank RNG files) and calls a
folder that fails in progress while its newest file is fresh, broken after; `verify` checks every file
`.metadata` and the HF index reference. Megatron folders are checked by file presence; their tensor index
covers what Megatron's dist-ckpt DCP metadata describes (legacy `model_optim_rng.pt` files are not
indexed). ROLL keeps no `latest` pointer: its auto-resume looks inside the new launch's timestamp folder,
so the explicit path is what resumes.
"""

from __future__ import annotations

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
    TensorEntry,
)
from ckptctl.contract.base import (
    Layout,
    absent_numbers,
    every_child_folder,
    folder_size,
    list_files,
    newest_mtime,
    timestamp,
)
from ckptctl.contract.load_set import LoadMember, MemberKind
from ckptctl.errors import CkptctlError
from ckptctl.families.dcp_folder import (
    DISTCP_RE,
    component_for_prefix,
    dcp_tensor_index,
    one_component,
    verify_dcp,
    world_size_of,
)
from ckptctl.families.hf_folder import (
    has_weights,
    missing_shards,
    model_components,
    model_markers,
    model_metadata,
    safetensors_index,
    verify_model_files,
    weight_files,
)
from ckptctl.families.in_progress import unfinished_state
from ckptctl.formats.dcp_folder_metadata import load_dcp_metadata
from ckptctl.formats.dcp_metadata import METADATA_NAME
from ckptctl.formats.documents import read_json
from ckptctl.formats.slim_marker import SLIM_MARKER
from ckptctl.formats.torch_pickle import open_torch_pickle
from ckptctl.frameworks.roll.files import CRITIC, DCP_FOLDER, MCA_CONFIG, PIPELINE_RNG, PIPELINE_STATE, RNG_DIR, TRACKER
from ckptctl.io import DirEntry
from ckptctl.quoting import yaml_value

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = ["RollLayout"]

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_ITER = re.compile(r"^iter_(\d{7})$")
_MP_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_RNG_FILE = re.compile(r"^rng_state_(\d+)\.pth$")
_DIST_DIRS = {"dist_model": Component.MODEL, "dist_optimizer": Component.OPTIMIZER}
_MEGATRON_MARKERS = frozenset({MCA_CONFIG, TRACKER})
_PARALLELISM = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "context_parallel_size",
    "virtual_pipeline_model_parallel_size",
)
_MAX_JSON_BYTES = 256 << 20
_MAX_SCALARS = 64


def _component(key: str) -> Component:
    """ROLL's DCP keys: the model's own keys at the top, then `optimizer.*`, `scheduler.*`, `rng_state.*`."""
    first = key.partition(".")[0]
    if first in ("optimizer", "scheduler", "rng_state"):
        return component_for_prefix(first) or Component.EXTRA
    return Component.MODEL


# --------------------------------------------------------------------------------------------------
# One role (the actor at the top, the critic in critic/), from listings.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Role:
    """What a role folder holds, from its listing (and its dcp/, rng_state/ and iter_* listings).

    Attributes:
        prefix: "" for the actor, "critic/" for the critic (relative to the checkpoint).
        url: the role folder.
        names: its top-level file names.
        dirs: its top-level folder names.
        dcp: the listing of dcp/ (None when there is none).
        strategy: "fsdp2", "megatron" or "" (no weights found).
    """

    prefix: str
    url: str
    names: frozenset[str]
    dirs: frozenset[str]
    dcp: tuple[DirEntry, ...] | None
    strategy: str

    @classmethod
    def read(cls, url: str, prefix: str, entries: Sequence[DirEntry] | None = None) -> _Role:
        entries = io.list_dir(url) if entries is None else entries
        names = frozenset(e.name for e in entries if not e.is_dir)
        dirs = frozenset(e.name for e in entries if e.is_dir)
        dcp = tuple(io.list_dir(io.join(url, DCP_FOLDER))) if DCP_FOLDER in dirs else None
        if names & _MEGATRON_MARKERS or any(_ITER.match(d) for d in dirs):
            strategy = "megatron"
        elif dcp is not None or has_weights(names):
            strategy = "fsdp2"
        else:
            strategy = ""
        return cls(prefix, url, names, dirs, dcp, strategy)

    def rng_ranks(self) -> list[int]:
        if RNG_DIR not in self.dirs:
            return []
        return sorted(
            int(m.group(1)) for e in io.list_dir(io.join(self.url, RNG_DIR)) if (m := _RNG_FILE.match(e.name))
        )

    def iteration_dir(self) -> str | None:
        """The `iter_*` folder Megatron's tracker names (else the only one there is)."""
        if TRACKER in self.names:
            try:
                text = io.read_bytes(io.join(self.url, TRACKER), 0, 64).decode("ascii").strip()
            except (CkptctlError, UnicodeDecodeError):
                text = ""
            if text.isdigit():
                return f"iter_{int(text):07d}"
            if text == "release":
                return "release"
        found = sorted(d for d in self.dirs if _ITER.match(d))
        return found[-1] if found else None

    def listing_problems(self) -> list[str]:
        """What the listings show missing (cheap enough for `list`)."""
        where = self.prefix or "the actor"
        if self.strategy == "":
            return [f"{where}: no model weights (no HF weights, dcp/ or Megatron files)"]
        problems = [f"missing {self.prefix}{n}" for n in missing_shards(self.names)]
        if self.strategy == "fsdp2" and self.dcp is not None:
            problems += _dcp_listing_problems(self.dcp, f"{self.prefix}{DCP_FOLDER}/")
        if self.strategy == "megatron":
            if TRACKER not in self.names:
                problems.append(f"no {self.prefix}{TRACKER}")
            iteration = self.iteration_dir()
            if iteration is None or iteration not in self.dirs:
                problems.append(f"no {self.prefix}{iteration or 'iter_*'}/ folder")
            ranks = self.rng_ranks()
            gaps = absent_numbers(ranks, max(ranks) + 1, 8)[0] if ranks else []
            if gaps:
                problems.append(f"no {self.prefix}{RNG_DIR}/ files of rank(s) {', '.join(map(str, gaps))}")
        return problems


def _dcp_listing_problems(entries: Sequence[DirEntry], where: str) -> list[str]:
    names = {e.name for e in entries if not e.is_dir}
    ranks = {int(m.group(1)) for n in names if (m := DISTCP_RE.match(n))}
    problems = []
    if METADATA_NAME not in names:
        problems.append(f"no {where}{METADATA_NAME}")
    gaps = absent_numbers(ranks, max(ranks) + 1, 8)[0] if ranks else []
    if gaps:
        # Each rank writes at least its first file, `__{rank}_0.distcp` (torch's `FileSystemWriter`,
        # torch/distributed/checkpoint/filesystem.py: `_split_by_size_and_type` numbers a rank's files from 0):
        # naming it tells a person, and `verify` of a save still in progress, which file has not arrived.
        files = ", ".join(f"{where}__{rank}_0.distcp" for rank in gaps)
        problems.append(f"no {files} (no {where} data files of rank(s) {', '.join(map(str, gaps))})")
    return problems


def _roles(url: str, entries: Sequence[DirEntry]) -> list[_Role]:
    roles = [_Role.read(url, "", entries)]
    if any(e.name == CRITIC and e.is_dir for e in entries):
        roles.append(_Role.read(io.join(url, CRITIC), f"{CRITIC}/"))
    return roles


def _is_roll(entries: Sequence[DirEntry]) -> bool:
    """A `checkpoint-N` of ROLL: its pipeline folder, its FSDP2 `dcp/`, or mcore_adapter's files."""
    names = {e.name for e in entries}
    return bool(names & {"pipeline", DCP_FOLDER} or names & _MEGATRON_MARKERS)


def _read_pipeline_state(url: str) -> dict[str, Any] | None:
    try:
        doc = read_json(io.join(url, *PIPELINE_STATE.split("/")), max_bytes=_MAX_JSON_BYTES)
    except CkptctlError:
        return None
    return doc if isinstance(doc, dict) else None


def _scalars(doc: Any, prefix: str = "", depth: int = 0) -> dict[str, Any]:
    """The scalar values of a JSON object, nested objects flattened to dotted keys (a few levels, a few dozen
    values: `kv` may also hold large data-scheduler states)."""
    found: dict[str, Any] = {}
    if not isinstance(doc, dict):
        return found
    for key, value in doc.items():
        if type(value) in (int, float, str, bool):
            found[f"{prefix}{key}"] = value
        elif isinstance(value, dict) and depth < 2:
            found.update(_scalars(value, f"{prefix}{key}.", depth + 1))
        if len(found) >= _MAX_SCALARS:
            break
    return found


# --------------------------------------------------------------------------------------------------
# The layout.
# --------------------------------------------------------------------------------------------------


class RollLayout(Layout):
    """A ROLL `checkpoint-N` folder (FSDP2 or Megatron, with or without `critic/`)."""

    name = "roll"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A `checkpoint-N` with ROLL's folders; its state from the listings of pipeline/, dcp/ and critic/."""
        m = _CHECKPOINT.match(io.name_of(url))
        if m is None or not _is_roll(entries):
            return None
        problems = []
        pipeline = io.list_dir(io.join(url, "pipeline")) if any(e.name == "pipeline" for e in entries) else []
        names = {e.name for e in pipeline}
        # `BasePipeline.do_checkpoint` writes both pipeline files before any upload: a folder without either
        # did not finish (or lost it since); `slim` drops the RNG state on purpose (and says so in its marker).
        expected = (PIPELINE_STATE,) if any(e.name == SLIM_MARKER for e in entries) else (PIPELINE_STATE, PIPELINE_RNG)
        problems += [f"no {rel}" for rel in expected if rel.rpartition("/")[2] not in names]
        for role in _roles(url, entries):
            problems += role.listing_problems()
        state = CheckpointState.COMPLETE
        newest = max([newest_mtime(entries) or 0.0, *(e.mtime for e in pipeline)])
        if problems:
            state = unfinished_state(newest)
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=int(m.group(1)),
            epoch=None,
            created=timestamp(newest or None),
            state=state,
            size_bytes=folder_size(url, entries),
            note="; ".join(problems[:3]) + (" ..." if len(problems) > 3 else ""),
        )

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """ROLL keeps no pointer (`resume_from_checkpoint` takes the path)."""
        return None

    def members(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """Every child folder (`pipeline/`, `dcp/`, `critic/`, Megatron's `iter_*/`, `rng_state/`): every
        worker uploads into the one `checkpoint-N/`, and ROLL prunes it as a whole."""
        return every_child_folder(entries)

    def open(self, url: str) -> Checkpoint:
        """Pipeline counters and last metrics, each role's strategy, components, world size and parallelism;
        the tensor index reads HF headers and DCP `.metadata` files on first use."""
        entries = io.list_dir(url)
        ref = self.identified(url, entries, "a ROLL checkpoint (checkpoint-N with pipeline/, dcp/ or Megatron files)")
        roles = _roles(url, entries)
        files = list_files(url)
        components: set[Component] = set()
        metrics: dict[str, Any] = {}
        metadata: dict[str, Any] = {"format": "roll", "resume_setting": f"resume_from_checkpoint: {yaml_value(url)}"}
        progress: dict[str, Any] = {}
        rng_keys: list[str] | None = None
        doc = _read_pipeline_state(url)
        if doc is not None:
            components.add(Component.TRAINER_STATE)
            step = doc.get("step")
            progress = metadata["progress"] = {"step": step, **_scalars(doc.get("kv"), "kv.")}
            history = doc.get("log_history")
            if isinstance(history, list) and history:
                metrics = metadata["metrics"] = _scalars(history[-1])
            if type(step) is int and step != ref.step:
                metadata["note"] = f"the pipeline state says step {step}, the folder name {ref.step}"
        if PIPELINE_RNG in files:
            components.add(Component.RNG)
            rng_keys = metadata["rng_keys"] = _rng_keys(io.join(url, *PIPELINE_RNG.split("/")), files[PIPELINE_RNG])
        world_sizes = {}
        for role in roles:
            info = self._role_info(role, components)
            metadata[role.prefix.rstrip("/") or "actor"] = info
            world_sizes[role.prefix] = info.get("world_size")
        actor = roles[0]

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            return tuple(entry for role in roles for entry in _role_index(role, files))

        return Checkpoint(
            ref=ref,
            components=frozenset(components),
            world_size=world_sizes.get(actor.prefix),
            metadata=metadata,
            tensor_index=tensor_index,
            files=files,
            progress=progress,
            metrics=metrics,
            rng_keys=None if rng_keys is None else frozenset(rng_keys),
        )

    @staticmethod
    def _role_info(role: _Role, components: set[Component]) -> dict[str, Any]:
        info: dict[str, Any] = {"strategy": role.strategy or None}
        components |= model_components(set(role.names))
        if has_weights(role.names):
            info.update(model_metadata(role.url, set(role.names), weight_files(role.url, set(role.names))))
        if role.strategy == "fsdp2" and role.dcp is not None:
            try:
                meta = load_dcp_metadata(io.join(role.url, DCP_FOLDER))
            except CkptctlError as exc:
                info["dcp_error"] = exc.message
                info["world_size"] = world_size_of(role.dcp)
            else:
                components |= {_component(k) for k in meta.entries}
                info["world_size"] = world_size_of(role.dcp, meta.referenced_files())
                info["dcp_keys"] = len(meta.entries)
        if role.strategy == "megatron":
            config = _read_json(io.join(role.url, MCA_CONFIG)) if MCA_CONFIG in role.names else None
            if isinstance(config, dict):
                info["parallelism"] = {k: config[k] for k in _PARALLELISM if k in config}
            iteration = role.iteration_dir()
            info["iteration"] = iteration
            inside = {e.name for e in io.list_dir(io.join(role.url, iteration))} if iteration in role.dirs else set()
            info["mp_ranks"] = sorted(d for d in inside if _MP_RANK.match(d))
            if inside & set(_DIST_DIRS) or info["mp_ranks"]:
                components.add(Component.MODEL)
            if "dist_optimizer" in inside or any(
                io.exists(io.join(role.url, iteration or "", d, "optimizer.pt")) for d in info["mp_ranks"]
            ):
                components.add(Component.OPTIMIZER)
            if "scheduler.pt" in role.names:
                components.add(Component.SCHEDULER)
            ranks = role.rng_ranks()
            if ranks:
                components.add(Component.RNG)
                info["world_size"] = max(ranks) + 1
        return info

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """The pipeline state present and parsing; per role the HF model rules, DCP's rules for `dcp/`, and
        Megatron's files by presence (tracker → iteration folder, per-rank model files, dist-ckpt metadata,
        scheduler, one RNG file per rank 0..n-1)."""
        url = checkpoint.url
        entries = io.list_dir(url)
        problems: list[Problem] = []
        if PIPELINE_STATE not in checkpoint.files:
            problems.append(
                Problem(
                    ProblemKind.MISSING_FILE,
                    PIPELINE_STATE,
                    "the pipeline state is missing: the save (or its upload) did not finish",
                )
            )
        else:
            doc = _read_pipeline_state(url)
            if doc is None or type(doc.get("step")) is not int:
                problems.append(Problem(ProblemKind.BAD_METADATA, PIPELINE_STATE, "does not parse or has no step"))
            elif doc["step"] != checkpoint.ref.step:
                problems.append(
                    Problem(
                        ProblemKind.BAD_METADATA,
                        PIPELINE_STATE,
                        f"says step {doc['step']} but the folder is checkpoint-{checkpoint.ref.step}",
                        severity="warning",
                    )
                )
        for role in _roles(url, entries):
            problems += _role_problems(role, checkpoint.files)
        return problems

    def load_set(self, checkpoint: Checkpoint) -> Sequence[LoadMember]:
        """The driver's RNG state (the pipeline state and each role's files are the layout's own rules).

        ROLL's pipelines restore it on resume through `WorkerState.load_rng_state(<checkpoint>/pipeline,
        "pipeline")` (roll/utils/worker_state.py; `BasePipeline.__init__`, roll/pipeline/base_pipeline.py, reads
        the pipeline state beside it). Without the file that function logs at info level and returns: the
        driver's python, numpy, CPU and device RNG streams restart from the seed, silently. An error. (Read from
        ROLL's source: ROLL does not install here.)
        """
        return (
            LoadMember(
                PIPELINE_RNG,
                MemberKind.TORCH_SAVE,
                "the pipeline driver's RNG state",
                "ROLL WorkerState.load_rng_state (else the driver's RNG restarts from the seed)",
            ),
        )

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """ROLL writes no marker, but `list` reads a folder as not complete without any of these: per role
        (the actor, `critic/`) the model folder's markers, `dcp/.metadata` and Megatron's tracker; then the
        pipeline state."""
        found: list[str] = []
        for prefix in ("", f"{CRITIC}/"):
            top = {
                n[len(prefix) :]: size
                for n, size in files.items()
                if n.startswith(prefix) and "/" not in n[len(prefix) :]
            }
            found += [prefix + name for name in model_markers(top)]
            found += [prefix + name for name in (f"{DCP_FOLDER}/{METADATA_NAME}", TRACKER) if prefix + name in files]
        return (*found, PIPELINE_STATE) if PIPELINE_STATE in files else tuple(found)

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.roll.resume`."""
        from ckptctl.frameworks.roll.resume import PROFILE

        return PROFILE


def _role_problems(role: _Role, files: Mapping[str, int]) -> list[Problem]:
    prefix = role.prefix
    if role.strategy == "":
        return [Problem(ProblemKind.MISSING_FILE, prefix, "no model weights (no HF weights, dcp/ or Megatron files)")]
    problems = []
    if has_weights(role.names):
        top = {n: s for n, s in files.items() if n.startswith(prefix) and "/" not in n[len(prefix) :]}
        problems += [
            replace(p, path=prefix + p.path)
            for p in verify_model_files(role.url, {n[len(prefix) :]: s for n, s in top.items()})
        ]
    if role.strategy == "fsdp2" and role.dcp is not None:
        problems += verify_dcp(io.join(role.url, DCP_FOLDER), f"{prefix}{DCP_FOLDER}/")
    if role.strategy == "megatron":
        problems += _megatron_problems(role)
    return problems


def _megatron_problems(role: _Role) -> list[Problem]:
    prefix = role.prefix
    problems = []
    if TRACKER not in role.names:
        problems.append(Problem(ProblemKind.MISSING_FILE, prefix + TRACKER, f"{TRACKER} is missing"))
    if MCA_CONFIG not in role.names:
        problems.append(Problem(ProblemKind.MISSING_FILE, prefix + MCA_CONFIG, f"{MCA_CONFIG} is missing"))
    iteration = role.iteration_dir()
    if iteration is None or iteration not in role.dirs:
        return [
            *problems,
            Problem(ProblemKind.MISSING_FILE, prefix + (iteration or "iter_*"), "the iteration folder is missing"),
        ]
    inside = {e.name: e for e in io.list_dir(io.join(role.url, iteration))}
    mp_dirs = sorted(n for n, e in inside.items() if e.is_dir and _MP_RANK.match(n))
    config = _read_json(io.join(role.url, MCA_CONFIG))
    tp = config.get("tensor_model_parallel_size") if isinstance(config, dict) else None
    tp_ranks = {int(m.group(1)) for d in mp_dirs if (m := _MP_RANK.match(d))}
    if mp_dirs and type(tp) is int:
        listed, absent = absent_numbers(tp_ranks, tp)
        for rank in listed:
            problems.append(
                Problem(
                    ProblemKind.MISSING_FILE,
                    f"{prefix}{iteration}/mp_rank_{rank:02d}",
                    "model files of this rank are missing",
                )
            )
        if absent > len(listed):
            problems.append(
                Problem(
                    ProblemKind.MISSING_FILE,
                    f"{prefix}{iteration}",
                    f"{absent - len(listed)} more ranks of tensor_model_parallel_size={tp} have no mp_rank folder",
                )
            )
    for d in mp_dirs:
        names = {e.name: e.size for e in io.list_dir(io.join(role.url, iteration, d))}
        if not names.get("model_optim_rng.pt"):
            problems.append(
                Problem(ProblemKind.MISSING_FILE, f"{prefix}{iteration}/{d}/model_optim_rng.pt", "missing or empty")
            )
    for folder in sorted(set(_DIST_DIRS) & set(inside)):
        where = f"{prefix}{iteration}/{folder}/"
        problems += verify_dcp(io.join(role.url, iteration, folder), where)
        dist_names = {e.name for e in io.list_dir(io.join(role.url, iteration, folder))}
        if "metadata.json" not in dist_names:
            problems.append(
                Problem(ProblemKind.MISSING_FILE, where + "metadata.json", "Megatron's dist-ckpt marker is missing")
            )
    if not mp_dirs and "dist_model" not in inside:
        problems.append(
            Problem(ProblemKind.MISSING_FILE, f"{prefix}{iteration}/", "no mp_rank_*/ or dist_model/ inside")
        )
    ranks = role.rng_ranks()
    for rank in absent_numbers(ranks, max(ranks) + 1)[0] if ranks else []:
        problems.append(
            Problem(
                ProblemKind.MISSING_FILE, f"{prefix}{RNG_DIR}/rng_state_{rank}.pth", "this rank's RNG state is missing"
            )
        )
    return problems


def _role_index(role: _Role, files: Mapping[str, int]) -> list[TensorEntry]:
    prefix = role.prefix
    name_prefix = prefix.replace("/", ".")
    entries: list[TensorEntry] = []
    names = set(role.names)
    weights = weight_files(role.url, names) if has_weights(names) else []
    if weights:
        own = {n[len(prefix) :]: s for n, s in files.items() if n.startswith(prefix)}
        entries += _prefixed(safetensors_index(role.url, weights, own), prefix, name_prefix)
    if role.strategy == "fsdp2" and role.dcp is not None:
        skip_model = bool(weights)
        dcp = dcp_tensor_index(io.join(role.url, DCP_FOLDER), _component, f"{prefix}{DCP_FOLDER}/")
        entries += _prefixed(
            tuple(e for e in dcp if not (skip_model and e.component is Component.MODEL)), "", name_prefix
        )
    if role.strategy == "megatron":
        iteration = role.iteration_dir()
        if iteration in role.dirs:
            for folder, component in _DIST_DIRS.items():
                url = io.join(role.url, iteration, folder)
                if component is Component.MODEL and weights:
                    continue
                if io.exists(io.join(url, METADATA_NAME)):
                    inner = dcp_tensor_index(url, one_component(component), f"{prefix}{iteration}/{folder}/")
                    entries += _prefixed(inner, "", name_prefix)
    return entries


def _prefixed(entries: Sequence[TensorEntry], file_prefix: str, name_prefix: str) -> list[TensorEntry]:
    if not file_prefix and not name_prefix:
        return list(entries)
    return [
        replace(
            e,
            name=name_prefix + e.name,
            chunks=tuple(replace(c, file=file_prefix + c.file) for c in e.chunks) if file_prefix else e.chunks,
        )
        for e in entries
    ]


def _read_json(url: str) -> Any:
    try:
        return read_json(url, max_bytes=_MAX_JSON_BYTES)
    except CkptctlError:
        return None


def _rng_keys(url: str, size: int) -> list[str] | None:
    try:
        root = open_torch_pickle(url, size).root
    except CkptctlError:
        return None
    return sorted(map(str, root)) if isinstance(root, dict) else None
