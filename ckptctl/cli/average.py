"""`ckptctl average CKPT CKPT... DST` and `ckptctl average RUN DST --last K | --steps S,...`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.convert import DtypeChoice, TargetChoice, WeightsChoice
from ckptctl.cli.options import JsonOpt, QuietOpt, bad_value
from ckptctl.cli.output import Output, human_bytes, interrupted_write, styled
from ckptctl.cli.ranks import WorkersOpt, job_ranks, prints

if TYPE_CHECKING:
    from ckptctl.ops.average import AverageOptions, AverageResult

HELP = """Average checkpoints of the same model, of any layouts, into a Hugging Face folder (or a torch DCP checkpoint): uniformly, with --weights, or as an exponential moving average (--ema).

The inputs are read as `convert` reads them (torch DCP of any number of ranks, DeepSpeed ZeRO tags from their fp32 master weights, universal checkpoints, Megatron, verl, ByteCheckpoint, Lightning, ckptctl's own, HF folders, single weights files) and paired by the tensor names `diff` matches (a DCP step with its HF export). Every input must hold the same tensors with the same shapes and kinds of dtype: the first that does not is named and nothing is written (exit code 2). Integer and bool tensors must be equal in every input and are kept as they are.

Arithmetic, element by element in float64 and in the inputs' order: acc = w1·x1, then acc = acc + wi·xi (uniform: wi = 1/N); with --ema D the inputs are ordered by step and acc = x_oldest, then acc = D·acc + (1 - D)·x for each newer input. Each product and sum is rounded once, then the result is rounded once, to nearest even, to the output dtype (the last input's, its fp32 master weights where it keeps them, or --dtype). Identical inputs average to themselves bit for bit.

RUN DST --last K averages the K newest complete checkpoints of a run (oldest first, as `ckptctl list` orders them); --steps picks them by step. Config and tokenizer files come from the last input (the newest with --last, --steps and --ema), or from --config/--tokenizer; with a config naming an architecture, every input is checked against the model transformers builds on the meta device, as `convert` does.

Each tensor is read once from each input and accumulated, so memory stays near three float64 copies of the largest tensor whatever the number of inputs or the model size. The output is staged, checked, digested and renamed into place like `convert`'s (an interrupted average leaves nothing at DST); DST may be an object store URL, and torchrun or --workers share the writing."""

EXAMPLES = """\
ckptctl average runs/llama/step-1000 runs/llama/step-2000 runs/llama/step-3000 averaged/
ckptctl average runs/llama averaged/ --last 5 --dtype bf16
ckptctl average runs/llama averaged/ --steps 8000,9000,10000 --weights 0.2,0.3,0.5
ckptctl average runs/llama ema/ --last 10 --ema 0.9
ckptctl average ds-run/global_step500 hf-export-step1000/ merged/ --config base-model/
ckptctl average runs/llama averaged-dcp/ --last 3 --to dcp
"""


T = TypeVar("T")


def register(app: typer.Typer) -> None:
    add_command(app, "average", average, HELP, EXAMPLES)


