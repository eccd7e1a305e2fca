"""`ckptctl convert SRC DST --to hf|dcp`."""

from __future__ import annotations

import enum
from functools import partial
from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.checkpoint import Component
from ckptctl.cli.command import add_command
from ckptctl.cli.options import (
    ComponentOpt,
    ConfigOpt,
    DcpFileSizeOpt,
    DtypeOpt,
    ForceOpt,
    JsonOpt,
    LayoutOpt,
    MappingOpt,
    MaxShardSizeOpt,
    ModelWeightsOpt,
    NoCheckModelOpt,
    QuietOpt,
    RenameOpt,
    RereadOpt,
    StripPrefixOpt,
    TargetChoice,
    TokenizerOpt,
    ToOpt,
    WeightsChoice,
    WorkersOpt,
    output_options,
    parsed_renames,
    renamed,
)
from ckptctl.cli.output import Output, human_bytes, styled
from ckptctl.cli.ranks import write_on_ranks

if TYPE_CHECKING:
    from ckptctl.ops.convert import ConvertResult

HELP = """Convert a checkpoint's model into a Hugging Face folder (or an HF model into a torch DCP checkpoint), tensor by tensor from the raw bytes, in flat memory. Reads every layout ckptctl knows and single weights files; the output is checked against the model and committed atomically."""

EXAMPLES = """\
ckptctl convert runs/llama/step-1000 hf-export --config runs/llama --dtype bf16
ckptctl convert ds-run/ hf-export --config base-model/ --dtype bf16   # a DeepSpeed save folder
ckptctl convert meta-llama-3-8b/ init-dcp --to dcp
ckptctl convert lora-adapter/ merged-model/ --merge-adapter Llama-3.1-8B/
ckptctl convert runs/llama/step-1000 hf-export --dtype bf16 --workers 4
"""

