"""`ckptctl verify CKPT|RUN_DIR`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.checkpoint import ProblemKind
from ckptctl.cli.command import add_command
from ckptctl.cli.options import JsonOpt, LatestOpt, LayoutOpt, QuietOpt, WorkersOpt, bad_value
from ckptctl.cli.output import Output, styled
from ckptctl.cli.ranks import job_ranks, prints

if TYPE_CHECKING:
    from ckptctl.ops.verification import RunVerifyReport, VerifyResult

KINDS = ", ".join(ProblemKind)

HELP = """Check that a checkpoint (or every checkpoint of a run) is whole before you resume from it: its structure, its digests or torch's CRC-32s, and with --deep every tensor. Exit code 0 when everything verifies, 1 when a problem was found, 2 when the path cannot be read or holds a layout ckptctl does not know."""

EXAMPLES = """\
ckptctl verify runs/llama-sft --latest -q && torchrun train.py --resume
ckptctl verify runs/llama-sft/step-1000 --deep --check-finite
ckptctl verify runs/llama-70b --quick          # structure only, for a quick look over a huge run
ckptctl verify hf-export/model.safetensors --deep
ckptctl verify dcp-export/ --write-manifest   # record digests for later checks
"""

#: The reference of the command (docs/cli.md, by scripts/gen_cli_reference.py): what the help leaves out.
REFERENCE = (
    r"""Structure (every shard present, offsets inside files, DCP chunks tiling every tensor, index files
pointing at real files), digests against the manifest when there is one (blake3), and the CRC-32 torch
recorded for every record of every torch.save zip no digest covers: each DCP item, DeepSpeed's
`*_states.pt`, the Trainer's `optimizer.pt`, `pytorch_model.bin`. So a flipped byte in a DCP, DeepSpeed or
Trainer checkpoint without a manifest fails plain `verify`, which names the damaged record and tensor
(`crc_mismatch`). Content checks read every byte once, in parallel, through small reused buffers (flat
memory); the CRCs are computed by zlib-ng (a dependency: about 6x stdlib zlib's CRC-32, which is the
fallback if it fails to import), so they cost no more than reading the bytes. `--quick` checks the structure only. `--deep` also locates and reads every tensor,
`--check-finite` flags NaN/Inf, `--latest` checks only what a resume would pick, `--write-manifest` records
digests (`ckptctl-digests.json`) into a foreign checkpoint so later verifies catch flipped bits in raw
bytes too (safetensors carry no CRC). With `--latest`, a run with no checkpoint yet (no folder, or only a
first save still being written) is a fresh start: exit 0, said on stderr and as `"fresh_start": true`, so
the resume gate below lets the first launch through; a run whose checkpoints are all broken exits 1; a run
holding checkpoints of a layout ckptctl does not know (state `unknown`) and none it can resume from exits 2,
never 0.

```console
$ ckptctl verify demo-out/native
ok  demo-out/native/step-10 (native step 10; structure, 7 digest(s))
ok  demo-out/native/step-20 (native step 20; structure, 7 digest(s))
ok  demo-out/native/step-30 (native step 30; structure, 7 digest(s))
3 of 3 checkpoint(s) verified
$ ckptctl verify runs/llama-sft --latest -q && torchrun train.py --resume   # gate a resume on it
```

With --latest, only the checkpoint a resume would load is verified: what the framework's own latest-finder picks when the resume lets it choose (the Trainer's highest `checkpoint-N`, the tag DeepSpeed's `latest` or a tracker names, torchtitan's highest `step-N` with `.metadata`), else the newest checkpoint that verifies. When that pick does not load, it fails with `latest_not_loadable` naming it and the checkpoint to resume from instead (or run `ckptctl repair`). A run with no checkpoint yet (no folder, or only a save still being written) is a fresh start: exit code 0, said on stderr and as "fresh_start" in JSON, so that a resume gate lets the first launch through.

Problem kinds (`kind` in --json; `path` is the file or tensor, and a damaged zip record adds `record` and, where known, `entry`, the tensor or state-dict key): """
    + KINDS
    + r""". crc_mismatch: a record's bytes differ from the CRC-32 torch recorded when writing it; no_crc (a warning): archives written with torch's CRC computation off.

Each process reads with one thread per core (4 to 8, shared by the ranks on a host). Launched by torchrun (or with --workers N on this host), the ranks share the hashing, the CRC-32s and the reading by bytes; rank 0 prints the one report and every rank exits with its code.

Exit code 0 when everything verifies, 1 when a problem was found (with --latest: no checkpoint a resume could load), 2 when the path cannot be read or holds checkpoints of a layout ckptctl does not know.
"""
)


