"""`ckptctl report RUN -o FILE.html`."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.options import DepthOpt, JsonOpt, QuietOpt, bad_value
from ckptctl.cli.output import Output, human_bytes
from ckptctl.layouts import DEFAULT_SCAN_DEPTH

#: --last's default, the library's (`ops.report_page.DEFAULT_LAST`, which a test holds equal): that module
#: imports diff's numpy code, which `ckptctl --help` and every other command would pay for (DESIGN §5).
DEFAULT_LAST = 10

HELP = f"""Write one self-contained HTML page about a run: its checkpoints, where the bytes are, its curves and how far each layer's weights moved.

Every checkpoint by step with its state and size (model / optimizer / other), the one `latest` names and the one a resume would load; what prune and slim would free under the run's ckptctl.toml; the metrics the checkpoints record; the per-layer relative L2 change between consecutive whole checkpoints (the newest {DEFAULT_LAST} pairs per folder), read as `diff` reads. Inline SVG, no script, no network. --json prints the page's data.

Docs: docs/cli.md#ckptctl-report"""

EXAMPLES = """\
ckptctl report runs/llama-sft -o report.html
ckptctl report runs/llama-sft -o report.html --last 50 --verify
ckptctl report runs/llama-sft -o report.html --no-drift   # metadata only: fast on any size
ckptctl report runs/llama-sft --json | jq '.drift[0].pairs[-1].layers'
"""


def register(app: typer.Typer) -> None:
    add_command(app, "report", report, HELP, EXAMPLES)


def report(
    run: Annotated[
        str, typer.Argument(metavar="RUN", help="Run folder (local path or fsspec URL).", show_default=False)
    ],
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", metavar="FILE", help="Where to write the page (required unless --json)."),
    ] = None,
    drift: Annotated[
        bool, typer.Option("--drift/--no-drift", help="Compute the per-layer weight drift (reads the models).")
    ] = True,
    last: Annotated[
        int,
        typer.Option("--last", metavar="K", help="Drift over the newest K pairs of each folder.", min=1),
    ] = DEFAULT_LAST,
    verify: Annotated[bool, typer.Option("--verify", help="Also verify each checkpoint and show the verdict.")] = False,
    depth: DepthOpt = DEFAULT_SCAN_DEPTH,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from ckptctl import io
    from ckptctl.ops.report_html import render_run
    from ckptctl.ops.report_page import ReportOptions, run_report

    if output is None and not json_output:
        raise bad_value("--output", "give the file to write the page to (or --json for the data)")
    out = Output(json_mode=json_output, quiet=quiet)
    options = ReportOptions(drift=drift, last=last, verify=verify, max_depth=depth)
    started = time.perf_counter()
    result = run_report(run, options, out.progress())
    if output is not None:
        page = render_run(result).encode()
        io.write_bytes_atomic(output, page)
        out.note(
            f"wrote {output} ({human_bytes(len(page))}): {len(result.checkpoints)} checkpoint(s), "
            f"{len(result.curves)} curve(s), {sum(len(d.pairs) for d in result.drift)} drift pair(s) "
            f"in {time.perf_counter() - started:.1f}s"
        )
    if json_output:
        out.json(result.to_json())
