"""What to write: selection, names, dtypes.

A checkpoint that keeps a full-precision copy of its model apart from its model weights (the fp32 master
weights of mixed-precision training, in optimizer partitions) is converted from that copy by default,
as the layout finds it (`Layout.master_weights`: index entries of the partitions, so this is the same
byte copy); `weights=stored` writes the model weights as stored instead.

Names are the model's own, by the rules `diff` matches tensors with (`ops.naming`): the namespace a save
adds (`model.` of a DCP state dict, the entry name of a save, the wrappers a training loop put around a
model) is removed, then `renames` apply. A layout whose framework names and lays out the model otherwise
(Megatron) supplies it under transformers names for `--to hf` (`Layout.hf_model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptctl.checkpoint import Checkpoint, Component, TensorEntry, dtype_itemsize
from ckptctl.errors import CkptctlError
from ckptctl.formats.manifest import FileRecord
from ckptctl.formats.safetensors import TORCH_TO_SAFETENSORS
from ckptctl.layouts import Layout
from ckptctl.layouts.base import HfModel, MasterWeights
from ckptctl.ops.convert.options import ConvertOptions, Target, Weights
from ckptctl.ops.naming import compile_renames, normalised_names

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
    """One output tensor: its source entry, output name and output dtype."""

    entry: TensorEntry
    name: str
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def nbytes(self) -> int:
        return self.entry.numel * dtype_itemsize(self.dtype)


def plan_tensors(
    checkpoint: Checkpoint, layout: Layout, options: ConvertOptions, notes: list[str], hf: HfModel | None = None
) -> tuple[list[Planned], Weights]:
    """The output tensors of `checkpoint` (opened by `layout`), and which weights they are; appends what
    the user should know to `notes`.

    Args:
        hf: the model under transformers names (`Layout.hf_model`), which `--to hf` writes when the
            checkpoint keeps no fp32 master weights; its names are kept as they are.
    """
    index = checkpoint.tensor_index()
    masters = _master_weights(checkpoint, layout, options, notes) if options.component is Component.MODEL else None
    strip_prefix = options.strip_prefix
    if masters is not None:
        entries, upcast = list(masters.entries), masters.upcast
    elif hf is not None:
        entries, upcast = list(hf.entries), frozenset()
        notes.extend(hf.notes)
        strip_prefix = "" if strip_prefix is None else strip_prefix
    else:
        entries, upcast = [e for e in index if e.component == options.component], frozenset()
    if not entries:
        present = sorted({e.component.value for e in index})
        raise CkptctlError(
            f"{checkpoint.url} holds no {options.component.value} tensors",
            f"components with tensors: {', '.join(present) or 'none'}; choose one with --component",
        )
    named = normalised_names(
        checkpoint.layout, entries, strip_prefix, compile_renames(options.renames), verb="written as"
    )
    plan: list[Planned] = []
    for name, entry in named.items():
        if options.dtype and entry.dtype in _CASTABLE:
            dtype = options.dtype
        else:
            dtype = "float32" if entry.name in upcast else entry.dtype
        if options.to is Target.HF and dtype not in TORCH_TO_SAFETENSORS:
            raise CkptctlError(f"{entry.name!r} is {dtype}, which safetensors cannot store")
        plan.append(Planned(entry, name, dtype))
    return plan, Weights.MASTER if masters is not None else Weights.STORED


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
