"""Options shared by several commands, defined once, the one way a command rejects an option's value, and the
prompt of the commands that plan changes to a run before making them.

Every option that more than one command takes is declared here, with one help text, so that a name means one
thing everywhere (`tests/cli/test_help.py` checks it). Where two commands need different Python types for one
option (a default of None in one, a number in the other), both aliases share one `typer.Option`.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Generic, Protocol, TypeVar

import typer

from ckptctl.checkpoint import CheckpointRef, Component
from ckptctl.cli.output import Cell, Column, Output
from ckptctl.errors import CkptctlError
from ckptctl.layouts import layout_names
from ckptctl.ops.report import display_path

T = TypeVar("T")

#: The run folder of a command about one run (list, prune, repair, resume-plan, report).
RunArg = Annotated[str, typer.Argument(metavar="RUN", help="Run folder (local path or fsspec URL).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document (schema_version 1).")]
QuietOpt = Annotated[
    bool,
    typer.Option("--quiet", "-q", help="Print only errors; the exit code tells the result."),
]
# Layout names are plain strings checked by the library (`layouts.get_layout`), whose error lists the known
# layouts for library and command-line users alike.
# `--layout` is two options: a checkpoint command reads its checkpoint as that layout, a run command (list,
# resume-plan) filters the run's checkpoints by it (verify of a run folder given --layout reads it as one
# checkpoint). Both list the names, which the reference and the completions list too.
LayoutOpt = Annotated[
    str | None,
    typer.Option(
        "--layout",
        metavar="LAYOUT",
        help=f"Skip detection and read the checkpoint as this layout: {', '.join(layout_names())}.",
    ),
]
RunLayoutOpt = Annotated[
    str | None,
    typer.Option(
        "--layout", metavar="LAYOUT", help=f"Consider only checkpoints of this layout: {', '.join(layout_names())}."
    ),
]
_COMPONENT = typer.Option(
    "--component",
    metavar="COMPONENT",
    help=f"Read only the tensors of this component: {', '.join(c.value for c in Component)}.",
)
ComponentOpt = Annotated[Component, _COMPONENT]
ComponentFilterOpt = Annotated[Component | None, _COMPONENT]

YesOpt = Annotated[
    bool,
    typer.Option(
        "--yes",
        "-y",
        help="Go ahead without asking (repair: apply the plan).",
    ),
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Replace an output folder that ckptctl wrote before.",
    ),
]
_LIMIT = typer.Option("--limit", metavar="N", help="Show at most N rows.", min=0)
LimitOpt = Annotated[int | None, _LIMIT]
RowsOpt = Annotated[int, _LIMIT]
OlderThanOpt = Annotated[
    str | None,
    typer.Option("--older-than", metavar="AGE", help="Leave checkpoints younger than this alone (7d, 12h)."),
]
WorldSizeOpt = Annotated[
    int | None,
    # The upper bound keeps per-rank bookkeeping finite; no job has a million ranks.
    typer.Option("--world-size", metavar="N", help="Ranks of the resumed run (default: as saved).", min=1, max=1 << 20),
]
LatestOpt = Annotated[bool, typer.Option("--latest", help="Only the checkpoint a resume would load.")]
_LAST = typer.Option("--last", metavar="K", help="Only the newest K checkpoints (report: pairs).", min=1)
LastOpt = Annotated[int | None, _LAST]
LastPairsOpt = Annotated[int, _LAST]
StripPrefixOpt = Annotated[
    str | None,
    typer.Option(
        "--strip-prefix",
        metavar="PREFIX",
        help="Prefix cut from tensor names (default: detected).",
    ),
]
RenameOpt = Annotated[
    list[str] | None,
    typer.Option("--rename", metavar="PATTERN=REPL", help="Regex substitution on tensor names; repeatable."),
]
WorkersOpt = Annotated[
    int | None,
    typer.Option(
        "--workers",
        metavar="N",
        help="Processes sharing the work, as torchrun ranks do.",
        min=1,
    ),
]


class TargetChoice(enum.StrEnum):
    hf = "hf"
    dcp = "dcp"


class DtypeChoice(enum.StrEnum):
    bf16 = "bf16"
    bfloat16 = "bfloat16"
    fp16 = "fp16"
    float16 = "float16"
    fp32 = "fp32"
    float32 = "float32"


class WeightsChoice(enum.StrEnum):
    auto = "auto"
    master = "master"
    stored = "stored"


# The options of the commands that write a model (convert, average).
ToOpt = Annotated[TargetChoice, typer.Option("--to", metavar="FORMAT", help="Output format: hf or dcp.")]
DtypeOpt = Annotated[
    DtypeChoice | None,
    typer.Option(
        "--dtype",
        metavar="DTYPE",
        help="Write floats as bf16, fp16 or fp32 (default: kept).",
    ),
]
MaxShardSizeOpt = Annotated[
    str, typer.Option("--max-shard-size", metavar="SIZE", help="Most bytes per shard file (--to hf).")
]
DcpFileSizeOpt = Annotated[
    str, typer.Option("--dcp-file-size", metavar="SIZE", help="Most bytes per data file (--to dcp).")
]
ConfigOpt = Annotated[
    str | None, typer.Option("--config", metavar="DIR", help="Folder of config.json (default: found beside).")
]
TokenizerOpt = Annotated[
    str | None,
    typer.Option("--tokenizer", metavar="DIR", help="Folder of tokenizer files (default: found beside)."),
]
RereadOpt = Annotated[bool, typer.Option("--reread", help="Read the output back and check its digests.")]
MappingOpt = Annotated[
    str | None,
    typer.Option(
        "--mapping",
        metavar="MAP",
        help="--to hf: the map of the source framework's tensor names to transformers' (torchtitan: llama3, qwen3; "
        "default: from config.json's model_type), or 'none' to keep the names its own load gives the model "
        "(Megatron's: one tensor per layer, fused tensors whole, tensor-parallel parts merged); with no config.json "
        "to check the output against, --to hf is refused unless 'none' is given, and such an output is not proved "
        "to load with from_pretrained.",
    ),
]
NoCheckModelOpt = Annotated[
    bool, typer.Option("--no-check-model", help="Skip the check against the model config.json names.")
]
ModelWeightsOpt = Annotated[
    WeightsChoice,
    typer.Option(
        "--model-weights",
        metavar="WHICH",
        help="Which ZeRO weights: master or stored.",
    ),
]


def output_options(
    to: TargetChoice,
    dtype: DtypeChoice | None,
    max_shard_size: str,
    dcp_file_size: str,
    config: str | None,
    mapping: str | None,
    tokenizer: str | None,
    force: bool,
    reread: bool,
    no_check_model: bool,
) -> dict[str, Any]:
    """The options above of a command that writes a model (`convert`, `average`) as `ops.convert.OutputOptions`
    takes them, by field name; a size that is not one is the option's usage error."""
    from ckptctl.ops.convert import Target, parse_dtype

    return {
        "to": Target(to.value),
        "dtype": parse_dtype(dtype.value) if dtype else None,
        "max_shard_size": positive_size(max_shard_size, "--max-shard-size"),
        "dcp_file_size": positive_size(dcp_file_size, "--dcp-file-size"),
        "config_dir": config,
        "mapping": mapping,
        "tokenizer_dir": tokenizer,
        "force": force,
        "reread": reread,
        "check_model": not no_check_model,
    }


