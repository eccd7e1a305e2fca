"""The `ckptctl` command: registers one command per module and is the single error boundary.

Exit codes (DESIGN §4): 0 ok; 1 the command worked and found a problem; 2 bad usage or unreadable input;
130 interrupted. No traceback reaches the user unless CKPTCTL_DEBUG=1. Every error, a usage error
included, is printed the same way (`error: ...` and `hint: ...` on stderr), and with `--json` also as a
JSON document on stdout, so that a script reading stdout always gets one document.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any, TextIO

import typer

from ckptctl import __version__
from ckptctl.cli import output, ranks
from ckptctl.cli.command import Group
from ckptctl.errors import CkptctlError
from ckptctl.ops.distributed_work import launched
from ckptctl.quoting import printable

#: The exit code of an interrupted command (128 + SIGINT, as shells report it).
INTERRUPTED = 130

#: Every command, in the order `ckptctl --help` lists them: its name -> the module that defines it and registers
#: it (`register(app)`). A run imports only the module of the command it runs (`build_app`), so that what
#: one command needs at import (its options, its library code) costs no other command anything (DESIGN §5:
#: a command's fixed cost); `--help`, the completions and the reference import them all.
COMMANDS: dict[str, str] = {
    "list": "ckptctl.cli.list",
    "inspect": "ckptctl.cli.inspect",
    "verify": "ckptctl.cli.verify",
    "convert": "ckptctl.cli.convert",
    "average": "ckptctl.cli.average",
    "reshard": "ckptctl.cli.reshard",
    "diff": "ckptctl.cli.diff",
    "resume-plan": "ckptctl.cli.resume_plan",
    "slim": "ckptctl.cli.slim",
    "repair": "ckptctl.cli.repair",
    "prune": "ckptctl.cli.prune",
    "report": "ckptctl.cli.report",
    "sync": "ckptctl.cli.sync",
    "demo": "ckptctl.cli.demo",
}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ckptctl {__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    """Checkpoints of large-model training runs: list, inspect and verify them before you resume."""


def build_app(names: Iterable[str] = COMMANDS) -> typer.Typer:
    """The `ckptctl` app with the commands `names` (keys of `COMMANDS`) registered, each module imported now."""
    app = typer.Typer(
        name="ckptctl",
        help="Checkpoints of large-model training runs: list, inspect and verify them before you resume.",
        cls=Group,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        rich_markup_mode="rich",
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.callback()(_root)
    for name in names:
        importlib.import_module(COMMANDS[name]).register(app)
    return app


@cache
def _whole_app() -> typer.Typer:
    return build_app()


def __getattr__(name: str) -> Any:
    """`app`: the app with every command, for what reads the whole command line (the completions, the
    reference, tests); built on first use, since `main` builds only the command it runs."""
    if name == "app":
        return _whole_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _app_for(args: Sequence[str]) -> typer.Typer:
    """The app that runs `args`: only the named command's when they start with one (no root option comes
    before it); else every command, for the root help, a usage error that lists them, or a shell's completion."""
    if args and args[0] in COMMANDS:
        return build_app([args[0]])
    return _whole_app()


class _OutputClosed(BaseException):
    """The reader of stdout or stderr went away (`ckptctl list | head -1`).

    A BaseException, so that no `except Exception` on the way swallows it, and not an OSError, so that
    neither rich nor Typer turns it into exit code 1: the reader got what it wanted, which is success.
    """


class _PipeGuard:
    """Wraps sys.stdout/sys.stderr: a write to a closed pipe raises `_OutputClosed`."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise _OutputClosed from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise _OutputClosed from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point; `argv` defaults to sys.argv[1:]. Always exits with the command's code."""
    args = list(sys.argv[1:] if argv is None else argv)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _PipeGuard(sys.stdout), _PipeGuard(sys.stderr)
    try:
        code = _run(args)
        sys.stdout.flush()
    except _OutputClosed:
        code = 0
        _silence(streams)
    finally:
        sys.stdout, sys.stderr = streams
    sys.exit(code)


