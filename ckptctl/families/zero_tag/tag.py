"""Reading a tag: facts from the rank-0 files.

Everything is read through `formats.torch_pickle` (the `data.pkl` of each file and its zip directory),
so neither DeepSpeed nor torch is needed and no tensor bytes are read to list, inspect or verify.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Component
from ckptctl.contract.base import LISTED_ABSENT, step_from_name
from ckptctl.contract.scan_context import peek, peek_dir
from ckptctl.errors import CkptctlError, CorruptCheckpoint, UnknownLayout
from ckptctl.families.zero_tag.names import TagFiles, expected_rank_files, read_latest, tag_files
from ckptctl.formats.safe_pickle import FrameworkObject, StandIn, state_fields
from ckptctl.formats.torch_pickle import TorchPickle, open_torch_pickle
from ckptctl.io import DirEntry

#: Top-level keys of model_states that DeepSpeed itself writes; every other key is client state.
_ENGINE_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "checkpoint_parallel_dimensions",
        "universal_checkpoint_info",
        "compiled_autograd",
    }
)
#: The same, for the layouts built on DeepSpeed that read client state themselves (OpenRLHF, open-instruct).
ENGINE_KEYS = _ENGINE_KEYS
_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


@dataclass
class DeepSpeedTag:
    """A tag folder opened from its rank-0 files; the other rank files are read on demand (and kept).

    Attributes:
        url: the tag folder.
        files: its rank files.
        states: the rank-0 model states (MP rank 0).
        zero_stage: 0-3 (from the optim states, else `ds_config`).
        dp_world_size: data-parallel ranks (`dp_world_size`).
        mp_world_size: model-parallel ranks (`mp_world_size`).
        partition_count: how many partitions the optimizer state was cut into (None without ZeRO).
        optim_kind: which optimizer wrote the optim files (`zero`, `zero3`, `bf16`), None without them.
    """

    url: str
    files: TagFiles
    states: dict[str, Any]
    zero_stage: int
    dp_world_size: int
    mp_world_size: int
    partition_count: int | None
    optim_kind: str | None
    optim_info: dict[str, Any]
    _opened: dict[str, TorchPickle] = field(default_factory=dict, repr=False)

    def open_file(self, name: str) -> TorchPickle:
        """One rank file, parsed once."""
        found = self._opened.get(name)
        if found is None:
            found = self._opened[name] = open_torch_pickle(io.join(self.url, name), self.files.sizes.get(name))
        return found

    @property
    def global_steps(self) -> int | None:
        value = self.states.get("global_steps")
        return value if type(value) is int else None

    def components(self) -> frozenset[Component]:
        found = {Component.MODEL, Component.TRAINER_STATE}
        if self.files.optim or self.states.get("optimizer") is not None:
            found.add(Component.OPTIMIZER)
        if self.states.get("lr_scheduler") is not None:
            found.add(Component.SCHEDULER)
        if self.states.get("data_sampler") is not None:
            found.add(Component.DATALOADER)
        if self.client_state():
            found.add(Component.EXTRA)
        return frozenset(found)

    def client_state(self) -> dict[str, Any]:
        """The keys `save_checkpoint(client_state=...)` added to the model states."""
        return {k: v for k, v in self.states.items() if isinstance(k, str) and k not in _ENGINE_KEYS}

    def metadata(self) -> dict[str, Any]:
        progress = {k: self.states[k] for k in _COUNTERS if _is_scalar(self.states.get(k))}
        progress.update({k: v for k, v in self.client_state().items() if _is_scalar(v)})
        info: dict[str, Any] = {
            "format": "deepspeed",
            "tag": io.name_of(self.url),
            "zero_stage": self.zero_stage,
            "dp_world_size": self.dp_world_size,
            "mp_world_size": self.mp_world_size,
            "partition_count": self.partition_count,
            "progress": progress,
            "precision": _precision(self.states.get("ds_config"), self.files.bf16),
            "ds_version": self.states.get("ds_version"),
            "model_states_files": len(self.files.model),
            "optim_states_files": len(self.files.optim),
        }
        info.update(self.optim_info)
        others = sorted(k for k, v in self.client_state().items() if not _is_scalar(v))
        if others:
            info["client_state_keys"] = ", ".join(others)
        return info


def _is_scalar(value: Any) -> bool:
    return type(value) in (int, float, str, bool)


def _precision(config: Any, bf16_files: bool) -> str:
    if isinstance(config, dict):
        for key in ("bf16", "bfloat16", "fp16"):
            section = config.get(key)
            if isinstance(section, dict) and section.get("enabled") is True:
                return "fp16" if key == "fp16" else "bf16"
    return "bf16" if bf16_files else "fp32"


def enum_value(value: Any) -> Any:
    """The value of a pickled enum member (`ZeroStageEnum(2)` -> 2); anything else as it is."""
    return value.value if isinstance(value, FrameworkObject) else value


#: The most ranks (dp x mp) a tag may have: far beyond any DeepSpeed job, small enough to enumerate.
MAX_RANKS = 1 << 18


def read_tag(url: str, files: TagFiles | None = None) -> DeepSpeedTag:
    """Open a tag folder: the rank-0 model states (and optim states, when there are any).

    Raises:
        CorruptCheckpoint: no rank-0 model states, or one that does not parse (UnsafePickle included).
    """
    if files is None:
        files = tag_files(io.list_dir(url))
        if files is None:
            raise UnknownLayout(f"{url} holds no DeepSpeed model or optim states")
    rank0 = files.rank0_model()
    if rank0 is None:
        raise CorruptCheckpoint(f"{url}: the rank-0 model states ({files.model_name(0, 0)}) are missing")
    tag = DeepSpeedTag(url, files, {}, 0, 1, 1, None, None, {})
    states = tag.open_file(rank0).root
    if not isinstance(states, dict):
        raise CorruptCheckpoint(f"{url}/{rank0}: not a DeepSpeed model states dict")
    tag.states = states
    tag.dp_world_size, tag.mp_world_size, tag.zero_stage = _recorded_ranks(url, states, files)
    optim0 = files.optim.get((0, 0))
    if optim0 is not None:
        osd = optimizer_state_dict(tag.open_file(optim0))
        stored_stage = enum_value(osd.get("zero_stage"))
        if type(stored_stage) is int:
            tag.zero_stage = stored_stage
        tag.optim_kind = "zero3" if "fp32_flat_groups" in osd else ("zero" if "zero_stage" in osd else "bf16")
        tag.partition_count = read_partition_count(osd.get("partition_count"))
        tag.optim_info = _optim_info(osd)
    return tag


def _recorded_ranks(url: str, states: dict[str, Any], files: TagFiles) -> tuple[int, int, int]:
    """(dp_world_size, mp_world_size, ZeRO stage) as the rank-0 model states record them; the sizes from the
    rank file names where they are not recorded, the stage from `ds_config` (0 when it says none).

    Raises:
        CorruptCheckpoint: more ranks than any DeepSpeed job has.
    """
    dp = states.get("dp_world_size")
    mp = states.get("mp_world_size")
    dp = dp if type(dp) is int and dp > 0 else max((d for d, _ in files.optim), default=0) + 1
    mp = mp if type(mp) is int and mp > 0 else max(m for _, m in files.model) + 1
    if dp * mp > MAX_RANKS:
        # Every rank is looked for by name: a damaged count (or a stray rank file name) must not send us
        # looping over billions of them.
        raise CorruptCheckpoint(
            f"{url}: dp_world_size {dp} x mp_world_size {mp} is more ranks than ckptctl believes (at most "
            f"{MAX_RANKS}); the model states or the rank file names are damaged"
        )
    config = states.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    stage = zero.get("stage") if isinstance(zero, dict) else None
    return dp, mp, stage if type(stage) is int else 0


def missing_rank_files(url: str, files: TagFiles) -> list[str]:
    """The rank files a tag lacks (the first `LISTED_ABSENT`): what decides whether a DeepSpeed tag is
    complete, for every layout built on DeepSpeed.

    The names of the other rank files show a gap (`TagFiles.missing_from_names`); the highest DP or MP
    rank's files only the world size says, which the rank-0 model states record (their `data.pkl` is
    read, no tensor bytes). So that a save folder of thousands of tags is not read tag by tag, the world
    size of one tag of the folder is read once per scan (`_reference_world`: the tag `latest` names); a
    tag holding every rank file that world size promises is whole, any other is judged by its own. When
    the states do not parse, this says what the names say and leaves the reason to `verify_tag` (and to
    the open, which reads the tag broken).
    """
    missing = files.missing_from_names()
    if missing or files.rank0_model() is None:
        return missing
    reference = peek(io.parent_of(url), _reference_world)
    if reference is not None and not _absent(files, reference):
        return []
    own = _recorded_world(url, files)
    return [] if own is None else _absent(files, own)


def _absent(files: TagFiles, world: tuple[int, int, int]) -> list[str]:
    """The rank files a (dp, mp, ZeRO stage) world promises that `files` lacks."""
    model, optim = expected_rank_files(files, *world)
    return sorted((model | optim) - set(files.sizes))[:LISTED_ABSENT]


def _recorded_world(url: str, files: TagFiles) -> tuple[int, int, int] | None:
    """(dp_world_size, mp_world_size, ZeRO stage) of a tag's rank-0 model states; None when unreadable."""
    rank0 = files.rank0_model()
    if rank0 is None:
        return None
    try:
        states = open_torch_pickle(io.join(url, rank0), files.sizes.get(rank0)).root
        return _recorded_ranks(url, states, files) if isinstance(states, dict) else None
    except CkptctlError:
        return None