def renamed(out: Output, old: str, new: str, old_value: T | None, value: T) -> T:
    """The value of an option renamed from `old` to `new`: `old` still works (a hidden option), with a warning."""
    if old_value is None:
        return value
    out.warn(f"{old} is deprecated here: use {new}")
    return old_value


# prune, slim and repair take the same run lock (`core.lock`), so each waits for any of the three.
WaitOpt = Annotated[
    float,
    typer.Option(
        "--wait",
        metavar="SECONDS",
        help="Seconds to wait for the run's lock.",
        min=0,
    ),
]
# prune and slim judge alike whether a checkpoint is still being written (`ops.planned.DEFAULT_GRACE`).
GraceOpt = Annotated[
    str | None,
    typer.Option("--grace", metavar="AGE", help="Age of a save still being written (default 10m)."),
]
DepthOpt = Annotated[int, typer.Option("--depth", metavar="N", help="How deep to look for nested runs.", min=0)]


def bad_value(option: str, message: str) -> typer.BadParameter:
    """The usage error for a value an option's type accepted but the command cannot use (exit code 2)."""
    return typer.BadParameter(message, param_hint=f"'{option}'")


def positive_size(text: str, option: str) -> int:
    """A size of at least one byte (`5GB`, `500MB`, `20KB`, bytes) given to `option` (`--max-shard-size`,
    `--dcp-file-size`), a bad one turned into the option's usage error."""
    from ckptctl.units import parse_size

    try:
        return parse_size(text, minimum=1)
    except ValueError as exc:
        raise bad_value(option, str(exc)) from exc


