"""`ckptctl average CKPT CKPT... DST` and `ckptctl average RUN DST --last K | --steps S,...`."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.options import (
    ConfigOpt,
    DcpFileSizeOpt,
    DtypeOpt,
    ForceOpt,
    JsonOpt,
    LastOpt,
    MappingOpt,
    MaxShardSizeOpt,
    ModelWeightsOpt,
    NoCheckModelOpt,
    QuietOpt,
    RereadOpt,
    TargetChoice,
    TokenizerOpt,
    ToOpt,
    WeightsChoice,
    WorkersOpt,
    bad_value,
    output_options,
)
from ckptctl.cli.output import Output, human_bytes, styled
from ckptctl.cli.ranks import write_on_ranks

if TYPE_CHECKING:
    from ckptctl.ops.average import AverageResult

HELP = """Average checkpoints of one model, of any layouts, into a Hugging Face folder (or a torch DCP checkpoint): uniformly, with --weights, or as an EMA (--ema). float64 accumulation and one rounding; inputs that do not match are refused before anything is written."""

EXAMPLES = """\
ckptctl average runs/llama/step-1000 runs/llama/step-2000 runs/llama/step-3000 averaged/
ckptctl average runs/llama averaged/ --last 5 --dtype bf16
ckptctl average runs/llama averaged/ --steps 8000,9000,10000 --weights 0.2,0.3,0.5
ckptctl average runs/llama ema/ --last 10 --ema 0.9
ckptctl average runs/llama averaged-dcp/ --last 3 --to dcp
"""

#: The reference of the command (docs/cli.md, by scripts/gen_cli_reference.py): what the help leaves out.
REFERENCE = r"""The uniform, weighted (`--weights 0.2,0.3,0.5`) or exponential moving average (`--ema DECAY`) of checkpoints
of the same model, of any layouts `convert` reads (a 2-rank FSDP2 DCP step, a DeepSpeed ZeRO tag's fp32
master weights, an HF export, a single weights file, ... mixed), paired by `diff`'s name rules, written
`--to hf` (default) or `--to dcp`, staged, digested and committed like `convert`. `--last K` takes the K
newest complete checkpoints of a run, `--steps` picks them by step. Arithmetic, element by element in
float64 in the inputs' order: `acc = w1·x1`, then `acc = acc + wi·xi` (uniform: `wi = 1/N`); `--ema D`
orders the inputs by step and computes `acc = x_oldest`, then `acc = D·acc + (1 - D)·x`. Each product and
sum is rounded once (no fused multiply-add), the result once, to nearest even, to the output dtype (the last
input's, or `--dtype`; float64 -> bf16 straight, not through float32): identical inputs average to themselves
bit for bit, and the suite checks every output bit for bit against torch computing that formula. Inputs
whose tensors differ in name, shape or kind of dtype are refused before anything is written (exit 2, the
first such tensor named), as are weights that do not sum to 1 (unless `--no-normalize`); integer and bool
tensors must be equal everywhere. Each tensor is read once from each input; memory stays near three float64
copies of the largest tensor whatever N.

```bash
ckptctl average runs/llama averaged/ --last 5 --dtype bf16
ckptctl average runs/llama ema/ --last 10 --ema 0.9
ckptctl average dcp-run/step-9000 ds-run/global_step10000 hf-export/ merged/ --weights 0.2,0.3,0.5
```

RUN DST --last K averages the K newest complete checkpoints of a run (oldest first, as `ckptctl list` orders them); --steps picks them by step. Config and tokenizer files come from the last input (the newest with --last, --steps and --ema), or from --config/--tokenizer; with a config naming an architecture, every input is checked against the model transformers builds on the meta device, as `convert` does. An `--to hf` average with no config to check the output against is refused before anything is written (exit 2), as `convert` refuses it: pass `--config PATH`, or `--mapping none` to write the inputs' own names, which the output then says (a warning, `"mapping": "none"` in its JSON) and no model check proves loadable by from_pretrained.

Each tensor is read once from each input and accumulated, block by block straight from the files of local inputs, so memory stays near one output copy of the largest tensor (three float64 copies where an input must be read whole: a remote one, float8) whatever the number of inputs or the model size. The output is staged, checked, digested and renamed into place like `convert`'s (an interrupted average leaves nothing at DST); DST may be an object store URL, and torchrun or --workers share the writing.

Options in detail: `--weights` gives one weight per input in the order given (oldest first with `--last`/`--steps`); they must sum to 1 unless `--no-normalize`. `--ema DECAY` (0 <= DECAY < 1) orders the inputs by step. `--dtype` rounds once from the float64 average; by default the output has the last input's dtypes. `--model-weights` picks, for inputs that keep two copies of the model (DeepSpeed ZeRO), the fp32 master weights (`auto`, `master`) or the 16-bit module weights (`stored`), as `convert --model-weights`.
"""


T = TypeVar("T")


#: Options of a rarer need, left to the reference (`cli.command.Command.more`).
MORE = ("--no-normalize", "--dcp-file-size", "--model-weights", "--mapping", "--reread", "--no-check-model")


def register(app: typer.Typer) -> None:
    add_command(app, "average", average, HELP, EXAMPLES, more=MORE)


def average(
    paths: Annotated[
        list[str],
        typer.Argument(metavar="CKPT... DST", help="Checkpoints, then the output (RUN DST with --last, --steps)."),
    ],
    last: LastOpt = None,
    steps: Annotated[
        str | None,
        typer.Option("--steps", metavar="S1,S2,...", help="The checkpoints of RUN of these steps."),
    ] = None,
    weights: Annotated[
        str | None,
        typer.Option(
            "--weights",
            metavar="W1,W2,...",
            help="One weight per input, summing to 1 (default: 1/N each).",
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
            help="Exponential moving average with this decay (0 <= D < 1).",
        ),
    ] = None,
    to: ToOpt = TargetChoice.hf,
    dtype: DtypeOpt = None,
    max_shard_size: MaxShardSizeOpt = "5GB",
    dcp_file_size: DcpFileSizeOpt = "5GB",
    model_weights: ModelWeightsOpt = WeightsChoice.auto,
    config: ConfigOpt = None,
    mapping: MappingOpt = None,
    tokenizer: TokenizerOpt = None,
    force: ForceOpt = False,
    reread: RereadOpt = False,
    workers: WorkersOpt = None,
    no_check_model: NoCheckModelOpt = False,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.average import AverageOptions, run_inputs
    from ckptctl.ops.average import average as run_average
    from ckptctl.ops.convert import Weights

    from_run = last is not None or steps is not None
    if from_run and len(paths) != 2:
        raise bad_value("--last" if last is not None else "--steps", "takes RUN DST: the run folder and the output")
    if not from_run and len(paths) < 3:
        raise typer.BadParameter("give at least two checkpoints and DST (or RUN DST with --last K or --steps)")
    options = AverageOptions(
        **output_options(
            to, dtype, max_shard_size, dcp_file_size, config, mapping, tokenizer, force, reread, no_check_model
        ),
        weights=_numbers(weights, float, "--weights") if weights is not None else None,
        normalize=not no_normalize,
        ema=ema,
        source_weights=Weights(model_weights.value),
    )
    *sources, dst = paths
    if from_run:
        chosen = _numbers(steps, int, "--steps") if steps is not None else None
        sources = run_inputs(sources[0], last=last, steps=chosen)
    write_on_ranks(
        workers, options, dst, partial(run_average, sources, dst), _render, json_output=json_output, quiet=quiet
    )


def _numbers(text: str, kind: Callable[[str], T], option: str) -> tuple[T, ...]:
    try:
        return tuple(kind(part) for part in text.split(","))
    except ValueError as exc:
        raise bad_value(option, f"{text!r} is not a comma-separated list of numbers") from exc


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
    if result.mapping == "none":
        unproved = "" if result.model is not None else ", not proved to load with from_pretrained"
        out.print(f"  names: the inputs' own (--mapping none){unproved}")
