"""The `ckptctl` command: registers one command per module and is the single error boundary.

Exit codes (DESIGN §4): 0 ok; 1 the command worked and found a problem; 2 bad usage or unreadable input;
130 interrupted. No traceback reaches the user unless CKPTCTL_DEBUG=1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import typer

from ckptctl import __version__
from ckptctl.cli import convert, demo, diff, prune, resume_plan, verify
from ckptctl.cli import inspect as inspect_command
from ckptctl.cli import list as list_command
from ckptctl.errors import CkptctlError

app = typer.Typer(
    name="ckptctl",
    help="Checkpoints of large-model training runs: list, inspect and verify them before you resume.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ckptctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    """Checkpoints of large-model training runs: list, inspect and verify them before you resume."""


for module in (list_command, inspect_command, verify, convert, diff, resume_plan, prune, demo):
    module.register(app)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point; `argv` defaults to sys.argv[1:]. Always exits with the command's code."""
    debug = os.environ.get("CKPTCTL_DEBUG") == "1"
    try:
        app(args=None if argv is None else list(argv), prog_name="ckptctl")
    except CkptctlError as exc:
        if debug:
            raise
        sys.stderr.write(f"error: {exc.message}\n")
        if exc.hint:
            sys.stderr.write(f"hint: {exc.hint}\n")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:  # raised outside a command (Typer maps it to 130 inside one)
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except Exception as exc:
        if debug:
            raise
        sys.stderr.write(f"internal error: {type(exc).__name__}: {exc}\n")
        sys.stderr.write("hint: this is a bug in ckptctl; rerun with CKPTCTL_DEBUG=1 for the traceback and report it\n")
        sys.exit(2)