#: The reference of the command (docs/cli.md, by scripts/gen_cli_reference.py): what the help leaves out.
REFERENCE = r"""A checkpoint's model as a Hugging Face folder: from torch DCP (any number of ranks, FSDP/FSDP2
sharding), ckptctl's own checkpoints (single-process safetensors and multi-rank `dcp/` storage) or an HF
folder (to reshard or cast). Writes `model.safetensors`, or `model-0000i-of-0000N.safetensors` +
`model.safetensors.index.json` past `--max-shard-size` (default `5GB`; `500MB`, `20KB`, `2GiB` or bytes).
The state-dict prefix DCP saves carry (`model.`; the entry name for native checkpoints) is removed so that
names match transformers (`--strip-prefix` overrides it, `--rename PATTERN=REPL` maps the rest);
`--dtype bf16|fp16|fp32` casts floating-point tensors (and config.json's dtype), `--component` picks
another component. `config.json`, `generation_config.json` and tokenizer files come from `--config DIR` /
`--tokenizer DIR`, or are found beside the source (its folder or the run folder above it), or where its
framework exported the model (OpenRLHF: the tag's `{tag}_hf/` export in `--ckpt.path`, else the newest
one, else the final model in `--ckpt.output_dir`; a critic's `{output_dir}_critic`); a note says which
folder was used.

verl (and SkyRL) `global_step_N/` folders convert their actor (`policy/`; a role folder given directly, that
role) from the per-rank `model_world_size_W_rank_R.pt` files, with the config and tokenizer of the role's
`huggingface/`. Each rank's DTensor shard is a byte range of its file placed where its placements put it
(`Shard(d)`: DTensor's own `torch.chunk` split, in mesh order); a shard replicated over mesh dimensions (HSDP's
`ddp`) is read from one rank only, and a tensor every rank holds whole from rank 0 only, so no tensor
changes its shape (verl's own merger once concatenated such buffers, verl PR#7610). On verl 0.9.1's own
saves the output equals `python -m verl.model_merger merge --backend fsdp`'s, which writes bfloat16 where
ckptctl keeps the stored dtype (`--dtype bf16` matches it). `_StridedShard`, `Partial` and shard orders other
than mesh order are refused with a message.

Critics and reward models (a language model's body with a value head `score.weight` [1, H], OpenRLHF's
`value_head`, in place of `lm_head`) convert to the transformers class that computes their values from the
same tensors, whatever class the saved config names (AReaL and verl save their critics with the base causal
LM's): `...ForTokenClassification` with one label for AReaL's, verl's and OpenRLHF's critics (what AReaL's
`is_critic` and verl's `load_valuehead_model` build; `token_classification_bias: false` for OpenRLHF's head,
which has no bias), `...ForSequenceClassification` with one label for reward models (OpenRLHF's
`RewardModel`), the head named `score`; the model check holds the output against that class.

Tensors stream one at a time: the output's safetensors headers are computed from the metadata first, then
each FSDP dim-0 shard, a contiguous byte range of its tensor, is copied from the raw record inside its DCP
item straight to its offset in the output (cast block by block with `--dtype`), written with O_DIRECT
where the filesystem allows it. Tensor-parallel column shards are copied row run by row run; only strided
views and very fragmented shards are assembled in memory, one tensor at a time. On a 3 GiB 2-rank FSDP2
checkpoint (1 GiB of weights): 0.1–0.3× the time of torch's model-only DCP load + `safetensors.save_file`,
peak RSS ~100 MiB against its 1.4 GiB (`bench/convert.py`).

DeepSpeed ZeRO 1–3 (a `global_stepN` tag, the save folder holding `latest`, or a Trainer `checkpoint-N`
with DeepSpeed inside) gives the fp32 master weights exactly as DeepSpeed's `zero_to_fp32.py` rebuilds them
(trainable parameters from the optimizer's flat fp32 partitions, frozen ones and buffers from the model
states, tied ones from `shared_params`), without DeepSpeed installed: each parameter's pieces are byte
ranges of the partitions, copied like FSDP shards. Wrapper prefixes (`module.`, `_orig_mod.`, OpenRLHF's
`Actor` `model.`) are removed; `--model-weights stored` writes the 16-bit module weights instead (ZeRO 0–2; ZeRO-0
has nothing else, and zero_to_fp32 cannot read it). On ZeRO-2/3 saves of a 150M-parameter Llama (2 ranks):
0.2–0.25× the wall time of `zero_to_fp32.py --safe_serialization`, peak RSS 105 MiB against its 1.3 GiB,
identical tensors (`bench/convert_zero.py`).

Safe to interrupt: the output is built in a hidden `.DST.ckptctl-convert-PID/` folder next to DST, checked
against the plan (headers read back: names, dtypes, shapes; `--reread` also reads every byte back against
the digest computed while writing it), recorded in `ckptctl-digests.json` (so `ckptctl verify DST` checks
every byte later), fsynced and renamed into place. Ctrl-C or a kill leaves DST untouched; the next
conversion into DST removes the leftover. A non-empty DST is refused without `--force`.

Megatron dist-ckpt GPT models of the Llama/Qwen family (an `iter_NNNNNNN/` folder, or the `--save` folder,
whose tracker names one) convert to transformers names: tensor-parallel parts are chunks of the full
tensors, the fused `linear_qkv` is split per query group into `q_proj`/`k_proj`/`v_proj`, the SwiGLU
`linear_fc1` into `gate_proj`/`up_proj`, each layer taken out of the stacked layers, all as byte copies.
`config.json` is made from the Megatron-LM arguments in `common.pt` (Llama, Qwen2 with QKV biases, Qwen3
with query/key norms); a save without them (megatron-core alone) needs `--config`.

`--to dcp` turns an HF model into a single-process DCP checkpoint with keys `model.<name>`, which
`dcp.load({"model": model.state_dict()}, ...)` reads on any number of ranks: resume training from a
published model (data files of at most `--dcp-file-size` bytes, 5 GB by default, which the ranks of a split
conversion share). Tied weights load that way too: the state dict of a model with `tie_word_embeddings`
(Llama-3.2-1B) holds `lm_head.weight`, which its HF folder leaves out, so the DCP output holds it as a
key of its own; converting back to HF leaves it out again (after checking that it equals the embedding),
so HF → DCP → HF gives the same bytes.

The output is proven as a model, not only as bytes: when its `config.json` names an architecture and
transformers (5 or later) is installed, the model is built on the meta device (no memory) and the output
must hold every tensor it expects (for `--to hf`, what `save_pretrained` would write: MoE experts one by
one; for `--to dcp`, the model's state dict), each with its shape, and nothing transformers would not
load. Otherwise convert fails with exit code 1 and writes nothing (`--no-check-model` skips the check and
the tied-weight handling). `--check-logits` also loads the output with `from_pretrained` and compares its
logits on a few token ids with those of the source tensors in the same architecture (two copies of the
model in memory). `config.json`'s `dtype` (or `torch_dtype`) is made to say what the files hold: a config
taken from a bf16 export over fp32 master weights says `float32`, or what `--dtype` cast to.

Without a config (none beside the source or where its framework exported the model, none given with
`--config`, none the checkpoint records), nothing proves the output is a transformers model: its tensor
names may be the framework's own (`layers.0.attention.wq.weight`, a plain module's `0.weight`) and its q/k
rows in another rotary order, and `from_pretrained` would find no config. `--to hf` of the model then
refuses with exit code 2 before writing anything, saying what to pass: `--config PATH` (with `--mapping MAP`
where the framework's names need a map), or `--mapping none` to write the tensors under the names its own
load gives them; such an output says so (a warning that it is not proved to load with `from_pretrained`,
and `"mapping": "none"` in the JSON document). `average --to hf` refuses and takes `--mapping none` alike.

Legacy `pytorch_model.bin` folders convert the same way, byte ranges copied out of the torch zips.

A PEFT LoRA adapter converts merged into its base model: `--merge-adapter BASE` (default: the adapter's
`base_model_name_or_path` when it is a local folder) writes BASE with each adapted weight replaced by
`W + (lora_alpha/r)·B@A` (rsLoRA: `lora_alpha/sqrt(r)`; `rank_pattern`/`alpha_pattern` per module,
`fan_in_fan_out`, Embedding LoRA) and the adapter's `modules_to_save` tensors in place of BASE's, computed
as PEFT's `merge_and_unload()` computes them (bit for bit on the suite's adapters); config and tokenizer
come from BASE. DoRA and other PEFT types are refused. A model saved whole while PEFT wrapped it
(`q_proj.base_layer.weight` beside `q_proj.lora_A.default.weight`: FSDP, DeepSpeed, DCP saves) is written
under the model's own names with the LoRA merged in, its alpha taken from the run's `adapter_config.json`
or verl's `lora_train_meta.json` (`--adapter-config`); `--lora keep` writes the tensors as stored.

```bash
ckptctl convert runs/llama/step-1000 hf-export --dtype bf16 --max-shard-size 5GB
python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('hf-export')"
ckptctl convert models/Llama-3.2-1B init-dcp --to dcp   # a local HF folder
ckptctl convert ds-out/ hf-export --config models/Llama-3.2-1B   # DeepSpeed: the tag `latest` names
ckptctl convert old-model/ old-model-safetensors/ --check-logits   # pytorch_model*.bin -> safetensors
ckptctl convert lora-adapter/ merged/ --merge-adapter models/Llama-3.2-1B   # PEFT LoRA -> merged model
```

Lightning checkpoints (an `epoch=E-step=S.ckpt` file, `last.ckpt`, the ModelCheckpoint folder holding it, a sharded FSDP `.ckpt/` folder, or a DeepSpeedStrategy `.ckpt/` folder, read as DeepSpeed's) give the LightningModule's state_dict under the model's own names (the `model.` attribute removed); config.json is taken from the module's hyper_parameters when they hold a transformers config, else give --config.

An adapter (a PEFT folder: adapter_config.json + adapter_model.safetensors, or a Trainer checkpoint-N of a PEFT model, which holds one instead of the model) converts merged into its base model: --merge-adapter BASE writes BASE with every adapted weight W replaced by W + (lora_alpha/r)·B@A (rsLoRA: lora_alpha/sqrt(r); rank_pattern and alpha_pattern per module; fan_in_fan_out), and the adapter's modules_to_save tensors in place of BASE's: what PEFT's merge_and_unload() gives. DoRA and other PEFT types are refused. A model saved whole while wrapped by PEFT (q_proj.base_layer.weight beside q_proj.lora_A.default.weight, as FSDP, DeepSpeed, DCP and verl saves hold it) is written under the model's own names with the LoRA merged in; its lora_alpha comes from the run's adapter_config.json or verl's lora_train_meta.json (--adapter-config), or from --lora-alpha (with --lora-r, --lora-rslora) when the run kept neither; without any, convert refuses rather than guess. --lora adapter writes that model's adapter alone instead, as PEFT's save_pretrained does (adapter_model.safetensors + adapter_config.json), for PeftModel.from_pretrained(BASE, DST).

DST may be an object store URL (s3://bucket/prefix, any fsspec URL): the output is staged in TMPDIR, then uploaded in parallel, weight files first and ckptctl-digests.json last, in an order that never lets a partial upload list as a complete checkpoint. A non-empty prefix is refused unless --force, which deletes the old objects first.

Launched by torchrun (any number of hosts on a shared filesystem), the ranks share the work: rank 0 plans, each rank writes its share of the shard files (balanced by bytes) into the staging folder, rank 0 writes the index (or DCP's .metadata) and digests and renames; the output is the same byte for byte, and a failed or killed rank leaves nothing at DST. For an object-store DST each rank stages and uploads its own files and rank 0 uploads what completes the output last. --workers N does the same with N processes on this host. With --check-logits, rank 0 writes an object-store output alone.

Options in detail: `--dtype` rounds each value once to nearest even, float64 sources too (torch's CPU cast may round float64 -> bf16 through float32 and differ in the last bit). `--strip-prefix ''` keeps the names as stored. `--model-weights` (formerly `--weights`, still accepted with a warning: in `average`, `--weights` is the weight of each input) picks DeepSpeed ZeRO's fp32 master weights from the optimizer partitions (`auto`, `master`) or the 16-bit module weights the model states hold (`stored`; ZeRO-3 keeps none: its model is the partitions). `--merge-adapter` defaults to the adapter's `base_model_name_or_path` when that is a local folder; config and tokenizer then come from BASE. `--lora` decides what becomes of a model saved with LoRA adapters around its layers (`base_layer.weight` + `lora_A.default.weight`): `merge` them into the weights under the model's own names, write the `adapter` alone as a PEFT adapter folder, or `keep` the tensors as stored. `--no-check-model` also leaves tied weights unresolved (a `--to dcp` output may then lack `lm_head.weight`). `--force` replaces a non-empty DST (on an object store: deletes its objects first), never a folder holding sub-folders and no `ckptctl-digests.json`.
"""


