"""The full-precision weights, as zero_to_fp32 reconstructs them (`convert` writes them by default)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, Component, TensorEntry
from ckptctl.contract.capabilities import MasterWeights
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.families.zero_tag.kept_masters import KEPT_MASTERS, kept_master_weights
from ckptctl.families.zero_tag.names import is_rank_file
from ckptctl.families.zero_tag.tag import DeepSpeedTag, read_tag
from ckptctl.families.zero_tag.tensor_index import IndexBuilder, param_groups, tag_index
from ckptctl.formats.torch_pickle_classes import TensorRef

#: Dtypes whose buffers zero_to_fp32 returns as float32 (`v.float() if v.is_floating_point()`).
_FLOATING = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
_FP32_PREFIX = "optimizer.fp32."


def master_weights(tag: DeepSpeedTag, path_prefix: str = "") -> MasterWeights:
    """The full fp32 weights of a ZeRO 1-3 tag, exactly as `zero_to_fp32` reconstructs them: the state dict
    `get_fp32_state_dict_from_zero_checkpoint` returns, as index entries in the module's state-dict order
    (trainable parameters from the fp32 partitions, frozen parameters and buffers from the model states,
    tied parameters as copies of the entry they share; `upcast` names the floating-point buffers, which
    zero_to_fp32 returns as float32 whatever their stored dtype).

    zero_to_fp32 (DeepSpeed 0.19) returns the buffers of `buffer_names` from the rank-0 module (floating
    ones cast to float32), the frozen parameters from `frozen_param_fragments` (as stored: the 16-bit
    weights; concatenated over DP ranks under ZeRO-3), every parameter of `param_shapes` from the fp32
    partitions, and each `shared_params` alias as the parameter it shares. One departure: ZeRO-1 records
    no frozen parameters (`frozen_param_shapes` is saved only when gradients are partitioned), so
    zero_to_fp32 drops them; here they come from the module's weights, and `notes` says so.

    Args:
        tag: from `read_tag`.
        path_prefix: prepended to chunk file names (as for `tag_index`).

    Raises:
        CkptctlError: the tag holds no fp32 partitions (no ZeRO, or no optim files) or several
            model-parallel ranks (zero_to_fp32 merges data-parallel partitions only).
        CorruptCheckpoint: the model states or partitions do not hold what they promise.
    """
    if not tag.files.optim or tag.optim_kind is None:
        raise CkptctlError(
            f"{tag.url} holds no fp32 master weights (ZeRO stage {tag.zero_stage} saves no optimizer partitions)",
            "convert the module's own weights instead",
        )
    if tag.mp_world_size > 1:
        raise CkptctlError(
            f"{tag.url} holds {tag.mp_world_size} model-parallel ranks; zero_to_fp32 merges data-parallel "
            "partitions only",
            "merge the tensor-parallel ranks with the training framework's own tool first",
        )
    return assemble_master_weights(
        tag, tag_index(tag, path_prefix), zero3=tag.optim_kind == "zero3", path_prefix=path_prefix
    )


def assemble_master_weights(
    tag: DeepSpeedTag, index: Sequence[TensorEntry], *, zero3: bool, path_prefix: str = ""
) -> MasterWeights:
    """What `master_weights` returns, from a tensor index named as `tag_index` names its entries: the model
    under the module's names (the fp32 partitions themselves under ZeRO-3), the fp32 copies of ZeRO 1-2
    as `optimizer.fp32.<name>`. A universal checkpoint's index is named the same way.

    Args:
        tag: the model states (`read_tag`).
        index: the tensor index.
        zero3: whether the model entries of trainable parameters are the fp32 masters themselves.
        path_prefix: where the model states lie relative to the checkpoint (as for `tag_index`).

    Raises:
        CorruptCheckpoint: a parameter `param_shapes` names has no fp32 copy in `index`.
    """
    model = {e.name: e for e in index if e.component is Component.MODEL}
    fp32 = {e.name[len(_FP32_PREFIX) :]: e for e in index if e.name.startswith(_FP32_PREFIX)}
    states = tag.states
    module = states.get("module")
    module = module if isinstance(module, dict) else {}
    buffer_names = states.get("buffer_names")
    buffers = [n for n in buffer_names if isinstance(n, str)] if isinstance(buffer_names, list) else []
    frozen = states.get("frozen_param_shapes")
    frozen_names = [n for n in frozen if isinstance(n, str)] if isinstance(frozen, dict) else []
    trainable = [name for group in param_groups(states.get("param_shapes")) for name in group]

    found: dict[str, TensorEntry] = {}
    upcast: set[str] = set()
    for name in buffers:
        entry = model.get(name)
        if entry is not None and name not in trainable:
            found[name] = entry
            if entry.dtype in _FLOATING:
                upcast.add(name)
    for name in frozen_names:
        entry = model.get(name)
        if entry is None or not entry.chunks:
            raise CorruptCheckpoint(f"{tag.url}: the weights of frozen parameter {name} are missing")
        found[name] = entry
    for name in trainable:
        entry = model.get(name) if zero3 else fp32.get(name)
        if entry is None or not entry.chunks:
            raise CorruptCheckpoint(f"{tag.url}: the fp32 partitions hold no {name}")
        found[name] = replace(entry, name=name, component=Component.MODEL)
    shared = states.get("shared_params")
    for alias, target in shared.items() if isinstance(shared, dict) else ():
        if isinstance(alias, str) and target in found:
            found[alias] = replace(found[target], name=alias)
            if target in upcast:
                upcast.add(alias)
    notes = []
    if not zero3:
        builder = IndexBuilder(tag, 0, path_prefix, "")
        outside = [n for n, ref in module.items() if isinstance(n, str) and n not in found and type(ref) is TensorRef]
        for name in outside:
            found[name] = builder._from_file(name, Component.MODEL, builder.model_file, module[name])
        if outside:
            shown = ", ".join(outside[:3]) + (", ..." if len(outside) > 3 else "")
            notes.append(
                f"{len(outside)} parameter(s) outside the optimizer's partitions ({shown}) come from the module's "
                f"{found[outside[0]].dtype} weights; zero_to_fp32 leaves them out (ZeRO-{tag.zero_stage} "
                "records no frozen parameters)"
            )
    order = {name: i for i, name in enumerate(module)}
    entries = sorted(found.values(), key=lambda e: order.get(e.name, len(order)))
    return MasterWeights(tuple(entries), frozenset(upcast), tuple(notes))


def tag_prefix(checkpoint: Checkpoint) -> str | None:
    """Where the DeepSpeed tag folder holding a checkpoint's training state is, relative to it (`""`: the
    checkpoint is the tag), judged from where its tensors' chunks lie: in DeepSpeed rank files of one folder.
    The model's chunks decide; where the model lies elsewhere, the optimizer's (the HF Trainer saves the model
    as `model.safetensors` beside its `global_stepN/` under ZeRO 1-2). None when neither lies in one tag (an
    HF export of an RL framework)."""
    for component in (Component.MODEL, Component.OPTIMIZER):
        files = {chunk.file for e in checkpoint.tensor_index() if e.component is component for chunk in e.chunks}
        folders = {file.rpartition("/")[0] for file in files if is_rank_file(file)}
        if len(folders) == 1:
            folder = folders.pop()
            return f"{folder}/" if folder else ""
        if folders:
            return None
    return None


def checkpoint_master_weights(
    checkpoint: Checkpoint, prefix: str | None, *, required: bool, notes: list[str]
) -> MasterWeights | None:
    """`ConvertSource.master_weights` of a checkpoint holding a DeepSpeed tag at `prefix` (relative to it, `""`: it
    is the tag; None: it holds none): the fp32 master weights of ZeRO 1-3 (`master_weights`).

    Without ZeRO (stage 0) a tag keeps no optimizer partitions, hence no masters: None, and a note (an
    error when `required`).
    """
    if prefix is None:
        return None
    tag_url = io.join(checkpoint.url, prefix.rstrip("/")) if prefix else checkpoint.url
    if io.exists(io.join(tag_url, KEPT_MASTERS)):
        return kept_master_weights(checkpoint.url, prefix)
    tag = read_tag(tag_url)
    if not tag.files.optim or tag.optim_kind is None:
        if required:
            raise CkptctlError(
                f"{tag.url} holds no fp32 master weights (ZeRO stage {tag.zero_stage} saves no optimizer partitions)",
                "convert the module's own weights: drop --model-weights master",
            )
        notes.append(
            f"DeepSpeed without ZeRO (stage {tag.zero_stage}) saves no optimizer partitions: writing the module's "
            "weights as stored (DeepSpeed's zero_to_fp32 cannot read such a checkpoint)"
        )
        return None
    return master_weights(tag, prefix)
