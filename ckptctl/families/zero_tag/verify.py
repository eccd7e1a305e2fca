"""Verify: every rank file present, parsing safely, agreeing with rank 0, and every tensor covered."""

from __future__ import annotations

from functools import partial

from ckptctl import io
from ckptctl.checkpoint import Problem, ProblemKind
from ckptctl.contract.base import LISTED_ABSENT
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.families.torch_file import torch_file_problems
from ckptctl.families.zero_tag.names import expected_rank_files, tag_files
from ckptctl.families.zero_tag.tag import (
    DeepSpeedTag,
    enum_value,
    optimizer_state_dict,
    read_partition_count,
    read_tag,
)
from ckptctl.families.zero_tag.tensor_index import tag_index
from ckptctl.formats.chunks import coverage_problems
from ckptctl.formats.torch_pickle import TorchPickle


def verify_tag(url: str, path_prefix: str = "") -> list[Problem]:
    """Structural problems of a tag folder (reads every rank file's `data.pkl` and zip directory).

    Checks: every model-states file for the MP size (and, under ZeRO-3, every DP rank) and exactly one
    optim-states file per partition are present (MISSING_FILE; extra ranks are UNEXPECTED_FILE
    warnings); each parses and is safe (BAD_METADATA, UNSAFE_PICKLE) and holds every storage it names
    (TRUNCATED); the optim files agree with `dp_world_size` and `partition_count`; the fp32 partitions
    hold what `param_shapes` needs and every tensor's chunks tile it (COVERAGE).
    """
    try:
        entries = io.list_dir(url)
    except CkptctlError:
        return [Problem(ProblemKind.MISSING_FILE, path_prefix or ".", f"the DeepSpeed tag folder {url} is missing")]
    files = tag_files(entries)
    if files is None:
        return [Problem(ProblemKind.MISSING_FILE, path_prefix or ".", "no DeepSpeed model or optim states")]
    problems = [
        Problem(ProblemKind.MISSING_FILE, path_prefix + name, f"{name} is missing")
        for name in files.missing_from_names()
    ]
    try:
        tag = read_tag(url, files)
    except CkptctlError as exc:
        return [*problems, Problem.from_error(exc, path_prefix + (files.rank0_model() or files.model_name(0, 0)))]
    expected_model, expected_optim = expected_rank_files(files, tag.dp_world_size, tag.mp_world_size, tag.zero_stage)
    reported = {p.path for p in problems}
    absent = [
        n for n in sorted((expected_model | expected_optim) - set(files.sizes)) if path_prefix + n not in reported
    ]
    for name in absent[:LISTED_ABSENT]:
        problems.append(
            Problem(
                ProblemKind.MISSING_FILE,
                path_prefix + name,
                f"{name} is missing (dp_world_size {tag.dp_world_size}, mp_world_size {tag.mp_world_size})",
            )
        )
    if len(absent) > LISTED_ABSENT:
        problems.append(
            Problem(
                ProblemKind.MISSING_FILE,
                path_prefix or ".",
                f"{len(absent) - LISTED_ABSENT} more rank files are missing "
                f"(dp_world_size {tag.dp_world_size}, mp_world_size {tag.mp_world_size})",
            )
        )
    for name in sorted((set(files.model.values()) | set(files.optim.values())) - expected_model - expected_optim):
        problems.append(
            Problem(
                ProblemKind.UNEXPECTED_FILE,
                path_prefix + name,
                f"a rank file beyond dp_world_size {tag.dp_world_size} (left by an earlier save with more ranks?)",
                severity="warning",
            )
        )
    if tag.partition_count is not None and tag.partition_count != tag.dp_world_size:
        problems.append(
            Problem(
                ProblemKind.BAD_METADATA,
                path_prefix + files.optim_name(0, 0),
                f"partition_count {tag.partition_count} differs from dp_world_size {tag.dp_world_size}",
            )
        )
    broken = False
    for name in sorted((expected_model | expected_optim) & set(files.sizes)):
        opened, found = torch_file_problems(path_prefix + name, partial(tag.open_file, name))
        problems += found
        if opened is None:
            broken = True
        elif name in expected_optim:
            problems += _optim_file_problems(tag, opened, path_prefix + name)
    if broken or any(p.severity == "error" for p in problems):
        return problems
    try:
        index = tag_index(tag, path_prefix)
    except CkptctlError as exc:
        return [*problems, Problem(ProblemKind.COVERAGE, path_prefix, exc.message)]
    return problems + coverage_problems(index)


def _optim_file_problems(tag: DeepSpeedTag, opened: TorchPickle, path: str) -> list[Problem]:
    try:
        osd = optimizer_state_dict(opened)
    except CorruptCheckpoint as exc:
        return [Problem(ProblemKind.BAD_METADATA, path, exc.message)]
    problems = []
    stage = enum_value(osd.get("zero_stage"))
    if type(stage) is int and stage != tag.zero_stage:
        problems.append(
            Problem(ProblemKind.BAD_METADATA, path, f"zero_stage {stage} differs from rank 0's {tag.zero_stage}")
        )
    count = read_partition_count(osd.get("partition_count"))
    if count is not None and tag.partition_count is not None and count != tag.partition_count:
        problems.append(
            Problem(
                ProblemKind.BAD_METADATA, path, f"partition_count {count} differs from rank 0's {tag.partition_count}"
            )
        )
    return problems
