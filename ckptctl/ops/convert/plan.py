"""What to write: selection, names, dtypes.

A checkpoint that keeps a full-precision copy of its model apart from its model weights (the fp32 master
weights of mixed-precision training, in optimizer partitions) is converted from that copy by default,
as the layout finds it (`ConvertSource.master_weights`: index entries of the partitions, so this is the same
byte copy); `weights=stored` writes the model weights as stored instead.

Names are the model's own, by the rules `diff` matches tensors with (`ops.naming`): the namespace a save
adds (`model.` of a DCP state dict, the entry name of a save, the wrappers a training loop put around a
model) is removed, then `renames` apply. For an HF output, a framework whose models are its own code maps
its names to transformers' before the renames (`ConvertSource.hf_name_map`), and may reorder a tensor's rows; a
framework that also fuses and lays out tensors otherwise (Megatron) supplies the whole model under
transformers names instead (`ConvertSource.hf_model`), and with `--mapping none` under the names and shapes its
own load gives the model (`ConvertSource.native_model`: one tensor per layer of Megatron's stacked layers).

Some output tensors are computed rather than copied (`DerivedTensor`):
- an adapter (`ConvertSource.adapter`: a PEFT LoRA folder) merged into a base model (`base`): the plan is the
  base model's, its stored tensors read from the base checkpoint, the merged ones derived;
- a model whose state dict carries adapters around its layers (`contract.wrapped`: a PEFT-wrapped model
  saved whole): written under the base model's names with the adapter merged in (`lora=merge`).

Such a model's adapter can also be written alone (`lora=adapter`, `plan_adapter`): its tensors under the
names of its framework's adapter folder, with its settings file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptctl.checkpoint import Checkpoint, Component, TensorEntry, dtype_itemsize
from ckptctl.contract.capabilities import (
    NO_NAME_MAP,
    DerivedTensor,
    HfModel,
    MasterWeights,
    ModelTensors,
    NameMap,
    NativeModel,
)
from ckptctl.contract.wrapped import WrappedAdapter
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.manifest import FileRecord
from ckptctl.formats.safetensors import TORCH_TO_SAFETENSORS
from ckptctl.layouts import Layout
from ckptctl.layouts.format_rules import find_wrapped
from ckptctl.ops.convert.options import ConvertOptions, LoraMode, Target, Weights
from ckptctl.ops.convert_source import convert_source
from ckptctl.ops.naming import Renames, apply_renames, compile_renames, namespace_stripper, normalised_names

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
    """One output tensor.

    Attributes:
        entry: the stored tensor it is; for a derived tensor, an entry without chunks that gives its
            dtype and shape.
        name: its name in the output.
        dtype: its dtype in the output.
        rows: the source rows in output order when the output orders them otherwise (`NameMap.rows`).
        derived: how to compute it when no file holds it as is (`read_planned` reads either).
    """

    entry: TensorEntry
    name: str
    dtype: str
    rows: tuple[int, ...] | None = None
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
    config: Mapping[str, Any] | None = None,
    hf: HfModel | NativeModel | None = None,
    *,
    base: Checkpoint | None = None,
    adapter_settings: SettingsFinder | None = None,
) -> tuple[list[Planned], Weights]:
    """The output tensors of `checkpoint` (opened by `layout`), and which weights they are; appends what
    the user should know to `notes`.

    Args:
        config: the parsed config.json the output gets (the name map of an HF output may need it).
        hf: the model under transformers names (`ConvertSource.hf_model`), or under the names the framework's
            own load gives it (`ConvertSource.native_model`, `--mapping none`), which `--to hf` writes when the
            checkpoint keeps no fp32 master weights; its names are kept as they are (before the renames).
        base: the base model to merge the adapter `checkpoint` holds into (`ConvertSource.adapter`); the plan's
            stored entries are then the base's.
        adapter_settings: where a model whose layers carry adapters finds what it needs to merge them.

    Raises:
        CkptctlError: no tensors of the component, names that collide, dtypes safetensors cannot store, an
            adapter that cannot be merged.
    """
    renames = compile_renames(options.renames)
    if base is not None:
        adapter = convert_source(layout).adapter(checkpoint)
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
    weights = Weights.MASTER if masters is not None else Weights.STORED
    if hf is None and options.component is Component.MODEL and options.lora is LoraMode.MERGE:
        stored = normalised_names(checkpoint.layout, entries, strip_prefix, verb="written as")
        wrapped = find_wrapped(stored)
        given = options.given_scaling()
        if wrapped is not None:
            found = adapter_settings(wrapped.settings_files) if adapter_settings is not None else {}
            model = wrapped.merge(checkpoint.url, found, notes, given)
            return _planned(_renamed(model, renames), upcast, options), weights
        if given is not None:
            raise CkptctlError(
                f"--lora-alpha scales LoRA adapters, and the model of {checkpoint.url} carries none around its layers",
                "drop --lora-alpha (--lora-r, --lora-rslora)",
            )
    name_map, rows = (None, {}) if hf is not None else _name_map(checkpoint, layout, entries, options, config, notes)
    named = normalised_names(
        checkpoint.layout,
        entries,
        strip_prefix,
        renames,
        verb="written as",
        mapped=name_map.names if name_map is not None else None,
    )
    plan: list[Planned] = []
    for name, entry in named.items():
        if options.dtype and entry.dtype in _CASTABLE:
            dtype = options.dtype
        else:
            dtype = "float32" if entry.name in upcast else entry.dtype
        if options.to is Target.HF and dtype not in TORCH_TO_SAFETENSORS:
            raise CkptctlError(f"{entry.name!r} is {dtype}, which safetensors cannot store")
        order = rows.get(entry.name)
        if order is not None and (not entry.shape or len(order) != entry.shape[0]):
            raise CkptctlError(
                f"{entry.name!r} has shape {list(entry.shape)} where the tensor name map reorders {len(order)} rows",
                "is the config (--config) this model's?",
            )
        plan.append(Planned(entry, name, dtype, order))
    return plan, weights


def plan_adapter(
    checkpoint: Checkpoint, options: ConvertOptions, notes: list[str], adapter_settings: SettingsFinder
) -> tuple[list[Planned], WrappedAdapter]:
    """The adapters the model of `checkpoint` carries around its layers (`contract.wrapped`), as their
    framework's adapter folder holds them: the plan of its weights file, and what that folder holds.

    Raises:
        CkptctlError: the model carries no adapters, or as `WrappedModel.adapter`.
    """
    entries = [e for e in checkpoint.tensor_index() if e.component is Component.MODEL]
    stored = normalised_names(checkpoint.layout, entries, options.strip_prefix, verb="written as")
    wrapped = find_wrapped(stored)
    if wrapped is None:
        raise CkptctlError(
            f"{checkpoint.url} holds a model without adapters around its layers (no base_layer beside lora_A/lora_B)",
            "--lora adapter writes the adapter of a model saved while wrapped by PEFT; drop it to convert the model",
        )
    found = adapter_settings(wrapped.settings_files)
    adapter = wrapped.adapter(checkpoint.url, found, notes, options.given_scaling())
    return _planned(_renamed(adapter.tensors, compile_renames(options.renames)), frozenset(), options), adapter


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
    """The plan of a model given as output name -> stored or derived tensor."""
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
        plan.append(Planned(entry, name, dtype, derived=derived))
    return plan


def _name_map(
    checkpoint: Checkpoint,
    layout: Layout,
    entries: Sequence[TensorEntry],
    options: ConvertOptions,
    config: Mapping[str, Any] | None,
    notes: list[str],
) -> tuple[NameMap | None, dict[str, tuple[int, ...]]]:
    """The source framework's map of its model's names to transformers' (`ConvertSource.hf_name_map`), for the
    model of an HF output (other outputs keep the framework's names), and the rows it reorders by stored
    tensor name.

    Raises:
        CkptctlError: `--mapping` for an output that keeps the names, or as `ConvertSource.hf_name_map`.
    """
    if options.to is not Target.HF or options.component is not Component.MODEL:
        if options.mapping not in (None, NO_NAME_MAP):
            raise CkptctlError("--mapping names the tensors of a model converted --to hf (--component model)")
        return None, {}
    strip = namespace_stripper(checkpoint.layout, entries, options.strip_prefix)
    found = convert_source(layout).hf_name_map(
        {strip(e.name): e.shape for e in entries}, config, options.mapping, notes
    )
    if found is None:
        return None, {}
    rows = {}
    for entry in entries:
        order = found.rows.get(found.names.get(strip(entry.name), ""))
        if order is not None:
            rows[entry.name] = order
    return found, rows


def read_planned(checkpoint_url: str, planned: Planned) -> Any:
    """The tensor of `planned` as the output holds it (a torch tensor): read from the checkpoint at
    `checkpoint_url` (or computed, for a derived tensor), rows reordered, cast.

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
    if planned.rows is not None:
        tensor = tensor.index_select(0, torch.tensor(planned.rows, dtype=torch.long))
    if planned.dtype != planned.entry.dtype:
        tensor = tensor.to(getattr(torch, planned.dtype))
    return tensor


def _master_weights(
    checkpoint: Checkpoint, layout: Layout, options: ConvertOptions, notes: list[str]
) -> MasterWeights | None:
    """The fp32 master weights of the source (`ConvertSource.master_weights`) when they are wanted and present.

    Raises:
        CkptctlError: `weights=master` on a source without fp32 master weights.
    """
    if options.weights is Weights.STORED:
        return None
    required = options.weights is Weights.MASTER
    found = convert_source(layout).master_weights(checkpoint, required=required, notes=notes)
    if found is None:
        if required:
            raise CkptctlError(
                f"{checkpoint.url} ({checkpoint.layout}) holds no fp32 master weights apart from its model",
                "it keeps one copy of the model: drop --model-weights master",
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
