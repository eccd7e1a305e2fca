"""`ckptctl convert SRC DST --to hf|dcp`."""

from __future__ import annotations

import enum
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.checkpoint import Component
from ckptctl.cli.command import add_command
from ckptctl.cli.options import ComponentOpt, JsonOpt, LayoutOpt, QuietOpt, bad_value
from ckptctl.cli.output import Output, human_bytes, interrupted_write, styled
from ckptctl.cli.ranks import WorkersOpt, job_ranks, prints

if TYPE_CHECKING:
    from ckptctl.ops.convert import ConvertOptions, ConvertResult

HELP = """Convert a checkpoint's model into a Hugging Face folder (or an HF model into a torch DCP checkpoint).

--to hf reads torch DCP (any number of ranks, FSDP/FSDP2 sharding), DeepSpeed ZeRO, ckptctl's own checkpoints and HF folders, and writes model.safetensors, or model-0000i-of-0000N.safetensors shards with model.safetensors.index.json. Tensors stream one at a time from the source's raw bytes into the output, so memory stays near the largest tensor whatever the model size. The state-dict prefix (model.) is removed so names match transformers; config and tokenizer files are taken from --config/--tokenizer or found beside the source.

DeepSpeed ZeRO 1-3 (a global_stepN tag folder, the save folder holding `latest`, or a Trainer checkpoint-N with DeepSpeed inside) gives the fp32 master weights, exactly as DeepSpeed's zero_to_fp32.py rebuilds them from the optimizer partitions, without DeepSpeed installed and without loading a partition whole; --weights stored writes the 16-bit module weights instead (ZeRO 0-2; ZeRO-3 keeps none, its model is the partitions).

Lightning checkpoints (an `epoch=E-step=S.ckpt` file, `last.ckpt`, the ModelCheckpoint folder holding it, a sharded FSDP `.ckpt/` folder, or a DeepSpeedStrategy `.ckpt/` folder, read as DeepSpeed's) give the LightningModule's state_dict under the model's own names (the `model.` attribute removed); config.json is taken from the module's hyper_parameters when they hold a transformers config, else give --config.

SRC may also be a single weights file: a `*.safetensors` file, or a torch.save zip such as `pytorch_model.bin` (read with the allowlisting unpickler: nothing in it runs).

An adapter (a PEFT folder: adapter_config.json + adapter_model.safetensors, or a Trainer checkpoint-N of a PEFT model, which holds one instead of the model) converts merged into its base model: --merge-adapter BASE writes BASE with every adapted weight W replaced by W + (lora_alpha/r)·B@A (rsLoRA: lora_alpha/sqrt(r); rank_pattern and alpha_pattern per module; fan_in_fan_out), and the adapter's modules_to_save tensors in place of BASE's: what PEFT's merge_and_unload() gives. DoRA and other PEFT types are refused. A model saved whole while wrapped by PEFT (q_proj.base_layer.weight beside q_proj.lora_A.default.weight, as FSDP, DeepSpeed, DCP and verl saves hold it) is written under the model's own names with the LoRA merged in; its lora_alpha comes from the run's adapter_config.json or verl's lora_train_meta.json (--adapter-config), or from --lora-alpha (with --lora-r, --lora-rslora) when the run kept neither; without any, convert refuses rather than guess. --lora adapter writes that model's adapter alone instead, as PEFT's save_pretrained does (adapter_model.safetensors + adapter_config.json), for PeftModel.from_pretrained(BASE, DST).

--to dcp writes a torch.distributed.checkpoint save with keys model.<name>, which dcp.load reads into a model of any world size (data files of --dcp-file-size each, one up to 5GB).

When config.json names an architecture and transformers is installed, the model is built on the meta device (no memory) and the output must hold every tensor it expects, with its shape, and nothing else: otherwise convert fails with exit code 1 and writes nothing (--no-check-model skips it). Tied weights follow transformers: an HF output leaves lm_head.weight out when tie_word_embeddings ties it, a DCP output holds it so that dcp.load(model.state_dict()) finds every key. --check-logits also compares the output's logits with the source's. config.json's dtype is made to say what the output holds.

The output is written to a hidden staging folder next to DST, checked, digested into ckptctl-digests.json (so `ckptctl verify DST` checks every byte later) and renamed into place: an interrupted conversion leaves nothing at DST.

DST may be an object store URL (s3://bucket/prefix, any fsspec URL): the output is staged in TMPDIR, then uploaded in parallel, weight files first and ckptctl-digests.json last, in an order that never lets a partial upload list as a complete checkpoint. A non-empty prefix is refused unless --force, which deletes the old objects first.

Launched by torchrun (any number of hosts on a shared filesystem), the ranks share the work: rank 0 plans, each rank writes its share of the shard files (balanced by bytes) into the staging folder, rank 0 writes the index (or DCP's .metadata) and digests and renames; the output is the same byte for byte, and a failed or killed rank leaves nothing at DST. For an object-store DST each rank stages and uploads its own files and rank 0 uploads what completes the output last. --workers N does the same with N processes on this host. With --check-logits, rank 0 writes an object-store output alone."""