def average(
    paths: Annotated[
        list[str],
        typer.Argument(
            metavar="CKPT... DST",
            help="The checkpoints to average, then the output folder; with --last or --steps: RUN DST.",
            show_default=False,
        ),
    ],
    last: Annotated[
        int | None,
        typer.Option("--last", metavar="K", help="Average the K newest complete checkpoints of RUN.", min=1),
    ] = None,
    steps: Annotated[
        str | None,
        typer.Option("--steps", metavar="S1,S2,...", help="Average the complete checkpoints of RUN of these steps."),
    ] = None,
    weights: Annotated[
        str | None,
        typer.Option(
            "--weights",
            metavar="W1,W2,...",
            help="One weight per input, in the order given (oldest first with --last/--steps); they must sum to "
            "1 unless --no-normalize. Default: uniform, 1/N each.",
        ),
    ] = None,
    no_normalize: Annotated[
        bool, typer.Option("--no-normalize", help="Use --weights as given, whatever their sum.")
    ] = False,
    ema: Annotated[
        float | None,
        typer.Option(
            "--ema",
            metavar="DECAY",
            help="Exponential moving average over the inputs ordered by step: avg = x_oldest, then "
            "avg = DECAY·avg + (1 - DECAY)·x for each newer input (0 <= DECAY < 1).",
        ),
    ] = None,
    to: Annotated[TargetChoice, typer.Option("--to", metavar="FORMAT", help="Output format: hf or dcp.")] = (
        TargetChoice.hf
    ),
    dtype: Annotated[
        DtypeChoice | None,
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="Write floating-point tensors as bf16, fp16 or fp32 (or bfloat16, float16, float32), rounded once "
            "from the float64 average; default: the last input's dtypes.",
        ),
    ] = None,
    max_shard_size: Annotated[
        str,
        typer.Option("--max-shard-size", metavar="SIZE", help="Most tensor bytes per safetensors shard (--to hf)."),
    ] = "5GB",
    dcp_file_size: Annotated[
        str,
        typer.Option("--dcp-file-size", metavar="SIZE", help="Most tensor bytes per data file (--to dcp)."),
    ] = "5GB",
    model_weights: Annotated[
        WeightsChoice,
        typer.Option(
            "--model-weights",
            metavar="WHICH",
            help="For inputs that keep two copies of the model (DeepSpeed ZeRO): the fp32 master weights (auto, "
            "master) or the 16-bit module weights (stored), as convert --weights.",
        ),
    ] = WeightsChoice.auto,
    config: Annotated[
        str | None,
        typer.Option("--config", metavar="DIR", help="Folder holding config.json (default: beside the last input)."),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer", metavar="DIR", help="Folder holding tokenizer files (default: beside the last input)."
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace DST if it is not empty (on an object store: delete its objects).")
    ] = False,
    reread: Annotated[
        bool,
        typer.Option("--reread", help="Read every written file back from disk and check its digest (doubles the I/O)."),
    ] = False,
    workers: WorkersOpt = None,
    no_check_model: Annotated[
        bool,
        typer.Option(
            "--no-check-model",
            help="Do not check the inputs against the architecture config.json names (tied weights unresolved).",
        ),
    ] = False,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.average import AverageOptions, run_inputs
    from ckptctl.ops.convert import Target, Weights, parse_dtype
    from ckptctl.units import parse_size

    from_run = last is not None or steps is not None
    if from_run and len(paths) != 2:
        raise bad_value("--last" if last is not None else "--steps", "takes RUN DST: the run folder and the output")
    if not from_run and len(paths) < 3:
        raise typer.BadParameter("give at least two checkpoints and DST (or RUN DST with --last K or --steps)")
    try:
        shard_bytes = parse_size(max_shard_size, minimum=1)
    except ValueError as exc:
        raise bad_value("--max-shard-size", str(exc)) from exc
    try:
        dcp_file_bytes = parse_size(dcp_file_size, minimum=1)
    except ValueError as exc:
        raise bad_value("--dcp-file-size", str(exc)) from exc
    options = AverageOptions(
        weights=_numbers(weights, float, "--weights") if weights is not None else None,
        normalize=not no_normalize,
        ema=ema,
        to=Target(to.value),
        dtype=parse_dtype(dtype.value) if dtype else None,
        max_shard_size=shard_bytes,
        dcp_file_size=dcp_file_bytes,
        source_weights=Weights(model_weights.value),
        config_dir=config,
        tokenizer_dir=tokenizer,
        force=force,
        check_model=not no_check_model,
        reread=reread,
    )
    *sources, dst = paths
    if from_run:
        chosen = _numbers(steps, int, "--steps") if steps is not None else None
        sources = run_inputs(sources[0], last=last, steps=chosen)
    with job_ranks(workers) as ranks:
        _average(sources, dst, replace(options, ranks=ranks), json_output, quiet or not prints(ranks), prints(ranks))


def _numbers(text: str, kind: Callable[[str], T], option: str) -> tuple[T, ...]:
    try:
        return tuple(kind(part) for part in text.split(","))
    except ValueError as exc:
        raise bad_value(option, f"{text!r} is not a comma-separated list of numbers") from exc


def _average(sources: list[str], dst: str, options: AverageOptions, json_output: bool, quiet: bool, show: bool) -> None:
    from ckptctl.ops.average import average as run_average

    out = Output(json_mode=json_output, quiet=quiet)
    try:
        result = run_average(sources, dst, options, out.progress())
    except KeyboardInterrupt:
        out.note(interrupted_write(dst))
        raise
    if not show:
        return
    if not quiet:
        for note in result.warnings:
            out.warn(note)
    if json_output:
        out.json(result.to_json())
        return
    _render(out, result)


def _render(out: Output, result: AverageResult) -> None:
    how = f"EMA (decay {result.ema:g})" if result.ema is not None else result.method
    cast = f", as {result.dtype}" if result.dtype else ""
    out.print(
        styled("averaged", "green"),
        f"{len(result.inputs)} checkpoints ({how}) into {result.dst} ({result.to}): {result.tensors} tensors "
        f"({human_bytes(result.bytes_written)}{cast}) in {result.seconds:.1f} s",
    )
    for item in result.inputs:
        step = "-" if item.step is None else str(item.step)
        out.print(f"  {item.weight:.6g}  step {step}  {item.url} ({item.layout})")
    if result.copied:
        out.print(f"  copied: {', '.join(result.copied)}")
    if result.model is not None:
        tied = f"; tied: {', '.join(result.model.tied)}" if result.model.tied else ""
        out.print(f"  model: {result.model.tensors} tensors as {result.model.architecture} expects them{tied}")
