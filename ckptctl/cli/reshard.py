"""`ckptctl reshard SRC DST`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.options import ForceOpt, JsonOpt, LayoutOpt, QuietOpt, WorldSizeOpt, renamed
from ckptctl.cli.output import Output, human_bytes, interrupted_write, styled

if TYPE_CHECKING:
    from ckptctl.ops.reshard import ReshardResult

HELP = """Write a whole resumable training state (model, optimizer, schedulers, counters) for another number of ranks or another framework, offline and on CPU, one parameter at a time. --to deepspeed-universal, verl or dcp names the target; what it cannot carry is listed as not carried."""

EXAMPLES = """\
ckptctl reshard ckpts/ universal/ --to deepspeed-universal
ckptctl reshard ckpts/global_step400 fsdp-dcp/ --to dcp --json
ckptctl reshard fsdp2-run/step-400 on-deepspeed/ --to deepspeed-universal --threads 4
ckptctl reshard verl-run/global_step_400 verl-on-16/ --world-size 16
ckptctl reshard ckpts/ s3://bucket/universal --to deepspeed-universal
"""

#: The reference of the command (docs/cli.md, by scripts/gen_cli_reference.py): what the help leaves out.
REFERENCE = r"""The whole resumable training state (model, optimizer, schedulers, counters) for another number of ranks
or another framework, offline, on CPU, without the source framework installed, streamed one parameter at a
time from the checkpoint's raw bytes. Every path below is proved in the test suite by the target framework's
own load code on gloo CPU ranks: the loaded state equals the source's exactly and the next training step's
loss is the source's own (bit-identical in every case run).

| SRC | `--to` | DST, and what loads it |
|---|---|---|
| DeepSpeed ZeRO 1-3 tag (the tag, the save folder holding `latest`, or the tag inside an OpenRLHF, open-instruct, accelerate, HF Trainer or Lightning checkpoint) | `deepspeed-universal` | `DST/<tag>/zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt` + `DST/latest_universal`, file for file what `ds_to_universal.py --inject_missing_state` writes; DeepSpeed with `"checkpoint": {"load_universal": true}` (2 -> 1 and 1 -> 2 ranks, ZeRO-2 and ZeRO-3). No torch import: ~0.25x `ds_to_universal`'s time, ~0.07x its memory (`bench/reshard.py`) |
| FSDP2 DCP state (`get_state_dict` layout), multi-rank ckptctl checkpoint, HF Trainer `checkpoint-N` | `deepspeed-universal` | the same, loaded by DeepSpeed ZeRO-1/2 on 1 and 2 ranks |
| verl `global_step_N/` (every role) | (default) `--world-size N` | verl rank files for N ranks + tracker; verl's own `FSDPCheckpointManager` (2 -> 1, 1 -> 2) |
| DeepSpeed ZeRO 1-3, DCP, multi-rank ckptctl, verl role, HF Trainer `checkpoint-N` | `dcp` | `model.<fqn>`, `optim.state.<fqn>.*`, `optim.param_groups.*`; FSDP2 `dcp.load` + `set_state_dict` on 1 and 2 ranks |

