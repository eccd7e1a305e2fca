"""`ckptctl report RUN -o FILE.html`."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from ckptctl.cli.command import add_command
from ckptctl.cli.options import DepthOpt, JsonOpt, LastPairsOpt, QuietOpt, RunArg, bad_value
from ckptctl.cli.output import Output, human_bytes
from ckptctl.layouts import DEFAULT_SCAN_DEPTH
from ckptctl.ops.report import DEFAULT_LAST

HELP = """Write one self-contained HTML page about a run: its checkpoints by step, where the bytes are, its recorded curves and how far each layer's weights moved (inline SVG, no script, no network). --json prints the page's data."""

EXAMPLES = """\
ckptctl report runs/llama-sft -o report.html
ckptctl report runs/llama-sft -o report.html --last 50 --verify
ckptctl report runs/llama-sft -o report.html --no-drift   # metadata only: fast on any size
ckptctl report runs/llama-sft --json | jq '.drift[0].pairs[-1].layers'
"""

#: The reference of the command (docs/cli.md, by scripts/gen_cli_reference.py): what the help leaves out.
REFERENCE = r"""One self-contained HTML file about a run, to look at rather than read: every checkpoint by step with its
state, size (model / optimizer / other), the one `latest` names and the one a resume would load; what
`prune` and `slim` would free under the run's `ckptctl.toml`; the curves the checkpoints record (the
Trainer's `log_history` where it is kept); and a layers x steps heatmap of how far each layer's weights
moved between consecutive checkpoints (diff's relative L2, streamed; `--last K` pairs per folder, 10 by
default; `--no-drift` skips it). Inline SVG, no script, nothing fetched: it opens offline, and names from
checkpoints are escaped. `--json` prints the data the page is drawn from; `diff A B --html FILE` draws one
comparison per layer.

```bash
ckptctl report runs/llama-sft -o report.html --verify
ckptctl diff runs/llama-sft/step-900 runs/llama-sft/step-1000 --html drift.html
```

![the demo run's report](report.png)
"""


def register(app: typer.Typer) -> None:
    add_command(app, "report", report, HELP, EXAMPLES)


def report(
    run: RunArg,
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", metavar="FILE", help="Where to write the page (required unless --json)."),
    ] = None,
    drift: Annotated[
        bool, typer.Option("--drift/--no-drift", help="Compute the per-layer weight drift (reads the models).")
    ] = True,
    last: LastPairsOpt = DEFAULT_LAST,
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