EXAMPLES = """\
ckptctl convert runs/llama/step-1000 hf-export --to hf --config runs/llama --dtype bf16
ckptctl convert runs/llama/step-1000 hf-export --max-shard-size 2GB --rename '^lm_head=output'
ckptctl convert ds-run/ hf-export --config base-model/ --dtype bf16   # a DeepSpeed save folder
ckptctl convert meta-llama-3-8b/ init-dcp --to dcp
ckptctl convert old-model/pytorch_model.bin old-model-safetensors/
ckptctl convert lora-adapter/ merged-model/ --merge-adapter Llama-3.1-8B/
ckptctl convert lora-run/step-500 merged-model/ --adapter-config lora-run/adapter_config.json
ckptctl convert lora-run/step-500 lora-adapter/ --lora adapter --lora-alpha 32
ckptctl convert s3://ckpts/llama/step-1000 s3://exports/llama-1000 --dtype bf16
torchrun --nnodes 4 --nproc-per-node 8 -m ckptctl convert /lustre/run/step-1000 /lustre/export --max-shard-size 2GB
ckptctl convert runs/llama/step-1000 hf-export --dtype bf16 --workers 4
"""


class TargetChoice(enum.StrEnum):
    hf = "hf"
    dcp = "dcp"


class WeightsChoice(enum.StrEnum):
    auto = "auto"
    master = "master"
    stored = "stored"


class LoraChoice(enum.StrEnum):
    merge = "merge"
    adapter = "adapter"
    keep = "keep"


class DtypeChoice(enum.StrEnum):
    bf16 = "bf16"
    bfloat16 = "bfloat16"
    fp16 = "fp16"
    float16 = "float16"
    fp32 = "fp32"
    float32 = "float32"


def register(app: typer.Typer) -> None:
    add_command(app, "convert", convert, HELP, EXAMPLES)


