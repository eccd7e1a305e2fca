"""`convert`: a checkpoint's model (or another component) to a Hugging Face folder or to a torch DCP folder.

The source is the checkpoint `layouts.resolve` names: the folder itself when it is one, else the
checkpoint a layout's `latest`-style pointer in it names (a save folder's `latest` file). It must be
complete and pass its layout's structural verification.

The command reads like its modules, in order: `options` (what is asked, what was done), `plan` (which
tensors, names, dtypes and weights), `side_files` (config and tokenizer files), `model_check` (the plan
against the model the config names: tied weights, missing, reshaped and leftover tensors), `to_hf` /
`to_dcp` (the writers), `commit` (staging, digests and the move or upload into DST).

An HF model output is proved a transformers model by the model check, or not written: with no config.json (none
found, given or recorded by the checkpoint) nothing tells the framework's own names and rotary row orders from
transformers', so it is refused (`UnprovedModel`) unless the stored names are asked for (`mapping="none"`).

An adapter (`ConvertSource.adapter`: a PEFT LoRA folder) is not a model: it converts merged into its base model
(`merge_adapter`), whose tensors, config and tokenizer the output takes, the adapted weights computed.
The adapters a model carries around its layers (`contract.wrapped`) convert merged into it, or alone as an
adapter folder (`lora=adapter`: its weights file and settings file, no model check).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, Component
from ckptctl.contract.capabilities import NO_NAME_MAP, HfModel, ModelSpec, NativeModel
from ckptctl.contract.wrapped import WrappedAdapter
from ckptctl.errors import CheckpointNotFound, CkptctlError, UnprovedModel
from ckptctl.families.value_head import find_value_head
from ckptctl.formats.documents import read_json
from ckptctl.layouts import Layout, get_layout, resolve
from ckptctl.ops.commit import UploadStaging, check_destination, staging_for, write_digests, write_small
from ckptctl.ops.convert.model_check import apply_ties, check_plan, compare_logits, model_spec, read_config
from ckptctl.ops.convert.options import (
    DEFAULT_MAX_SHARD_SIZE,
    DTYPE_NAMES,
    ConvertOptions,
    ConvertResult,
    LoraMode,
    ModelCheck,
    Target,
    Weights,
    parse_dtype,
)
from ckptctl.ops.convert.plan import Planned, Written, float_dtype, plan_adapter, plan_tensors
from ckptctl.ops.convert.side_files import (
    CONFIG_FILES,
    TOKENIZER_FILES,
    copy_side_files,
    find_adapter_settings,
    find_side_files,
)
from ckptctl.ops.convert.to_dcp import DCP_NAMESPACE, write_dcp
from ckptctl.ops.convert.to_hf import INDEX_NAME, write_hf
from ckptctl.ops.convert_source import convert_source
from ckptctl.ops.distributed_work import Ranks
from ckptctl.ops.report import NoProgress, Progress
from ckptctl.ops.sources import open_verified

__all__ = [
    "CONFIG_FILES",
    "DCP_NAMESPACE",
    "DEFAULT_MAX_SHARD_SIZE",
    "DTYPE_NAMES",
    "INDEX_NAME",
    "TOKENIZER_FILES",
    "ConvertOptions",
    "ConvertResult",
    "LoraMode",
    "ModelCheck",
    "Prepared",
    "Target",
    "Weights",
    "convert",
    "parse_dtype",
    "prepare",
    "write_prepared",
]

T = TypeVar("T")


def convert(
    src: str, dst: str, options: ConvertOptions | None = None, progress: Progress | None = None
) -> ConvertResult:
    """Convert the checkpoint at `src` into a new folder `dst`, a local path or an object store URL (see the
    modules of this package).

    Raises:
        CkptctlError: bad options, DST not empty (without `force`) or overlapping the source, a source
            that is incomplete, broken or lacks the component, names that collide after renaming.
        UnprovedModel: an HF model with no config.json to check it against, and no `mapping="none"`
            (nothing is written).
        CorruptCheckpoint: source bytes that disagree with their metadata (nothing is left at DST).
        StorageError: the output cannot be written or uploaded.
    """
    options = options or ConvertOptions()
    with io.counting() as read:
        return write_prepared(lambda: prepare(src, dst, options), options, progress or NoProgress(), read)


def _hf_model(checkpoint: Checkpoint, layout: Layout, options: ConvertOptions) -> HfModel | NativeModel | None:
    """The model under transformers names when the layout has it and `--to hf` converts the model; with
    `--mapping none`, under the names and shapes the framework's own load gives the model when the layout
    stores them otherwise (Megatron's stacked layers); None: the stored ones (the `--config` given is read for
    what the checkpoint does not record)."""
    if options.to is not Target.HF or options.component is not Component.MODEL:
        return None
    if options.mapping == NO_NAME_MAP:
        return convert_source(layout).native_model(checkpoint)
    config = None
    if options.config_dir is not None:
        path = io.join(options.config_dir, "config.json")
        if not io.exists(path):
            raise CheckpointNotFound(
                f"{options.config_dir} holds no config.json", "pass the folder that holds it to --config"
            )
        found = read_json(path)
        config = found if isinstance(found, dict) else None
    return convert_source(layout).hf_model(checkpoint, config)


def write_prepared(
    make: Callable[[], Prepared], options: ConvertOptions, progress: Progress, read: io.ByteCounter
) -> ConvertResult:
    """The output `make()` prepares (on rank 0: `prepare`, or `average`'s plan of computed tensors), written
    in this process or over `options.ranks`, whose every rank runs it; `read` counts the bytes read.

    Over several ranks, rank 0 plans and opens the staging folder, each rank writes its share of the
    output's data files (`write_hf`, `write_dcp`) into it, and rank 0 adds the side files and the digests
    and commits. For an object-store DST each rank stages its share in a local folder of its own and
    uploads it, rank 0 what completes the output last (`UploadStaging.commit`). With `--check-logits`,
    which loads the whole output, rank 0 converts an upload alone.
    """
    started = time.perf_counter()
    ranks = options.ranks if options.ranks is not None and options.ranks.size > 1 else None
    with contextlib.ExitStack() as stack:
        state: dict[str, Any] = {}

        def begin() -> _Work:
            prepared = state["prepared"] = make()
            staging = staging_for(prepared.dst, get_layout(options.to))
            state["staging"] = stack.enter_context(staging)
            staging.check_space(sum(p.nbytes for p in prepared.plan))
            upload = isinstance(staging, UploadStaging)
            shared = not (upload and options.check_logits)
            file_name = prepared.adapter.weights_name if prepared.adapter is not None else None
            return _Work(prepared.checkpoint.url, prepared.plan, staging.out, prepared.dst, shared, upload, file_name)

        work = _on_leader(ranks, begin)
        sharing = ranks if work.shared else None
        if sharing is not None and work.upload:

            def stage_own_share() -> None:
                """Every rank but 0 stages its files in a local folder of its own (hosts share no TMPDIR)."""
                if not sharing.leader:
                    own = UploadStaging(work.dst, get_layout(options.to), sharing.rank)
                    state["staging"] = stack.enter_context(own)

            sharing.each(stage_own_share)
        out = state["staging"].out if "staging" in state else work.out
        written: Written | None = None
        if sharing is not None or ranks is None or ranks.leader:
            try:
                if options.to is Target.HF:
                    written = write_hf(work.url, work.plan, out, options, progress, sharing, work.file_name)
                else:
                    written = write_dcp(work.url, work.plan, out, options.dcp_file_size, progress, sharing)
            finally:
                progress.finish()  # a bar left running on an error would hide the terminal's cursor
        sealed = _on_leader(ranks, lambda: _seal(state["prepared"], state["staging"].out, written, options))
        if sharing is not None and work.upload:
            uploaded = state["staging"].commit(options.force, progress, ranks=sharing)
        else:
            uploaded = _on_leader(ranks, lambda: state["staging"].commit(options.force, progress))
        return _on_leader(
            ranks, lambda: _result(state["prepared"], written, sealed, uploaded, options, read.bytes_read, started)
        )


@dataclass(frozen=True, slots=True)
class _Work:
    """What every rank needs to write its share: the source, the plan, the staging folder's output folder,
    DST, whether the ranks share the writing (else rank 0 writes alone), whether the output is staged for an
    upload (then each rank stages its share in a local folder of its own), and the one file an adapter's
    tensors go into (None: model shards)."""

    url: str
    plan: list[Planned]
    out: str
    dst: str
    shared: bool
    upload: bool
    file_name: str | None = None


@dataclass(frozen=True, slots=True)
class Prepared:
    """The checked source and what to make of it: `checkpoint` is where the output's stored tensors are read
    (the base model an adapter is merged into, else the source itself), `url` the source converted,
    `adapter` the adapter folder written instead of a model (`lora=adapter`)."""

    src: str
    dst: str
    url: str
    layout: str
    checkpoint: Checkpoint
    base: Checkpoint | None
    plan: list[Planned]
    weights: Weights
    side_files: dict[str, str]
    made_config: Mapping[str, Any] | None
    config: dict[str, Any] | None
    spec: ModelSpec | None
    tied: tuple[str, ...]
    notes: list[str]
    adapter: WrappedAdapter | None = None
    mapping: str | None = None


def _on_leader(ranks: Ranks | None, work: Callable[[], T]) -> T:
    return work() if ranks is None else ranks.lead(work)


def prepare(src: str, dst: str, options: ConvertOptions) -> Prepared:
    """The checked source `src` and the plan of its output at `dst` (nothing is written).

    Raises:
        CkptctlError: as `convert`, before anything is written.
    """
    if options.max_shard_size <= 0 or options.dcp_file_size <= 0:
        raise CkptctlError("the maximum shard and file sizes must be positive")
    if options.check_logits and (options.to is not Target.HF or options.component is not Component.MODEL):
        raise CkptctlError("--check-logits compares the logits of a model converted --to hf (--component model)")
    dst = check_destination(src, dst, options.force)
    layout, ref = resolve(src, options.layout)
    url = ref.url
    checkpoint = open_verified(layout, ref)
    notes: list[str] = []
    if options.lora is LoraMode.ADAPTER:
        if convert_source(layout).adapter(checkpoint) is not None:
            raise CkptctlError(
                f"{checkpoint.url} ({layout.name}) holds an adapter already: --lora adapter takes a model saved with "
                "adapters around its layers",
                "drop --lora adapter to merge it into its base model (--merge-adapter BASE)",
            )
        return _prepare_adapter(src, dst, layout, checkpoint, options, notes)
    given = options.given_scaling()
    base = _base_model(checkpoint, layout, dst, options, notes)
    if base is not None and given is not None:  # else silently ignored: the adapter's own settings merge it
        raise CkptctlError(
            f"{checkpoint.url} is an adapter: its adapter_config.json gives the scaling, --lora-alpha is for a model "
            "saved with adapters around its layers",
            "drop --lora-alpha (--lora-r, --lora-rslora)",
        )
    # The output's stored tensors and its config come from the base model when an adapter is merged into it.
    source, source_layout = (base, get_layout(base.layout)) if base is not None else (checkpoint, layout)
    source_reads = convert_source(source_layout)
    hf = _hf_model(checkpoint, layout, options) if base is None else None
    made_config = hf.config if isinstance(hf, HfModel) and options.config_dir is None else None
    folders = source_reads.config_folders(source)
    side_files, side_notes = find_side_files(source.url, options, folders, config_made=made_config is not None)
    if made_config is None and options.config_dir is None and "config.json" not in side_files:
        made_config = source_reads.model_config(source)
        if made_config is not None:
            side_files, side_notes = find_side_files(source.url, options, folders, config_made=True)
            side_notes.append(
                f"config.json written from the model config that {source.url} records (pass --config DIR to use another)"
            )
    checks = options.check_model or options.check_logits
    config: dict[str, Any] | None = None
    # An HF output's name map may need the config (head sizes), whether or not the model is checked. The
    # config the output gets: the copied config.json, else the one the layout made (Megatron's).
    if checks or options.to is Target.HF:
        if "config.json" in side_files:
            config = read_config(side_files, notes)
        elif made_config is not None:
            config = dict(made_config)
    plan, weights, mapping = plan_tensors(
        checkpoint,
        layout,
        options,
        notes,
        config,
        hf,
        base=base,
        adapter_settings=lambda names: find_adapter_settings(names, options, checkpoint, layout, notes),
    )
    notes += side_notes
    if config is None:  # after planning, which names a source without model tensors, or a bad --mapping
        _refuse_unproved(source, source_layout, side_files, options)
    if base is None and options.to is Target.HF and options.component is Component.MODEL and config is not None:
        plan, config, made_config = _value_head(source, source_layout, plan, config, made_config, side_files, notes)
    why_not: list[str] = []
    spec = None
    if config is not None and checks and options.component is Component.MODEL:
        spec = model_spec(config, plan, why_not)
    notes += why_not
    tied: tuple[str, ...] = ()
    if spec is not None:
        plan, tied = apply_ties(source, plan, spec, options.to)
        if options.check_model:
            check_plan(plan, spec, options.to)
    elif options.check_logits:
        raise CkptctlError(
            f"cannot compare logits: {why_not[0] if why_not else 'the output gets no config.json'}",
            "pass the folder of the model's config.json with --config (transformers 5 must be installed)",
        )
    if options.mapping == NO_NAME_MAP and _writes_hf_model(options):
        mapping = NO_NAME_MAP
        if spec is None:
            notes.append(
                f"--mapping {NO_NAME_MAP}: the tensors keep the names (and row orders) the {source_layout.name} checkpoint "
                "stores, and no model check ran, so the output is not proved to load with transformers' from_pretrained"
            )
    return Prepared(
        src,
        dst,
        url,
        layout.name,
        source,
        base,
        plan,
        weights,
        side_files,
        made_config,
        config,
        spec,
        tied,
        notes,
        mapping=mapping,
    )


def _writes_hf_model(options: ConvertOptions) -> bool:
    """Whether the output is meant as a Hugging Face model folder (the model, `--to hf`): what `from_pretrained`
    loads, so what the model check proves."""
    return options.to is Target.HF and options.component is Component.MODEL


def _refuse_unproved(
    checkpoint: Checkpoint, layout: Layout, side_files: Mapping[str, str], options: ConvertOptions
) -> None:
    """Refuse an HF model output that no config can prove (`model_check`) unless the raw names were asked for.

    Without a config.json nothing tells whether the stored names are transformers' or the framework's own
    (torchtitan's `layers.0.attention.wq.weight`, a plain module's `0.weight`), nor whether q/k rows are in
    transformers' rotary order: the folder would look like an HF model and load as none, or load wrong.

    Raises:
        UnprovedModel: an HF model output without a config, and no `--mapping none`.
    """
    if not _writes_hf_model(options) or options.mapping == NO_NAME_MAP:
        return
    found = side_files.get("config.json")
    why = (
        f"the config.json found ({found}) does not parse as a JSON object"
        if found is not None
        else "none beside it, none given with --config"
    )
    raise UnprovedModel(
        f"no config.json proves that {checkpoint.url} ({layout.name}) converts to a Hugging Face model ({why}): "
        "nothing checks that the tensor names, shapes and rotary q/k row orders are transformers' rather than the "
        "checkpoint's own, and from_pretrained would find no config",
        "pass the folder of the model's config.json with --config PATH (and --mapping MAP where its framework's "
        f"names need a map), or --mapping {NO_NAME_MAP} to write the tensors under their own names, not proved "
        "loadable by from_pretrained",
    )


def _value_head(
    checkpoint: Checkpoint,
    layout: Layout,
    plan: list[Planned],
    config: dict[str, Any],
    made_config: Mapping[str, Any] | None,
    side_files: dict[str, str],
    notes: list[str],
) -> tuple[list[Planned], dict[str, Any], Mapping[str, Any] | None]:
    """The plan, config and config to write of a critic or reward model (`families.value_head`): its head
    named as transformers names it, and a config naming the transformers class that computes its values (the
    copied config.json is then written as that config); unchanged for a model without a value head."""
    head = find_value_head(
        {p.name: p.shape for p in plan}, config, convert_source(layout).value_head_task(checkpoint), notes
    )
    if head is None:
        return plan, config, made_config
    plan = [replace(p, name=head.names.get(p.name, p.name)) for p in plan]
    if not head.changed:
        return plan, config, made_config
    side_files.pop("config.json", None)
    notes.append(
        f"a value head: config.json written for {head.architecture} with one label, what computes its values "
        f"(the source's config names {', '.join(config.get('architectures') or ['no class'])})"
    )
    return plan, dict(head.config), head.config


def _prepare_adapter(
    src: str, dst: str, layout: Layout, checkpoint: Checkpoint, options: ConvertOptions, notes: list[str]
) -> Prepared:
    """The adapter folder of the adapters the checkpoint's model carries (`lora=adapter`), with the
    tokenizer found beside it; no config.json (the base model's is where the adapter is loaded onto).

    Raises:
        CkptctlError: an output other than HF's, another component, a base to merge into, or as `plan_adapter`.
    """
    if options.to is not Target.HF or options.component is not Component.MODEL or options.merge_adapter:
        raise CkptctlError(
            "--lora adapter writes the adapter of a model --to hf (--component model, no --merge-adapter)"
        )
    plan, adapter = plan_adapter(
        checkpoint,
        options,
        notes,
        lambda names: find_adapter_settings(names, options, checkpoint, layout, notes),
    )
    side_files, side_notes = find_side_files(
        checkpoint.url,
        options,
        convert_source(layout).config_folders(checkpoint),
        config_made=options.config_dir is None,
    )
    side_files.pop("config.json", None)
    notes += [n for n in side_notes if "config.json" not in n]
    return Prepared(
        src=src,
        dst=dst,
        url=checkpoint.url,
        layout=layout.name,
        checkpoint=checkpoint,
        base=None,
        plan=plan,
        weights=Weights.STORED,
        side_files=side_files,
        made_config=None,
        config=None,
        spec=None,
        tied=(),
        notes=notes,
        adapter=adapter,
    )


def _base_model(
    checkpoint: Checkpoint, layout: Layout, dst: str, options: ConvertOptions, notes: list[str]
) -> Checkpoint | None:
    """The base model to merge the adapter `checkpoint` holds into (`ConvertSource.adapter`), opened and verified:
    `merge_adapter`, else the local folder the adapter names as its base; None when it holds a model.

    Raises:
        CkptctlError: `merge_adapter` given for a model, an adapter without a base to merge it into, a base
            that is itself an adapter, incomplete or broken, or that DST would overwrite.
    """
    adapter = convert_source(layout).adapter(checkpoint)
    wanted = options.merge_adapter
    if adapter is None:
        if wanted is not None:
            raise CkptctlError(
                f"{checkpoint.url} ({layout.name}) holds a model, not an adapter: --merge-adapter merges an adapter "
                "folder into the base model it names",
                "pass the adapter folder as SRC",
            )
        return None
    if options.component is not Component.MODEL:
        raise CkptctlError(f"{checkpoint.url} holds a {adapter.kind} adapter: it converts as a merged model only")
    if wanted is None:
        hint = adapter.base_hint
        if hint is None or not io.is_dir(hint):
            named = f" (it names {hint!r} as its base, which is no local folder)" if hint else ""
            raise CkptctlError(
                f"{checkpoint.url} is a {adapter.kind} adapter, not a model{named}",
                "pass the base model's folder with --merge-adapter BASE to write the merged model",
            )
        wanted = hint
        notes.append(f"merging into {hint}, the base model the adapter names")
    check_destination(wanted, dst, options.force)
    base_layout, base_ref = resolve(wanted)
    base = open_verified(base_layout, base_ref)
    if convert_source(base_layout).adapter(base) is not None:
        raise CkptctlError(f"{base.url} is an adapter too: --merge-adapter takes the base model's folder")
    return base


@dataclass(frozen=True, slots=True)
class _Sealed:
    """What rank 0 added to the staged output before the commit: side files, the logits check, file names."""

    copied: tuple[str, ...]
    logits: float | None
    files: tuple[str, ...]


def _seal(prepared: Prepared, out: str, written: Written | None, options: ConvertOptions) -> _Sealed:
    """Side files, the logits check and the digests, into the staged output `out` (rank 0)."""
    assert written is not None  # rank 0 always writes
    plan, checkpoint, config = prepared.plan, prepared.checkpoint, prepared.config
    copied = copy_side_files(
        prepared.side_files,
        out,
        options.dtype or float_dtype(plan),
        options.dtype is not None,
        prepared.made_config,
    )
    if prepared.adapter is not None:
        settings = json.dumps(dict(prepared.adapter.settings), indent=2, sort_keys=True).encode() + b"\n"
        write_small(os.path.join(out, prepared.adapter.settings_name), settings)
        copied = tuple(sorted((*copied, prepared.adapter.settings_name)))
    logits = compare_logits(checkpoint, plan, out, config) if options.check_logits and config else None
    write_digests(out, written.digests)
    # The other ranks' files of an upload are in their own staging folders: the digests name them.
    files = tuple(sorted({*os.listdir(out), *written.digests}))
    return _Sealed(copied, logits, files)


def _result(
    prepared: Prepared,
    written: Written | None,
    sealed: _Sealed,
    uploaded: int,
    options: ConvertOptions,
    bytes_read: int,
    started: float,
) -> ConvertResult:
    """What the conversion did (rank 0)."""
    assert written is not None  # rank 0 always writes
    plan = prepared.plan
    spec = prepared.spec
    derived = sum(1 for p in plan if p.derived is not None)
    return ConvertResult(
        src=prepared.src,
        dst=prepared.dst,
        to=options.to.value,
        layout=prepared.layout,
        tensors=len(plan),
        bytes=sum(p.nbytes for p in plan),
        files=sealed.files,
        bytes_read=bytes_read,
        seconds=time.perf_counter() - started,
        dtype=options.dtype,
        copied=sealed.copied,
        streamed=written.streamed,
        assembled=written.assembled - derived,
        warnings=tuple(prepared.notes),
        checkpoint=prepared.url,
        weights=prepared.weights.value,
        uploaded=uploaded,
        model=ModelCheck(spec.architecture, len(plan), prepared.tied, sealed.logits) if spec is not None else None,
        base=prepared.base.url if prepared.base is not None else "",
        derived=derived,
        mapping=prepared.mapping,
    )
