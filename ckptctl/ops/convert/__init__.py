"""`convert`: a checkpoint's model (or another component) to a Hugging Face folder or to a torch DCP folder.

The source is the checkpoint `layouts.resolve` names: the folder itself when it is one, else the
checkpoint a layout's `latest`-style pointer in it names (a save folder's `latest` file). It must be
complete and pass its layout's structural verification.

The command reads like its modules, in order: `options` (what is asked, what was done), `plan` (which
tensors, names, dtypes and weights), `side_files` (config and tokenizer files), `model_check` (the plan
against the model the config names: tied weights, missing, reshaped and leftover tensors), `to_hf` /
`to_dcp` (the writers), `commit` (staging, digests and the move or upload into DST).
"""

from __future__ import annotations

import os
import time

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointState, Component
from ckptctl.errors import CheckpointInProgress, CheckpointNotFound, CkptctlError, CorruptCheckpoint
from ckptctl.formats.documents import read_json
from ckptctl.layouts import Layout, get_layout, resolve
from ckptctl.layouts.base import HfModel
from ckptctl.ops.convert.commit import Staging, UploadStaging, check_destination, write_digests
from ckptctl.ops.convert.model_check import apply_ties, check_plan, compare_logits, model_spec, read_config
from ckptctl.ops.convert.options import (
    DEFAULT_MAX_SHARD_SIZE,
    DTYPE_NAMES,
    ConvertOptions,
    ConvertResult,
    ModelCheck,
    Target,
    Weights,
    parse_dtype,
)
from ckptctl.ops.convert.plan import float_dtype, plan_tensors
from ckptctl.ops.convert.side_files import CONFIG_FILES, TOKENIZER_FILES, copy_side_files, find_side_files
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


def _hf_model(checkpoint: Checkpoint, layout: Layout, options: ConvertOptions) -> HfModel | None:
    """The model under transformers names when the layout has it and `--to hf` converts the model (the
    `--config` given is read for what the checkpoint does not record)."""
    if options.to is not Target.HF or options.component is not Component.MODEL:
        return None
    config = None
    if options.config_dir is not None:
        path = io.join(options.config_dir, "config.json")
        if not io.exists(path):
            raise CheckpointNotFound(
                f"{options.config_dir} holds no config.json", "pass the folder that holds it to --config"
            )
        found = read_json(path)
        config = found if isinstance(found, dict) else None
    return layout.hf_model(checkpoint, config)


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
    if ref.state is CheckpointState.ABANDONED:
        raise CorruptCheckpoint(f"{url} is {ref.note}", "convert a committed checkpoint instead")
    checkpoint = layout.open(url)
    problems = [p for p in layout.verify(checkpoint) if p.severity == "error"]
    if problems or checkpoint.ref.state is CheckpointState.BROKEN:
        first = problems[0].message if problems else checkpoint.ref.note
        raise CorruptCheckpoint(
            f"{url} fails structural verification: {first}", f"run `ckptctl verify {url}` for the full report"
        )
    notes: list[str] = []
    hf = _hf_model(checkpoint, layout, options)
    plan, weights = plan_tensors(checkpoint, layout, options, notes, hf)
    made_config = hf.config if hf is not None and options.config_dir is None else None
    side_files, side_notes = find_side_files(
        url, options, layout.config_folders(checkpoint), config_made=made_config is not None
    )
    notes += side_notes
    config = None
    if options.check_model or options.check_logits:
        # the config the output gets: the copied config.json, else the one the layout made (Megatron's)
        config = read_config(side_files, notes) if "config.json" in side_files else made_config and dict(made_config)
    why_not: list[str] = []
    spec = None
    if config is not None and options.component is Component.MODEL:
        spec = model_spec(config, plan, why_not)
    notes += why_not
    tied: tuple[str, ...] = ()
    if spec is not None:
        plan, tied = apply_ties(checkpoint, plan, spec, options.to)
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
                written = write_hf(checkpoint, plan, staging.out, options, progress)
            else:
                written = write_dcp(checkpoint, plan, staging.out, progress)
        finally:
            progress.finish()  # a bar left running on an error would hide the terminal's cursor
        copied = copy_side_files(
            side_files, staging.out, options.dtype or float_dtype(plan), options.dtype is not None, made_config
        )
        logits = compare_logits(checkpoint, plan, staging.out, config) if options.check_logits and config else None
        write_digests(staging.out, written.digests)
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
        assembled=written.assembled,
        warnings=tuple(notes),
        checkpoint=url,
        weights=weights.value,
        uploaded=uploaded,
        model=ModelCheck(spec.architecture, len(plan), tied, logits) if spec is not None else None,
    )