class LoraChoice(enum.StrEnum):
    merge = "merge"
    adapter = "adapter"
    keep = "keep"


#: Options of a rarer need, left to the reference (`cli.command.Command.more`).
MORE = (
    "--dcp-file-size",
    "--strip-prefix",
    "--tokenizer",
    "--component",
    "--mapping",
    "--reread",
    "--no-check-model",
    "--check-logits",
    "--lora",
    "--adapter-config",
    "--lora-alpha",
    "--lora-r",
    "--lora-rslora",
    "--layout",
)


def register(app: typer.Typer) -> None:
    add_command(app, "convert", convert, HELP, EXAMPLES, more=MORE)


def convert(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Checkpoint folder or weights file (path or URL).")],
    dst: Annotated[str, typer.Argument(metavar="DST", help="Output folder (path or URL), empty or absent.")],
    to: ToOpt = TargetChoice.hf,
    dtype: DtypeOpt = None,
    max_shard_size: MaxShardSizeOpt = "5GB",
    dcp_file_size: DcpFileSizeOpt = "5GB",
    component: ComponentOpt = Component.MODEL,
    strip_prefix: StripPrefixOpt = None,
    rename: RenameOpt = None,
    mapping: MappingOpt = None,
    config: ConfigOpt = None,
    tokenizer: TokenizerOpt = None,
    force: ForceOpt = False,
    reread: RereadOpt = False,
    workers: WorkersOpt = None,
    model_weights: ModelWeightsOpt = WeightsChoice.auto,
    old_weights: Annotated[WeightsChoice | None, typer.Option("--weights", hidden=True)] = None,
    no_check_model: NoCheckModelOpt = False,
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
            help="SRC is a PEFT adapter: merge it into this HF model.",
        ),
    ] = None,
    lora: Annotated[
        LoraChoice,
        typer.Option(
            "--lora",
            metavar="MODE",
            help="LoRA layers: merge, adapter (alone) or keep.",
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
    from ckptctl.ops.convert import ConvertOptions, LoraMode, Weights
    from ckptctl.ops.convert import convert as run_convert

    # `--weights` was this option's name; in `average` it is the weight of each input.
    model_weights = renamed(
        Output(json_mode=json_output, quiet=quiet), "--weights", "--model-weights", old_weights, model_weights
    )
    written = output_options(
        to, dtype, max_shard_size, dcp_file_size, config, mapping, tokenizer, force, reread, no_check_model
    )
    options = ConvertOptions(
        **written,
        component=component,
        strip_prefix=strip_prefix,
        renames=parsed_renames(rename),
        layout=layout,
        weights=Weights(model_weights.value),
        check_logits=check_logits,
        merge_adapter=merge_adapter,
        lora=LoraMode(lora.value),
        adapter_config=adapter_config,
        lora_alpha=lora_alpha,
        lora_r=lora_r,
        lora_rslora=lora_rslora,
    )
    write_on_ranks(workers, options, dst, partial(run_convert, src, dst), _render, json_output=json_output, quiet=quiet)


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
    if result.mapping == "none":
        unproved = "" if result.model is not None else ", not proved to load with from_pretrained"
        out.print(f"  names: the source's own (--mapping none){unproved}")
    elif result.mapping:
        out.print(f"  names: mapped to transformers' by the {result.mapping} map")
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