def _reference_world(save_dir: str, entries: Sequence[DirEntry]) -> tuple[int, int, int] | None:
    """The world a save folder's tags were saved by, as one tag records it: the tag `latest` names, else
    the newest by its name's step (None when there is none, or it does not read)."""
    folders = [e.name for e in entries if e.is_dir]
    name = read_latest(save_dir, entries)
    if name not in folders:
        name = max(folders, key=lambda n: (step_from_name(n) or -1, n), default=None)
    if name is None:
        return None
    url = io.join(save_dir, name)
    files = tag_files(peek_dir(url) or [])
    return None if files is None else _recorded_world(url, files)


def optimizer_state_dict(opened: TorchPickle) -> dict[str, Any]:
    """The `optimizer_state_dict` of an optim-states file.

    Raises:
        CorruptCheckpoint: the file holds none.
    """
    root = opened.root
    osd = root.get("optimizer_state_dict") if isinstance(root, dict) else None
    if not isinstance(osd, dict):
        raise CorruptCheckpoint(f"{opened.url}: no optimizer_state_dict in a DeepSpeed optim states file")
    return osd


def read_partition_count(value: Any) -> int | None:
    """The number of partitions a `partition_count` value says (None when it says nothing usable)."""
    if type(value) is int:
        return value
    if isinstance(value, list) and value and all(type(v) is int for v in value):
        return max(value)  # one per parameter group; expert groups of MoE models may be smaller
    return None


def _optim_info(osd: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = {}
    scaler = osd.get("loss_scaler")
    if isinstance(scaler, StandIn):
        fields = state_fields(scaler, "loss_scaler")
        if _is_scalar(fields.get("cur_scale")):
            info["loss_scale"] = fields["cur_scale"]
    groups = base_state(osd).get("param_groups")
    if isinstance(groups, list) and groups and isinstance(groups[0], dict):
        first = groups[0]
        info["optimizer"] = {k: first[k] for k in ("lr", "weight_decay", "eps") if _is_scalar(first.get(k))}
        info["param_groups"] = len(groups)
    return info


def base_state(osd: dict[str, Any]) -> dict[str, Any]:
    """The wrapped torch optimizer's state dict (ZeRO-3 and BF16 name it differently from ZeRO-1/2)."""
    for key in ("optimizer_state_dict", "base_optimizer_state"):
        value = osd.get(key)
        if isinstance(value, dict):
            return value
        if isinstance(value, list):  # older ZeRO-1/2: one state dict per group, no param_groups
            return {"state": dict(enumerate(value))}
    return {}
