"""What to write: selection, names, dtypes.

A checkpoint that keeps a full-precision copy of its model apart from its model weights (the fp32 master
weights of mixed-precision training, in optimizer partitions) is converted from that copy by default,
as the layout finds it (`Layout.master_weights`: index entries of the partitions, so this is the same
byte copy); `weights=stored` writes the model weights as stored instead.

Names are the model's own, by the rules `diff` matches tensors with (`ops.naming`): the namespace a save
adds (`model.` of a DCP state dict, the entry name of a save, the wrappers a training loop put around a
model) is removed, then `renames` apply.

Some output tensors are computed rather than copied (`DerivedTensor`):
- an adapter (`Layout.adapter`: a PEFT LoRA folder) merged into a base model (`merge_adapter`): the plan
  is the base model's, its stored tensors read from the base checkpoint, the merged ones derived;
- a model whose state dict carries adapters around its layers (`layouts.wrapped`: a PEFT-wrapped model
  saved whole): written under the base model's names with the adapter merged in (`lora=merge`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptctl.checkpoint import Checkpoint, Component, TensorEntry, dtype_itemsize
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.manifest import FileRecord
from ckptctl.formats.safetensors import TORCH_TO_SAFETENSORS
from ckptctl.layouts import Layout
from ckptctl.layouts.base import DerivedTensor, MasterWeights, ModelTensors
from ckptctl.layouts.wrapped import find_wrapped
from ckptctl.ops.convert.options import ConvertOptions, LoraMode, Target, Weights
from ckptctl.ops.naming import Renames, apply_renames, compile_renames, normalised_names

if TYPE_CHECKING:
    import torch

#: `dtype` casts these; integer, bool and float8 tensors (ids, masks, quantised weights) keep their type,
#: as `model.to(dtype)` in torch does.
_CASTABLE = frozenset({"float64", "float32", "float16", "bfloat16"})


@dataclass(frozen=True, slots=True)
class Written:
    """What the writer did: tensors byte-copied, tensors assembled, digests of the files it wrote."""

    streamed: int
    assembled: int
    digests: dict[str, FileRecord]


@dataclass(frozen=True, slots=True)
class Planned:
    """One output tensor: its source entry, output name and output dtype.

    Attributes:
        entry: the stored tensor it is; for a derived tensor, an entry without chunks that gives its
            dtype and shape.
        name: its name in the output.
        dtype: its dtype in the output.
        derived: how to compute it when no file holds it as is (read it with `load_planned`).
    """

    entry: TensorEntry
    name: str
    dtype: str
    derived: DerivedTensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def nbytes(self) -> int:
        return self.entry.numel * dtype_itemsize(self.dtype)


#: Finds the files of the given names that hold an adapter's settings (name -> parsed JSON).
SettingsFinder = Callable[[Sequence[str]], Mapping[str, Any]]


def plan_tensors(
    checkpoint: Checkpoint,
    layout: Layout,
    options: ConvertOptions,
    notes: list[str],
    *,
    base: Checkpoint | None = None,
    adapter_settings: SettingsFinder | None = None,
) -> tuple[list[Planned], Weights]:
    """The output tensors of `checkpoint` (opened by `layout`), and which weights they are; appends what
    the user should know to `notes`.

    Args:
        base: the base model to merge the adapter `checkpoint` holds into (`Layout.adapter`); the plan's
            stored entries are then the base's.
        adapter_settings: where a model whose layers carry adapters finds what it needs to merge them.

    Raises:
        CkptctlError: no tensors of the component, names that collide, dtypes safetensors cannot store, an
            adapter that cannot be merged.
    """
    renames = compile_renames(options.renames)
    if base is not None:
        adapter = layout.adapter(checkpoint)
        if adapter is None:
            raise CkptctlError(f"{checkpoint.url} ({checkpoint.layout}) holds a model, not an adapter to merge")
        base_named = normalised_names(
            base.layout, list(base.tensors(Component.MODEL)), options.strip_prefix, verb="written as"
        )
        if not base_named:
            raise CkptctlError(f"the base model {base.url} holds no model tensors")
        merged = adapter.merge(base.url, base_named, notes)
        return _planned(_renamed(merged, renames), frozenset(), options), Weights.STORED
    index = checkpoint.tensor_index()
    masters = _master_weights(checkpoint, layout, options, notes) if options.component is Component.MODEL else None
    if masters is not None:
        entries, upcast = list(masters.entries), masters.upcast
    else:
        entries, upcast = [e for e in index if e.component == options.component], frozenset()
    if not entries:
        present = sorted({e.component.value for e in index})
        raise CkptctlError(
            f"{checkpoint.url} holds no {options.component.value} tensors",
            f"components with tensors: {', '.join(present) or 'none'}; choose one with --component",
        )
    stored = normalised_names(checkpoint.layout, entries, options.strip_prefix, verb="written as")
    named: ModelTensors = stored
    if options.component is Component.MODEL and options.lora is LoraMode.MERGE:
        wrapped = find_wrapped(stored)
        if wrapped is not None:
            found = adapter_settings(wrapped.settings_files) if adapter_settings is not None else {}
            named = wrapped.merge(checkpoint.url, found, notes)
    plan = _planned(_renamed(named, renames), upcast, options)
    return plan, Weights.MASTER if masters is not None else Weights.STORED


def _renamed(model: ModelTensors, renames: Renames) -> dict[str, TensorEntry | DerivedTensor]:
    """`model` with `renames` applied to its names (after any merge: adapters name the model's own tensors).

    Raises:
        CkptctlError: two tensors get the same name, or a name becomes empty.
    """
    if not renames:
        return dict(model)
    renamed: dict[str, TensorEntry | DerivedTensor] = {}
    for name, item in model.items():
        new = apply_renames(name, renames)
        if not new:
            raise CkptctlError(f"{name!r} has no name left after renaming")
        if new in renamed:
            raise CkptctlError(f"two tensors would both be written as {new!r}", "adjust --rename")
        renamed[new] = item
    return renamed


def _planned(
    model: Mapping[str, TensorEntry | DerivedTensor], upcast: frozenset[str], options: ConvertOptions
) -> list[Planned]:
    plan: list[Planned] = []
    for name, item in model.items():
        derived = item if isinstance(item, DerivedTensor) else None
        entry = (
            TensorEntry(item.name, Component.MODEL, item.dtype, item.shape, ())
            if isinstance(item, DerivedTensor)
            else item
        )
        if options.dtype and entry.dtype in _CASTABLE:
            dtype = options.dtype
        else:
            dtype = "float32" if entry.name in upcast and derived is None else entry.dtype
        if options.to is Target.HF and dtype not in TORCH_TO_SAFETENSORS:
            raise CkptctlError(f"{entry.name!r} is {dtype}, which safetensors cannot store")
        plan.append(Planned(entry, name, dtype, derived))
    return plan


def load_planned(checkpoint_url: str, planned: Planned) -> torch.Tensor:
    """The tensor `planned` writes, in its output dtype: read from the checkpoint at `checkpoint_url`
    (assembled from its chunks), or computed.

    Raises:
        CorruptCheckpoint: the chunks do not read back (see `read_tensor`), or a computed tensor is not
            what was planned.
    """
    import torch

    from ckptctl.formats.chunks import read_tensor

    if planned.derived is None:
        tensor = read_tensor(checkpoint_url, planned.entry)
    else:
        tensor = planned.derived.compute()
        if tuple(tensor.shape) != planned.shape or str(tensor.dtype).removeprefix("torch.") != planned.entry.dtype:
            raise CorruptCheckpoint(
                f"{planned.name}: computed as {tensor.dtype}{list(tensor.shape)} where "
                f"{planned.entry.dtype}{list(planned.shape)} was planned",
                "this is a bug in ckptctl",
            )
    if planned.dtype != planned.entry.dtype:
        tensor = tensor.to(getattr(torch, planned.dtype))
    return tensor


def _master_weights(
    checkpoint: Checkpoint, layout: Layout, options: ConvertOptions, notes: list[str]
) -> MasterWeights | None:
    """The fp32 master weights of the source (`Layout.master_weights`) when they are wanted and present.

    Raises:
        CkptctlError: `weights=master` on a source without fp32 master weights.
    """
    if options.weights is Weights.STORED:
        return None
    required = options.weights is Weights.MASTER
    found = layout.master_weights(checkpoint, required=required, notes=notes)
    if found is None:
        if required:
            raise CkptctlError(
                f"{checkpoint.url} ({checkpoint.layout}) holds no fp32 master weights apart from its model",
                "it keeps one copy of the model: drop --weights master",
            )
        return None
    notes.extend(found.notes)
    return found


def float_dtype(plan: Sequence[Planned]) -> str | None:
    """The floating-point dtype that most of the planned bytes are in: what the output holds, so what its
    config's `dtype` must say (transformers loads the model in it)."""
    totals: dict[str, int] = {}
    for p in plan:
        if p.dtype in _CASTABLE:
            totals[p.dtype] = totals.get(p.dtype, 0) + p.nbytes
    return max(totals, key=lambda dtype: totals[dtype]) if totals else None