def register(app: typer.Typer) -> None:
    add_command(app, "verify", verify, HELP, EXAMPLES)


def verify(
    path: Annotated[str, typer.Argument(metavar="PATH", help="Checkpoint folder, weights file, or run (path or URL).")],
    latest: LatestOpt = False,
    quick: Annotated[
        bool,
        typer.Option("--quick", help="Check the structure only (under 1% of the bytes)."),
    ] = False,
    deep: Annotated[bool, typer.Option("--deep", help="Also locate and read every tensor.")] = False,
    check_finite: Annotated[bool, typer.Option("--check-finite", help="Read every tensor and flag NaN/Inf.")] = False,
    write_manifest: Annotated[
        bool,
        typer.Option(
            "--write-manifest",
            help="Record digests into a checkpoint that has none.",
        ),
    ] = False,
    workers: WorkersOpt = None,
    layout: LayoutOpt = None,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl.ops.verification import VerifyOptions, verify_path, verify_run

    if quick and (deep or check_finite or write_manifest):
        raise bad_value(
            "--quick", "checks the structure only; it cannot go with --deep, --check-finite or --write-manifest"
        )
    with job_ranks(workers) as ranks:
        out = Output(json_mode=json_output, quiet=quiet or not prints(ranks))
        options = VerifyOptions(
            quick=quick,
            deep=deep or check_finite,
            check_finite=check_finite,
            write_manifest=write_manifest,
            layout=layout,
            ranks=ranks,
        )
        progress = out.progress()
        report: VerifyResult | RunVerifyReport
        if latest:
            report = verify_run(path, options, progress, only_resume_target=True)
        else:
            report = verify_path(path, options, progress)
    if prints(ranks):
        _report(out, path, report, json_output)
    if report.unknown_layout:
        raise typer.Exit(2)
    if not report.ok:
        raise typer.Exit(1)


def _report(out: Output, path: str, report: VerifyResult | RunVerifyReport, json_output: bool) -> None:
    from ckptctl.ops.verification import RunVerifyReport

    if json_output:
        out.json(report.to_json())
    elif isinstance(report, RunVerifyReport) and report.fresh_start:
        out.note(f"no checkpoint in {path} yet: a resume starts from scratch (nothing to verify)")
    else:
        results = report.results if isinstance(report, RunVerifyReport) else (report,)
        for result in results:
            _render(out, result)
        if isinstance(report, RunVerifyReport):
            failed = sum(not r.ok for r in report.results)
            out.print(f"{len(report.results) - failed} of {len(report.results)} checkpoint(s) verified")


def _render(out: Output, result: VerifyResult) -> None:
    step = "" if result.step is None else f" step {result.step}"
    checks = "structure"
    if result.digests_checked:
        checks += f", {result.digests_checked} digest(s)"
    if result.crc_records_checked:
        checks += f", {result.crc_records_checked} CRC-32(s)"
    if result.tensors_read:
        checks += f", {result.tensors_read} tensor(s) read"
    if result.wrote_digests:
        checks += ", digests recorded"
    mark = styled("ok", "green") if result.ok else styled("FAILED", "red")
    out.print(mark, f" {result.url} ({result.layout}{step}; {checks})")
    for problem in result.problems[:_SHOWN]:
        colour = "red" if problem.severity == "error" else "yellow"
        where = f"{problem.path}: " if problem.path and not problem.message.startswith(problem.path) else ""
        out.print("   ", styled(problem.kind, colour), where + problem.message)
    if len(result.problems) > _SHOWN:
        out.print(f"    ... and {len(result.problems) - _SHOWN} more problem(s): --json lists them all")


#: Problems printed per checkpoint: enough to act on; a person does not read thousands of lines.
_SHOWN = 100