def convert(
    src: Annotated[
        str,
        typer.Argument(
            metavar="SRC",
            help="Checkpoint folder or weights file to convert (local path or fsspec URL).",
            show_default=False,
        ),
    ],
    dst: Annotated[
        str,
        typer.Argument(
            metavar="DST",
            help="Output folder, local or an object store URL (must be empty or absent).",
            show_default=False,
        ),
    ],
    to: Annotated[TargetChoice, typer.Option("--to", metavar="FORMAT", help="Output format: hf or dcp.")] = (
        TargetChoice.hf
    ),
    dtype: Annotated[
        DtypeChoice | None,
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="Cast floating-point tensors to bf16, fp16 or fp32 (or bfloat16, float16, float32); default: "
            "keep the stored dtypes. Each value is rounded once to nearest even, float64 sources too (torch's CPU "
            "cast may round float64 -> bf16 through float32 and differ in the last bit).",
        ),
    ] = None,
    max_shard_size: Annotated[
        str,
        typer.Option(
            "--max-shard-size",
            metavar="SIZE",
            help="Most tensor bytes per safetensors shard of a --to hf output: 5GB, 500MB, 20KB or bytes.",
        ),
    ] = "5GB",
    dcp_file_size: Annotated[
        str,
        typer.Option(
            "--dcp-file-size",
            metavar="SIZE",
            help="Most tensor bytes per data file of a --to dcp output (the unit the ranks of a split "
            "conversion share; one file up to that).",
        ),
    ] = "5GB",
    component: ComponentOpt = Component.MODEL,
    strip_prefix: Annotated[
        str | None,
        typer.Option(
            "--strip-prefix",
            metavar="PREFIX",
            help="Prefix removed from tensor names (default: detected, e.g. 'model.'; '' keeps names as stored).",
        ),
    ] = None,
    rename: Annotated[
        list[str] | None,
        typer.Option(
            "--rename",
            metavar="PATTERN=REPL",
            help="PATTERN=REPL regex substitution on tensor names (repeatable, in order).",
        ),
    ] = None,
    mapping: Annotated[
        str | None,
        typer.Option(
            "--mapping",
            metavar="MAP",
            help="--to hf from a framework whose models are its own code (torchtitan): the map of its tensor names "
            "to transformers' (llama3, qwen3; default: from config.json's model_type; 'none' keeps the framework's "
            "own names: Megatron's as megatron-core's load gives them to the model, one tensor per layer, fused "
            "tensors whole, tensor-parallel parts merged).",
        ),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option("--config", metavar="DIR", help="Folder holding config.json (default: beside the source)."),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option("--tokenizer", metavar="DIR", help="Folder holding tokenizer files (default: beside the source)."),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace DST if it is not empty (on an object store: delete its objects).")
    ] = False,
    reread: Annotated[
        bool,
        typer.Option("--reread", help="Read every written file back from disk and check its digest (doubles the I/O)."),
    ] = False,
    workers: WorkersOpt = None,
    weights: Annotated[
        WeightsChoice,
        typer.Option(
            "--weights",
            metavar="WHICH",
            help="DeepSpeed ZeRO: the fp32 master weights from the optimizer partitions (auto, master) or the "
            "16-bit module weights the model states hold (stored; ZeRO-3 keeps none: its model is the partitions).",
        ),
    ] = WeightsChoice.auto,
    no_check_model: Annotated[
        bool,
        typer.Option(
            "--no-check-model",
            help="Do not build the architecture config.json names with transformers: no check of the output's "
            "tensors against it, and tied weights are not resolved (a --to dcp output may then lack lm_head.weight).",
        ),
    ] = False,
    check_logits: Annotated[
        bool,
        typer.Option(
            "--check-logits",
            help="After writing, load the output with transformers and compare its logits on a few fixed token ids "
            "with the source tensors' in the same architecture (--to hf; holds two copies of the model in memory).",
        ),
    ] = False,
    merge_adapter: Annotated[
        str | None,
        typer.Option(
            "--merge-adapter",
            metavar="BASE",
            help="SRC is an adapter (a PEFT LoRA folder): write the base model BASE (an HF model folder) with the "
            "adapter merged in, as PEFT's merge_and_unload() does; config and tokenizer come from BASE. Default: "
            "the adapter's base_model_name_or_path when that is a local folder.",
        ),
    ] = None,
    lora: Annotated[
        LoraChoice,
        typer.Option(
            "--lora",
            metavar="MODE",
            help="A model saved with LoRA adapters around its layers (base_layer.weight + lora_A.default.weight): "
            "merge them into the weights under the model's own names (merge), write the adapter alone as a PEFT "
            "adapter folder (adapter), or write the tensors as stored (keep).",
        ),
    ] = LoraChoice.merge,
    adapter_config: Annotated[
        str | None,
        typer.Option(
            "--adapter-config",
            metavar="PATH",
            help="The run's adapter_config.json (or verl's lora_train_meta.json), or its folder, for --lora merge "
            "(default: found beside the checkpoint or its config).",
        ),
    ] = None,
    lora_alpha: Annotated[
        float | None,
        typer.Option(
            "--lora-alpha",
            metavar="ALPHA",
            help="The LoRA alpha of a model saved with LoRA adapters, when no adapter_config.json is found "
            "(wins over one found).",
        ),
    ] = None,
    lora_r: Annotated[
        int | None,
        typer.Option(
            "--lora-r",
            metavar="R",
            help="With --lora-alpha: the run's LoRA rank, checked against the factors (default: each module's "
            "factors give its rank).",
        ),
    ] = None,
    lora_rslora: Annotated[
        bool,
        typer.Option("--lora-rslora", help="With --lora-alpha: the run used rsLoRA (scaling alpha/sqrt(r))."),
    ] = False,
    layout: LayoutOpt = None,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.convert import ConvertOptions, LoraMode, Target, Weights, parse_dtype
    from ckptctl.ops.naming import parse_rename
    from ckptctl.units import parse_size

    try:
        shard_bytes = parse_size(max_shard_size, minimum=1)
    except ValueError as exc:
        raise bad_value("--max-shard-size", str(exc)) from exc
    try:
        dcp_file_bytes = parse_size(dcp_file_size, minimum=1)
    except ValueError as exc:
        raise bad_value("--dcp-file-size", str(exc)) from exc
    try:
        renames = tuple(parse_rename(r) for r in rename or ())
    except ValueError as exc:
        raise bad_value("--rename", str(exc)) from exc
    options = ConvertOptions(
        to=Target(to.value),
        dtype=parse_dtype(dtype.value) if dtype else None,
        max_shard_size=shard_bytes,
        dcp_file_size=dcp_file_bytes,
        component=component,
        strip_prefix=strip_prefix,
        renames=renames,
        mapping=mapping,
        config_dir=config,
        tokenizer_dir=tokenizer,
        force=force,
        layout=layout,
        reread=reread,
        weights=Weights(weights.value),
        check_model=not no_check_model,
        check_logits=check_logits,
        merge_adapter=merge_adapter,
        lora=LoraMode(lora.value),
        adapter_config=adapter_config,
        lora_alpha=lora_alpha,
        lora_r=lora_r,
        lora_rslora=lora_rslora,
    )
    with job_ranks(workers) as ranks:
        _convert(src, dst, replace(options, ranks=ranks), json_output, quiet or not prints(ranks), prints(ranks))


