"""`convert`: a checkpoint's model (or another component) to a Hugging Face folder or to a torch DCP folder.

The source is the checkpoint `layouts.resolve` names: the folder itself when it is one, else the
checkpoint a layout's `latest`-style pointer in it names (a save folder's `latest` file). It must be
complete and pass its layout's structural verification.

The command reads like its modules, in order: `options` (what is asked, what was done), `plan` (which
tensors, names, dtypes and weights), `side_files` (config and tokenizer files), `model_check` (the plan
against the model the config names: tied weights, missing, reshaped and leftover tensors), `to_hf` /
`to_dcp` (the writers), `commit` (staging, digests and the move or upload into DST).

An adapter (`Layout.adapter`: a PEFT LoRA folder) is not a model: it converts merged into its base model
(`merge_adapter`), whose tensors, config and tokenizer the output takes, the adapted weights computed.
"""

from __future__ import annotations

import os
import time

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointState, Component
from ckptctl.errors import CheckpointInProgress, CkptctlError, CorruptCheckpoint
from ckptctl.layouts import Layout, get_layout, resolve
from ckptctl.ops.convert.commit import Staging, UploadStaging, check_destination, write_digests
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
from ckptctl.ops.convert.plan import float_dtype, plan_tensors
from ckptctl.ops.convert.side_files import (
    CONFIG_FILES,
    TOKENIZER_FILES,
    copy_side_files,
    find_adapter_settings,
    find_side_files,
)
from ckptctl.ops.convert.to_dcp import DCP_NAMESPACE, write_dcp
from ckptctl.ops.convert.to_hf import INDEX_NAME, write_hf
from ckptctl.ops.report import NoProgress, Progress

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
    "Target",
    "Weights",
    "convert",
    "parse_dtype",
]


def convert(
    src: str, dst: str, options: ConvertOptions | None = None, progress: Progress | None = None
) -> ConvertResult:
    """Convert the checkpoint at `src` into a new folder `dst`, a local path or an object store URL (see the
    modules of this package).

    Raises:
        CkptctlError: bad options, DST not empty (without `force`) or overlapping the source, a source
            that is incomplete, broken or lacks the component, names that collide after renaming.
        CorruptCheckpoint: source bytes that disagree with their metadata (nothing is left at DST).
        StorageError: the output cannot be written or uploaded.
    """
    with io.counting() as read:
        return _convert(src, dst, options or ConvertOptions(), progress or NoProgress(), read)


def _convert(src: str, dst: str, options: ConvertOptions, progress: Progress, read: io.ByteCounter) -> ConvertResult:
    started = time.perf_counter()
    if options.max_shard_size <= 0:
        raise CkptctlError("the maximum shard size must be positive")
    if options.check_logits and (options.to is not Target.HF or options.component is not Component.MODEL):
        raise CkptctlError("--check-logits compares the logits of a model converted --to hf (--component model)")
    dst = check_destination(src, dst, options.force)
    layout, ref = resolve(src, options.layout)
    url = ref.url
    if ref.state is CheckpointState.IN_PROGRESS:
        raise CheckpointInProgress(
            f"{url} is still being written ({ref.note or 'no completion marker'})", "wait for the save to finish"
        )
    checkpoint = _open_verified(layout, url)
    notes: list[str] = []
    base = _base_model(checkpoint, layout, dst, options, notes)
    # The output's stored tensors and its config come from the base model when an adapter is merged into it.
    source, source_layout = (base, get_layout(base.layout)) if base is not None else (checkpoint, layout)
    plan, weights = plan_tensors(
        checkpoint,
        layout,
        options,
        notes,
        base=base,
        adapter_settings=lambda names: find_adapter_settings(names, options, checkpoint, layout, notes),
    )
    side_files, side_notes = find_side_files(
        source.url, options, source_layout.config_folders(source), lambda: source_layout.model_config(source)
    )
    notes += side_notes
    config = read_config(side_files, notes) if options.check_model or options.check_logits else None
    why_not: list[str] = []
    spec = None
    if config is not None and options.component is Component.MODEL:
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

    staging = Staging(dst) if io.is_local(dst) else UploadStaging(dst, get_layout(options.to))
    with staging:
        staging.check_space(sum(p.nbytes for p in plan))
        try:
            if options.to is Target.HF:
                written = write_hf(source, plan, staging.out, options, progress)
            else:
                written = write_dcp(source, plan, staging.out, progress)
        finally:
            progress.finish()  # a bar left running on an error would hide the terminal's cursor
        copied = copy_side_files(side_files, staging.out, options.dtype or float_dtype(plan), options.dtype is not None)
        logits = compare_logits(source, plan, staging.out, config) if options.check_logits and config else None
        write_digests(staging.out, written.digests)
        derived = sum(1 for p in plan if p.derived is not None)
        files = tuple(sorted(os.listdir(staging.out)))
        uploaded = staging.commit(options.force, progress)
    return ConvertResult(
        src=src,
        dst=dst,
        to=options.to.value,
        layout=layout.name,
        tensors=len(plan),
        bytes=sum(p.nbytes for p in plan),
        files=files,
        bytes_read=read.bytes_read,
        seconds=time.perf_counter() - started,
        dtype=options.dtype,
        copied=copied,
        streamed=written.streamed,
        assembled=written.assembled - derived,
        warnings=tuple(notes),
        checkpoint=url,
        weights=weights.value,
        uploaded=uploaded,
        model=ModelCheck(spec.architecture, len(plan), tied, logits) if spec is not None else None,
        base=base.url if base is not None else "",
        derived=derived,
    )


def _open_verified(layout: Layout, url: str) -> Checkpoint:
    """The checkpoint at `url`, opened by `layout`.

    Raises:
        CorruptCheckpoint: it fails its layout's structural verification, or is broken.
    """
    checkpoint = layout.open(url)
    problems = [p for p in layout.verify(checkpoint) if p.severity == "error"]
    if problems or checkpoint.ref.state is CheckpointState.BROKEN:
        first = problems[0].message if problems else checkpoint.ref.note
        raise CorruptCheckpoint(
            f"{url} fails structural verification: {first}", f"run `ckptctl verify {url}` for the full report"
        )
    return checkpoint


def _base_model(
    checkpoint: Checkpoint, layout: Layout, dst: str, options: ConvertOptions, notes: list[str]
) -> Checkpoint | None:
    """The base model to merge the adapter `checkpoint` holds into (`Layout.adapter`), opened and verified:
    `merge_adapter`, else the local folder the adapter names as its base; None when it holds a model.

    Raises:
        CkptctlError: `merge_adapter` given for a model, an adapter without a base to merge it into, a base
            that is itself an adapter, incomplete or broken, or that DST would overwrite.
    """
    adapter = layout.adapter(checkpoint)
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
    if base_ref.state is CheckpointState.IN_PROGRESS:
        raise CheckpointInProgress(f"the base model {base_ref.url} is still being written ({base_ref.note})")
    base = _open_verified(base_layout, base_ref.url)
    if base_layout.adapter(base) is not None:
        raise CkptctlError(f"{base.url} is an adapter too: --merge-adapter takes the base model's folder")
    return base
