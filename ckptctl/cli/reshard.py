"""`ckptctl reshard SRC DST`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.options import JsonOpt, LayoutOpt, QuietOpt
from ckptctl.cli.output import Output, human_bytes, interrupted_write, styled

if TYPE_CHECKING:
    from ckptctl.ops.reshard import ReshardResult

HELP = """Write a whole resumable training state (model, optimizer, schedulers, counters) for another number of ranks or another framework, offline and on CPU, streamed one parameter at a time from the checkpoint's raw bytes.

--to names the target: deepspeed-universal (a DeepSpeed ZeRO 1-3 tag as the universal checkpoint DeepSpeed's ds_to_universal.py --inject_missing_state writes, which DeepSpeed loads on any number of ranks with load_universal set to true in the checkpoint section of its config; SRC may be a tag folder, a save folder holding `latest`, or a checkpoint of a framework built on DeepSpeed: OpenRLHF, open-instruct, accelerate, the HF Trainer, Lightning; or an Adam/AdamW training state as torch's get_state_dict lays it out, from a DCP folder such as an FSDP2 run's, a multi-rank ckptctl checkpoint or an HF Trainer `checkpoint-N`, which DeepSpeed ZeRO-1 or 2 loads the same way) or verl (a verl `global_step_N/` with every role's model, optimizer and extra-state rank files cut for --world-size ranks, which verl's own checkpoint manager loads there) or dcp (model and optimizer as torch's get_state_dict lays them out, `model.<fqn>`, `optim.state.<fqn>.exp_avg`, ..., which an FSDP2 or torchtitan trainer on any number of ranks loads with dcp.load + set_state_dict; from a DCP folder, a multi-rank ckptctl checkpoint, a verl role folder or an HF Trainer `checkpoint-N`, whose optimizer groups are named by transformers' own Trainer code, which must be installed). Without --to, the source framework's own writer is used.

DST must be empty (or absent): it becomes what the target framework is pointed at (for deepspeed-universal: DST/<tag>/ and DST/latest_universal; for verl: DST/global_step_N/ and the tracker, so trainer.default_local_dir=DST resumes). The output is written to a hidden staging folder next to DST and renamed into place: an interrupted or failed reshard leaves nothing at DST. DST may be an object store URL (s3://bucket/prefix, any fsspec URL): the output is staged in TMPDIR, then uploaded as convert uploads, in parallel but for the files that complete it (markers, then trackers and pointers such as latest_universal), which go up one after another, and ckptctl-digests.json last; a failed or interrupted upload deletes what it put. A non-empty prefix is refused unless --force, which deletes the old objects first. A source the writer cannot carry (a torn tag, named by its missing file) is refused before anything is written. What the target cannot carry (RNG streams, a data-loader position) is listed as not carried, with why.

A DeepSpeed ZeRO 1-3 tag (a tag folder, a save folder holding `latest`, or the tag of an OpenRLHF or open-instruct checkpoint) is also a source for --to dcp: its fp32 masters, each parameter's Adam moments and its group's step, the groups' settings and parameter names (proved from DeepSpeed's param_shapes); an optimizer other than Adam/AdamW is refused, naming its state.

Exit code 0 when written, 2 on bad input, 130 when interrupted."""

EXAMPLES = """\
ckptctl reshard ckpts/global_step400 fsdp-dcp/ --to dcp --json
ckptctl reshard ckpts/ universal/ --to deepspeed-universal
ckptctl reshard ckpts/global_step400 universal/ --to deepspeed-universal --workers 4
ckptctl reshard openrlhf-ckpt/_actor actor-universal/ --to deepspeed-universal --json
ckptctl reshard fsdp2-run/step-400 on-deepspeed/ --to deepspeed-universal
ckptctl reshard verl-run/global_step_400 verl-on-16/ --world-size 16
ckptctl reshard verl-run/global_step_400/actor actor-dcp/ --to dcp
ckptctl reshard ckpts/ s3://bucket/universal --to deepspeed-universal
"""


def register(app: typer.Typer) -> None:
    add_command(app, "reshard", reshard_state, HELP, EXAMPLES)


def reshard_state(
    src: Annotated[
        str,
        typer.Argument(
            metavar="SRC", help="Checkpoint or save folder to read (local path or fsspec URL).", show_default=False
        ),
    ],
    dst: Annotated[
        str,
        typer.Argument(
            metavar="DST", help="Empty folder to write the state into (local path or fsspec URL).", show_default=False
        ),
    ],
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            metavar="TARGET",
            help="What to write: deepspeed-universal, verl or dcp (default: the source framework's own training state).",
        ),
    ] = None,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            metavar="N",
            min=1,
            help="Ranks the target resumes on (default: the source's; a universal checkpoint loads on any).",
        ),
    ] = None,
    workers: Annotated[
        int, typer.Option("--workers", metavar="N", min=1, help="Threads reading and writing parameters.")
    ] = 1,
    force: Annotated[
        bool, typer.Option("--force", help="Replace DST when it holds an earlier reshard or convert output.")
    ] = False,
    layout: LayoutOpt = None,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.reshard import ReshardOptions, reshard

    out = Output(json_mode=json_output, quiet=quiet)
    options = ReshardOptions(to=to, world_size=world_size, workers=workers, force=force, layout=layout)
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