def parsed(parser: Callable[[str], T], text: str | None, option: str) -> T | None:
    """`parser(text)` (None for None), a ValueError turned into the usage error of `option`."""
    if text is None:
        return None
    try:
        return parser(text)
    except ValueError as exc:
        raise bad_value(option, str(exc)) from exc


def parsed_renames(rename: list[str] | None) -> tuple[tuple[str, str], ...]:
    """The `--rename PATTERN=REPL` options (`RenameOpt`) as `(pattern, replacement)` pairs, a bad one the option's
    usage error."""
    from ckptctl.ops.naming import parse_rename

    try:
        return tuple(parse_rename(r) for r in rename or ())
    except ValueError as exc:
        raise bad_value("--rename", str(exc)) from exc


class ConfirmationRequired(CkptctlError):
    """A destructive command needs --yes when there is no terminal to ask on (exit code 2)."""


class _Report(Protocol):
    @property
    def plan(self) -> Any: ...

    def to_json(self) -> dict[str, Any]: ...


ReportT = TypeVar("ReportT", bound=_Report)


class PlanPrompt(Generic[ReportT]):
    """The confirmation and the output of a command that plans changes to a run, then makes them (`prune`,
    `slim`): the plan is shown once, before the question when one is asked, else with the outcome.

    Args:
        out: the command's output.
        render_plan: prints a plan (the table of what is done to each checkpoint).
        render_summary: prints the outcome's last line.
        yes, json_output, quiet: the command's --yes, --json and --quiet.
    """

    def __init__(
        self,
        out: Output,
        render_plan: Callable[[Output, Any], None],
        render_summary: Callable[[Output, ReportT], None],
        *,
        yes: bool,
        json_output: bool,
        quiet: bool,
    ) -> None:
        self._out = out
        self._render_plan = render_plan
        self._render_summary = render_summary
        self._yes, self._json_output, self._quiet = yes, json_output, quiet
        self._shown = False

    def confirmed(self, plan: Any, action: str, question: str) -> bool:
        """Whether the user lets the command go on: True with --yes; else show the plan and ask `question` on the
        terminal.

        Args:
            plan: what would be done.
            action: the same in words, for the refusal (`delete 3 checkpoint(s)`).

        Raises:
            ConfirmationRequired: no --yes, and --json or --quiet (which show no plan: a confirmation of a plan
                nobody saw is none, and a script must behave the same with or without a terminal), or stdin is
                not a terminal.
        """
        if self._yes:
            return True
        if self._json_output or self._quiet:
            raise ConfirmationRequired(
                f"refusing to {action} without confirmation: {'--json' if self._json_output else '--quiet'} does "
                "not show the plan or prompt",
                "pass --yes to go on (or --dry-run to see the plan)",
            )
        if not sys.stdin.isatty():
            raise ConfirmationRequired(
                f"refusing to {action} without confirmation: stdin is not a terminal",
                "pass --yes (or --dry-run to see the plan)",
            )
        self._render_plan(self._out, plan)
        self._shown = True
        return typer.confirm(question, default=False, err=True)

    def show(self, report: ReportT) -> None:
        """The outcome: its JSON document, or the plan (unless shown before the question) and the summary; then
        the plan's notes."""
        if self._json_output:
            self._out.json(report.to_json())
        else:
            if not self._shown:
                self._render_plan(self._out, report.plan)
            self._render_summary(self._out, report)
        for note in report.plan.notes:
            self._out.note(f"note: {note}")


class _Planned(Protocol):
    @property
    def ref(self) -> CheckpointRef: ...


ItemT = TypeVar("ItemT", bound=_Planned)


def plan_table(
    out: Output,
    run: str,
    items: Sequence[ItemT],
    row: Callable[[ItemT], Sequence[Cell]],
    columns: Sequence[Column],
    *,
    title: str,
) -> None:
    """The table of a plan over the checkpoints below `run` (`prune`, `slim`): per checkpoint, what is done to it
    (the first cell of `row(item)`), its path relative to the run and its step, then the rest of its cells under
    `columns`."""
    if not items:
        out.note(f"no checkpoints found below {run}")
        return
    rows: list[list[Cell]] = []
    for item in items:
        action, *rest = row(item)
        step = "-" if item.ref.step is None else str(item.ref.step)
        rows.append([action, display_path(item.ref.url, run), step, *rest])
    out.table([Column("action"), Column("path"), Column("step", "right"), *columns], rows, title=title)