Parameter groups are named only where the checkpoint proves them (DeepSpeed's `param_shapes`, verl's single
group, the HF Trainer's decay/no-decay groups from transformers' own `get_decay_parameter_names`); anything
else (an optimizer other than Adam/AdamW, a Megatron dist-ckpt, groups that cannot be proved) is refused with
why, before anything is written. What the target cannot carry (RNG streams, the LR scheduler's state, a
data-loader position, the framework's files beside the state) is listed as `not_carried` with what to do;
`resume-plan DST` shows the new world size and the setting to pass. Staged and committed like `convert`:
DST must be empty, a torn source is refused naming the missing file, an interrupted reshard leaves nothing
at DST; DST may be an object-store URL (staged locally, uploaded with the completing files last).

```bash
ckptctl reshard ckpts/ universal/ --to deepspeed-universal          # the tag `latest` names
ckptctl reshard openrlhf-ckpt/_actor actor-universal/ --to deepspeed-universal --json
ckptctl reshard fsdp2-run/step-400 on-deepspeed/ --to deepspeed-universal   # FSDP2 (DCP) -> DeepSpeed
ckptctl reshard verl-run/global_step_200 verl-8gpu/ --world-size 8          # verl 4 -> 8 ranks
ckptctl reshard ckpts/global_step400 fsdp-dcp/ --to dcp --json              # DeepSpeed -> FSDP2
ckptctl reshard out/checkpoint-500 s3://bucket/run/dcp --to dcp             # HF Trainer -> DCP on a store
```

DST must be empty (or absent): it becomes what the target framework is pointed at (for deepspeed-universal: DST/<tag>/ and DST/latest_universal; for verl: DST/global_step_N/ and the tracker, so trainer.default_local_dir=DST resumes). The output is written to a hidden staging folder next to DST and renamed into place: an interrupted or failed reshard leaves nothing at DST. DST may be an object store URL (s3://bucket/prefix, any fsspec URL): the output is staged in TMPDIR, then uploaded as convert uploads, in parallel but for the files that complete it (markers, then trackers and pointers such as latest_universal), which go up one after another, and ckptctl-digests.json last; a failed or interrupted upload deletes what it put. A non-empty prefix is refused unless --force, which deletes the old objects first. A source the writer cannot carry (a torn tag, named by its missing file) is refused before anything is written. What the target cannot carry (RNG streams, a data-loader position) is listed as not carried, with why.

Exit code 0 when written, 2 on bad input, 130 when interrupted.

`--threads N` (formerly `--workers`, still accepted with a warning: everywhere else `--workers` counts processes) reads and writes parameters on N threads. `--world-size` defaults to the source's; a universal checkpoint loads on any. `--force` replaces DST only when it holds an earlier reshard or convert output.
"""


def register(app: typer.Typer) -> None:
    add_command(app, "reshard", reshard_state, HELP, EXAMPLES)


def reshard_state(
    src: Annotated[
        str, typer.Argument(metavar="SRC", help="Checkpoint or save folder to read (local path or fsspec URL).")
    ],
    dst: Annotated[
        str, typer.Argument(metavar="DST", help="Empty folder to write the state into (local path or fsspec URL).")
    ],
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            metavar="TARGET",
            help="What to write: deepspeed-universal, verl or dcp (default: the source framework's own training state).",
        ),
    ] = None,
    world_size: WorldSizeOpt = None,
    threads: Annotated[
        int,
        typer.Option(
            "--threads",
            metavar="N",
            min=1,
            help="Threads reading and writing (formerly --workers).",
        ),
    ] = 1,
    old_workers: Annotated[int | None, typer.Option("--workers", hidden=True, min=1)] = None,
    force: ForceOpt = False,
    layout: LayoutOpt = None,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.reshard import ReshardOptions, reshard

    out = Output(json_mode=json_output, quiet=quiet)
    threads = renamed(out, "--workers", "--threads", old_workers, threads)
    options = ReshardOptions(to=to, world_size=world_size, workers=threads, force=force, layout=layout)
    try:
        result = reshard(src, dst, options, out.progress())
    except KeyboardInterrupt:
        out.note(interrupted_write(dst))
        raise
    if json_output:
        out.json(result.to_json())
        return
    _render(out, result)


def _render(out: Output, result: ReshardResult) -> None:
    ranks = f"{result.world_size} rank(s)" if result.world_size is not None else "any number of ranks"
    out.print(
        styled("resharded", "green"),
        f"{result.tensors} tensors ({human_bytes(result.bytes)}) from {result.checkpoint} ({result.layout}) to "
        f"{result.dst} ({result.to}, loads on {ranks}) in {result.seconds:.1f} s, {len(result.files)} files",
    )
    if result.uploaded:
        out.print(f"  uploaded {human_bytes(result.uploaded)} to {result.dst}")
    if result.resume_hint:
        out.print(f"  resume with: {result.resume_hint}")
    for item in result.not_carried:
        out.print(styled("  not carried", "yellow"), f"{item.what}: {item.why}")