def _run(args: list[str]) -> int:
    debug = os.environ.get("CKPTCTL_DEBUG") == "1"
    json_mode = "--json" in args[: args.index("--")] if "--" in args else "--json" in args
    if launched() and os.environ.get("RANK") != "0":
        json_mode = False  # rank 0 prints the job's JSON document; the other ranks say their errors on stderr
    ranks.ARGS.set(tuple(args))
    output.JSON_LINES.set(False)  # until the command says it prints JSON lines (`Output(json_lines=True)`)
    try:
        result = _app_for(args)(args=args, prog_name="ckptctl", standalone_mode=False)
    except CkptctlError as exc:
        if debug:
            raise
        return _fail(exc.message, exc.hint, exc.exit_code, type(exc).__name__, json_mode)
    except typer.Abort:
        return _fail("aborted", "", 1, "Aborted", json_mode)
    except KeyboardInterrupt:  # raised outside a command (Typer maps it to 130 inside one)
        result = INTERRUPTED
    except Exception as exc:
        usage = _usage_error(exc)
        if usage is not None:
            return _fail(*usage, 2, "UsageError", json_mode)
        if debug:
            raise
        return _fail(
            f"{type(exc).__name__}: {exc}",
            "this is a bug in ckptctl; rerun with CKPTCTL_DEBUG=1 for the traceback and report it",
            2,
            "InternalError",
            json_mode,
            label="internal error",
        )
    if result == INTERRUPTED and not ranks.DELEGATED.get():
        # Typer turns Ctrl-C (or a launcher's SIGTERM, see cli.ranks) inside a command into exit code 130; a
        # script reading --json still gets one document saying so, rather than an empty stdout.
        return _fail("interrupted before the command finished", "", INTERRUPTED, "Interrupted", json_mode)
    return result if isinstance(result, int) else 0


def _usage_error(exc: Exception) -> tuple[str, str] | None:
    """(message, hint) of a command-line parsing error, or None for any other exception.

    Typer vendors Click privately, so its usage errors are recognised by their interface (an exit code of
    2 and `format_message`), not by their class.
    """
    if getattr(exc, "exit_code", None) != 2 or not callable(getattr(exc, "format_message", None)):
        return None
    message = str(exc.format_message()).replace("Value error, ", "")  # type: ignore[attr-defined]
    if message[:1].isupper() and message[1:2].islower():
        message = message[0].lower() + message[1:]
    ctx = getattr(exc, "ctx", None)
    command = getattr(ctx, "command_path", "ckptctl")
    return message, f"see `{command} --help`"


def _fail(message: str, hint: str, code: int, kind: str, json_mode: bool, *, label: str = "error") -> int:
    """Report an error on stderr (and as `{"schema_version": 1, "error": {...}}` on stdout with --json: indented,
    or on one line after the JSON lines of a command that prints them, as `sync --watch --json` does).

    Messages quote paths and names from the checkpoint: stderr shows their control characters escaped, the
    JSON document keeps them exact."""
    if json_mode:
        error = {"type": kind, "message": message, "hint": hint or None, "exit_code": code}
        indent = None if output.JSON_LINES.get() else 2
        sys.stdout.write(json.dumps({"schema_version": 1, "error": error}, indent=indent) + "\n")
    sys.stderr.write(f"{label}: {printable(message)}\n")
    if hint:
        sys.stderr.write(f"hint: {printable(hint)}\n")
    return code


def _silence(streams: tuple[TextIO, TextIO]) -> None:
    """Point the closed stream's descriptor at /dev/null, so that the interpreter's last flush of what is
    still buffered does not fail again (and turn the exit code into 120)."""
    for stream in streams:
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
            except (OSError, ValueError):
                continue
        except OSError:
            continue