def _convert(src: str, dst: str, options: ConvertOptions, json_output: bool, quiet: bool, show: bool) -> None:
    from ckptctl.ops.convert import convert as run_convert

    out = Output(json_mode=json_output, quiet=quiet)
    try:
        result = run_convert(src, dst, options, out.progress())
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


def _render(out: Output, result: ConvertResult) -> None:
    rate = human_bytes(int(result.bytes / result.seconds)) + "/s" if result.seconds > 0 else "-"
    cast = f", cast to {result.dtype}" if result.dtype else ""
    source = result.checkpoint or result.src
    masters = ", fp32 master weights" if result.weights == "master" else ""
    out.print(
        styled("converted", "green"),
        f"{result.tensors} tensors ({human_bytes(result.bytes)}{cast}) from {source} "
        f"({result.layout}{masters}) to {result.dst} ({result.to}) in {result.seconds:.1f} s, {rate}",
    )
    weights = [f for f in result.files if f.endswith((".safetensors", ".distcp"))]
    others = len(result.files) - len(weights)
    out.print(f"  files: {', '.join(weights) or '-'}" + (f" (+ {others} more)" if others else ""))
    if result.copied:
        out.print(f"  copied: {', '.join(result.copied)}")
    if result.base:
        out.print(f"  merged the adapter into {result.base}: {result.derived} tensor(s) computed")
    if result.uploaded:
        out.print(f"  uploaded {human_bytes(result.uploaded)} to {result.dst}")
    if result.model is not None:
        check = result.model
        tied = f"; tied: {', '.join(check.tied)}" if check.tied else ""
        logits = (
            f"; logits match the source's (max abs diff {check.logits_max_abs_diff:.3g})"
            if check.logits_max_abs_diff is not None
            else ""
        )
        out.print(f"  model: {check.tensors} tensors as {check.architecture} expects them{tied}{logits}")
    if result.assembled:
        out.print(f"  {result.assembled} tensor(s) assembled in memory (not contiguous in their source)")
