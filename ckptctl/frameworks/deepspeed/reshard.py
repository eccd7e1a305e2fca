"""`reshard --to deepspeed-universal`: a ZeRO 1-3 tag as the universal checkpoint DeepSpeed loads on any
number of ranks (`"checkpoint": {"load_universal": true}`), without DeepSpeed.

What is written is what `ds_to_universal.py --inject_missing_state` (DeepSpeed 0.19.8,
`deepspeed/checkpoint/ds_to_universal.py`, `main`) writes for a tag without tensor or pipeline parallelism,
into `DST/<tag>/` beside `DST/latest_universal` (which names `<tag>`), so that `load_checkpoint(DST)` finds it:

- ZeRO 1-2 (`extract_zero_shards` + `merge_tp_slices`): `zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt`, each
  `{"cat_dim": 0, "param": tensor of the parameter's shape}`, and `zero/<param>/step.pt`, the parameter
  group's step as the optimizer keeps it (a 0-dim tensor for torch's Adam). Then every tensor of the module
  (rank-0 model states) that got no `fp32.pt` so far, frozen parameters and buffers included, gets one of
  its module weights cast to float32, `{"param": tensor}`. `zero/optimizer_state.pt`: the ZeRO optimizer's
  state dict without its partitioned entries, with the wrapped optimizer's `param_groups`. The
  `mp_rank_XX_model_states.pt` files are copied byte for byte.
- ZeRO-3 (`extract_zero_shards_stage3` + `merge_zero3_slices`): `zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt`
  hold the flat tensor itself (the parameter's elements, row-major), no `step.pt`; frozen parameters get
  no folder (their fragments stay in the model states). `zero/optimizer_state.pt`: DP rank 0's optimizer
  state dict with the wrapped optimizer's `param_groups`. Every `*_model_states.pt` is copied.

One departure, to keep memory flat: under ZeRO-3, `ds_to_universal` keeps DP rank 0's own
flat partitions in `optimizer_state.pt` (`fp32_flat_groups` and the moments in its `state`), which
DeepSpeed's universal load does not read (`stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3` reads
each group's `step` and `param_groups`); they are left out, and `not_carried` says so.

Every tensor is streamed from the raw bytes of the partitions (`zero_tag.tensor_index`, which lays the flat
partitions out per parameter exactly as `zero_to_fp32` does) into its file, through a buffer of a few MiB:
`formats.torch_save_writer.write_torch_file` writes torch.save's archive by hand, so the path imports neither
torch nor numpy (but to cast float16 module tensors, numpy, and for a strided view no DeepSpeed save holds, torch; importing torch alone would cost ~220 MiB of resident memory, and torch.save's
record writer half the time). No user file is unpickled with code execution: the non-tensor values of
`optimizer_state.pt` come from the safe unpickler and are written back as DeepSpeed's classes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, ChunkEncoding, Component, TensorEntry, dtype_itemsize
from ckptctl.contract.capabilities import NotCarried, ReshardRequest, WrittenState
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.families.zero_tag.master_weights import tag_prefix
from ckptctl.families.zero_tag.names import LATEST_NAME, UNIVERSAL_LATEST_NAME, UNIVERSAL_STATES_DIR
from ckptctl.families.zero_tag.state import partitioned_tag
from ckptctl.families.zero_tag.tag import (
    DeepSpeedTag,
    base_state,
    optimizer_state_dict,
)
from ckptctl.families.zero_tag.tensor_index import param_groups, tag_index
from ckptctl.formats.chunks import entry_tiling_problem
from ckptctl.formats.digest import bytes_digest, copy_hashed
from ckptctl.formats.manifest import FileRecord
from ckptctl.formats.torch_pickle import load_tensor
from ckptctl.formats.torch_pickle_classes import TensorRef
from ckptctl.formats.torch_save_writer import ByteRange, RawTensor, write_torch_file
from ckptctl.frameworks.deepspeed import universal_from_state

__all__ = ["TARGET", "WRITER", "UniversalWriter"]

#: The name `reshard --to` takes for this writer.
TARGET = "deepspeed-universal"
#: What to set in the DeepSpeed config to resume from the output.
RESUME_HINT = '"checkpoint": {"load_universal": true} in the DeepSpeed config, then engine.load_checkpoint(DST)'
_MOMENTS = ("exp_avg", "exp_avg_sq")
#: The ZeRO 1-2 optimizer state dict's partitioned entries, which `_save_optimizer_state` leaves out.
_SHARDED = frozenset({"base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups"})
_OPTIMIZER_STATE = f"{UNIVERSAL_STATES_DIR}/optimizer_state.pt"


@dataclass(frozen=True, slots=True)
class _ParamStates:
    """The states of one parameter to write: state name (`fp32`, `exp_avg`, ...) -> its index entry."""

    name: str
    states: tuple[tuple[str, TensorEntry], ...]
    group: int
    wrapped: bool  # ZeRO 1-2: `{"param": t, "cat_dim": 0}`; ZeRO-3: the flat tensor itself
    #: a module tensor without optimizer states (written `{"param": t.float()}`): its record in the model states
    module_ref: TensorRef | None = None


@dataclass(frozen=True, slots=True)
class _Plan:
    tag: DeepSpeedTag
    params: tuple[_ParamStates, ...]
    zero3: bool


class UniversalWriter:
    """The training-state writer of DeepSpeed (`TrainingStateWriter`): a ZeRO 1-3 tag of any layout that holds
    one (DeepSpeed, OpenRLHF, open-instruct, accelerate, the HF Trainer, Lightning) to a universal checkpoint;
    a state other frameworks name parameter by parameter (FSDP2's DCP save) by `universal_from_state`."""

    target = TARGET

    def refusal(self, source: Checkpoint, world_size: int | None) -> str | None:
        if world_size is not None and world_size < 1:
            return f"a world size of {world_size} ranks"
        try:
            if _from_state(source):
                universal_from_state.check(source)
            else:
                _plan(source)
        except CkptctlError as exc:
            return exc.message
        return None

    def write(self, request: ReshardRequest, advance: Callable[[int], None]) -> WrittenState:
        if _from_state(request.source):
            return universal_from_state.write(request, advance)
        plan = _plan(request.source)
        tag = plan.tag
        out_tag = io.name_of(tag.url)
        root = os.path.join(request.staging, out_tag)
        os.makedirs(os.path.join(root, UNIVERSAL_STATES_DIR), exist_ok=True)
        # Every file is hashed as it is written (or copied), so that the digests file reads none back.
        digests: dict[str, FileRecord] = {}
        written_bytes = 0

        def one(param: _ParamStates) -> tuple[dict[str, FileRecord], int]:
            return _write_param(tag, param, root, out_tag)

        with ThreadPoolExecutor(max(1, request.workers)) as pool:
            for records, nbytes in pool.map(one, plan.params):
                digests.update(records)
                written_bytes += nbytes
                advance(nbytes)
        optimizer_state = write_torch_file(_optimizer_state(tag, plan.zero3), os.path.join(root, _OPTIMIZER_STATE))
        digests[f"{out_tag}/{_OPTIMIZER_STATE}"] = optimizer_state
        for name in sorted(_model_state_files(tag)):
            copied = copy_hashed(io.join(tag.url, name), os.path.join(root, name))
            digests[f"{out_tag}/{name}"] = copied
            advance(copied.size)
        with open(os.path.join(request.staging, UNIVERSAL_LATEST_NAME), "w") as f:
            f.write(out_tag)  # as ds_to_universal writes it: the folder's name, no newline
        digests[UNIVERSAL_LATEST_NAME] = FileRecord(len(out_tag.encode()), bytes_digest(out_tag.encode()))
        return WrittenState(
            tensors=sum(max(1, len(p.states)) for p in plan.params),
            bytes=written_bytes,
            files=tuple(digests),
            world_size=request.world_size,
            not_carried=_not_carried(tag, plan.zero3) + _beside_tag(request.source, tag),
            resume_hint=RESUME_HINT,
            digests=digests,
        )


WRITER = UniversalWriter()


def _from_state(source: Checkpoint) -> bool:
    """Whether `source` is written from its training state named parameter by parameter (`universal_from_state`):
    it holds no ZeRO tag, and its framework names its state so."""
    return tag_prefix(source) is None and universal_from_state.reads(source)


def _plan(source: Checkpoint) -> _Plan:
    """The tag `source` holds and the states to write for each parameter, from metadata only.

    Raises:
        CkptctlError: no ZeRO tag, a torn one (naming the missing file), several model-parallel ranks, or
            parameter names that are no folder names.
    """
    tag, _ = partitioned_tag(source)
    url = tag.url
    index = {e.name: e for e in tag_index(tag)}
    zero3 = tag.optim_kind == "zero3"
    params: list[_ParamStates] = []
    for g, group in enumerate(param_groups(tag.states.get("param_shapes"))):
        for name in group:
            master = index.get(name if zero3 else f"optimizer.fp32.{name}")
            if master is None or not master.chunks:
                continue  # no fragment on any rank: ds_to_universal writes no optimizer state either
            states = [("fp32", master)]
            for moment in _MOMENTS:
                entry = index.get(f"optimizer.state.{name}.{moment}")
                if entry is None:
                    raise CorruptCheckpoint(f"{url}: the optimizer partitions hold no {moment} of {name}")
                states.append((moment, entry))
            params.append(_ParamStates(name, tuple(states), g, wrapped=not zero3))
    if not zero3:
        done = {p.name for p in params}
        module = tag.states.get("module")
        for name, ref in module.items() if isinstance(module, dict) else ():
            if isinstance(name, str) and name not in done and type(ref) is TensorRef:
                params.append(_ParamStates(name, (), 0, wrapped=True, module_ref=ref))
    for p in params:
        if not p.name or p.name in (".", "..") or "/" in p.name or "\0" in p.name:
            raise CorruptCheckpoint(f"{url}: parameter name {p.name!r} cannot name a folder")
    return _Plan(tag, tuple(params), zero3)


def _write_param(tag: DeepSpeedTag, param: _ParamStates, root: str, out_tag: str) -> tuple[dict[str, FileRecord], int]:
    """Write the files of one parameter: their size and digest by relative path, and its tensor bytes."""
    folder = os.path.join(root, UNIVERSAL_STATES_DIR, param.name)
    os.makedirs(folder, exist_ok=True)
    prefix = f"{out_tag}/{UNIVERSAL_STATES_DIR}/{param.name}"
    if param.module_ref is not None:
        model_file = tag.files.rank0_model() or ""
        tensor = _raw_tensor(param.module_ref, tag, model_file, as_dtype="float32")
        record = write_torch_file({"param": tensor}, os.path.join(folder, "fp32.pt"))
        return {f"{prefix}/fp32.pt": record}, tensor.numel * dtype_itemsize(tensor.dtype)
    records: dict[str, FileRecord] = {}
    nbytes = 0
    for state, entry in param.states:
        ranges = _flat_ranges(tag.url, entry)
        shape = entry.shape if param.wrapped else (entry.numel,)
        tensor = RawTensor(entry.dtype, shape, ranges)
        value: Any = {"cat_dim": 0, "param": tensor} if param.wrapped else tensor
        records[f"{prefix}/{state}.pt"] = write_torch_file(value, os.path.join(folder, f"{state}.pt"))
        nbytes += entry.nbytes
    if param.wrapped:
        step = _group_step(tag, param.group)
        if step is not None:
            records[f"{prefix}/step.pt"] = write_torch_file(step, os.path.join(folder, "step.pt"))
    return records, nbytes


def _flat_ranges(url: str, entry: TensorEntry) -> tuple[ByteRange, ...]:
    """The byte ranges of the partitions that hold `entry`'s elements, in row-major order.

    The tensor index cuts every ZeRO parameter into chunks that are each one contiguous run of its row-major
    elements (`flat_range_boxes`), so the parameter is those runs, ordered by their first element.

    Raises:
        CorruptCheckpoint: the chunks do not tile the tensor, or one is not a contiguous raw run.
    """
    problem = entry_tiling_problem(entry)
    if problem is not None:
        raise CorruptCheckpoint(f"{entry.name}: {problem}")
    itemsize = dtype_itemsize(entry.dtype)
    strides = [math.prod(entry.shape[d + 1 :]) for d in range(len(entry.shape))]
    runs = []
    for chunk in entry.chunks:
        if not chunk.numel:
            continue
        lead = next((d for d, size in enumerate(chunk.sizes) if size != 1), len(chunk.sizes))
        contiguous = all(
            chunk.offsets[d] == 0 and chunk.sizes[d] == entry.shape[d] for d in range(lead + 1, len(entry.shape))
        )
        if chunk.encoding != ChunkEncoding.RAW or not contiguous or chunk.byte_length != chunk.numel * itemsize:
            raise CorruptCheckpoint(f"{entry.name}: a piece in {chunk.file} is not a contiguous run of its elements")
        first = sum(o * s for o, s in zip(chunk.offsets, strides, strict=True))
        runs.append((first, ByteRange(io.join(url, chunk.file), chunk.byte_offset, chunk.byte_length)))
    runs.sort(key=lambda run: run[0])
    return tuple(byte_range for _, byte_range in runs)


def _raw_tensor(ref: TensorRef, tag: DeepSpeedTag, file: str, as_dtype: str | None = None) -> RawTensor:
    """The tensor `ref` of a rank file as a `RawTensor` to write (cast to `as_dtype` while written)."""
    opened = tag.open_file(file)
    dtype = as_dtype or ref.dtype
    found = opened.byte_range(ref) if ref.numel else (0, 0)
    if found is None:  # a strided view, which DeepSpeed does not save: read with torch, only then
        import torch

        tensor = load_tensor(io.join(tag.url, file), ref, opened)
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return RawTensor(dtype, ref.shape, data, stored_as=ref.dtype)
    ranges = (ByteRange(io.join(tag.url, file), found[0], found[1] - found[0]),) if ref.numel else ()
    return RawTensor(dtype, ref.shape, ranges, stored_as=ref.dtype)


def _rank0_optim(tag: DeepSpeedTag) -> tuple[str, dict[str, Any]]:
    name = tag.files.optim[(0, 0)]
    return name, optimizer_state_dict(tag.open_file(name))


def _group_step(tag: DeepSpeedTag, group: int) -> Any:
    """The step the wrapped optimizer keeps for a parameter group (DP rank 0's: every rank keeps the same)."""
    name, osd = _rank0_optim(tag)
    state = base_state(osd).get("state")
    group_state = state.get(group) if isinstance(state, dict) else None
    step = group_state.get("step") if isinstance(group_state, dict) else None
    return _materialize(step, tag, name)


def _materialize(value: Any, tag: DeepSpeedTag, file: str) -> Any:
    """`value` with the tensors the safe unpickler described (`TensorRef`) as `RawTensor`s of `file`'s bytes."""
    if type(value) is TensorRef:
        return _raw_tensor(value, tag, file)
    if type(value) is dict:
        return {k: _materialize(v, tag, file) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_materialize(v, tag, file) for v in value)
    return value


def _optimizer_state(tag: DeepSpeedTag, zero3: bool) -> dict[str, Any]:
    """`zero/optimizer_state.pt` (ds_to_universal's `_save_optimizer_state`, `_save_optimizer_state_stage3`)."""
    name, osd = _rank0_optim(tag)
    groups = base_state(osd).get("param_groups")
    if zero3:
        inner = base_state(osd)
        state = inner.get("state")
        kept = {
            g: {k: v for k, v in s.items() if type(v) is not TensorRef or not v.shape}
            for g, s in (state.items() if isinstance(state, dict) else ())
            if isinstance(s, dict)
        }
        out = {k: v for k, v in osd.items() if k != "fp32_flat_groups"}
        out["optimizer_state_dict"] = {**inner, "state": kept}
    else:
        out = {k: v for k, v in osd.items() if k not in _SHARDED}
    out["param_groups"] = groups
    return dict(_materialize(out, tag, name))


def _model_state_files(tag: DeepSpeedTag) -> Iterator[str]:
    """The model-states files ds_to_universal copies: each MP rank's (every DP rank's under ZeRO-3)."""
    yield from tag.files.model.values()


def _not_carried(tag: DeepSpeedTag, zero3: bool) -> tuple[NotCarried, ...]:
    client = sorted(k for k in tag.client_state() if isinstance(k, str))
    kept = f" (client_state keys {', '.join(client[:6])}{', ...' if len(client) > 6 else ''})" if client else ""
    found = [
        NotCarried(
            "rng",
            "DeepSpeed's engine saves no RNG state (neither does ds_to_universal): seed the resumed run. RNG the "
            f"training code put in client_state is carried as saved{kept}, in rank 0's model states: one stream "
            "for every rank of the new world size",
        )
    ]
    if Component.DATALOADER not in tag.components():
        found.append(
            NotCarried(
                "data loader position",
                "the tag records no data sampler (DeepSpeed saves one only for its own loader): the model states "
                "carry global_steps/global_samples and client_state as saved; a position counted in samples per "
                "rank of the old world size must be translated by the training code",
            )
        )
    if zero3:
        found.append(
            NotCarried(
                "zero/optimizer_state.pt: DP rank 0's flat partitions",
                "ds_to_universal keeps DP rank 0's fp32_flat_groups and moments there, which DeepSpeed's universal "
                "load does not read; every parameter's states are in its zero/<param>/ folder",
            )
        )
    return tuple(found)


#: What DeepSpeed's `save_checkpoint` writes beside a tag: the pointer (`latest_universal` replaces it) and its
#: scripts that rebuild the weights.
_DEEPSPEED_BESIDE_TAG = frozenset({LATEST_NAME, "zero_to_fp32.py", "zero_to_torch.py"})


def _beside_tag(source: Checkpoint, tag: DeepSpeedTag) -> tuple[NotCarried, ...]:
    """The files of a framework wrapping DeepSpeed beside its tag (the HF Trainer's `scheduler.pt`,
    `rng_state_N.pth`, `trainer_state.json`; accelerate's `scheduler.bin`, `random_states_N.pkl`): written by
    that framework, read by its own resume, not by DeepSpeed's, and not in DST."""
    if tag.url == source.url:
        return ()
    inside = f"{io.relative_to(tag.url, source.url)}/"
    beside = sorted(f for f in source.files if not f.startswith(inside) and f not in _DEEPSPEED_BESIDE_TAG)
    if not beside:
        return ()
    shown = ", ".join(beside[:8]) + (", ..." if len(beside) > 8 else "")
    return (
        NotCarried(
            f"{source.layout} files beside the DeepSpeed tag",
            f"{shown}: the {source.layout} checkpoint's own files (its LR scheduler, RNG and counters, where it "
            "keeps them there), which its own resume code reads rather than DeepSpeed's engine; not copied into DST",
        ),
    )
