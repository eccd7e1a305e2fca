"""How every command is registered and how its help reads at any terminal width.

Typer's rich help reflows prose paragraphs (so the help texts keep each paragraph on one source line) but
it would also wrap an example in the middle of a command. Examples are therefore kept apart, in the
command's epilog, and printed after the options exactly as written: one command per line, never wrapped
(the terminal soft-wraps a long one, so a copy-paste still gets it whole). The usage line names the
arguments as the reference does (`SRC DST`, not `{src} {dst}`).

A command's help is short (what it does, its common options, examples: it fits 40 lines at 100 columns, as
`tests/cli/test_help.py` checks) and ends with where its reference is (`docs_anchor`): the rules and
guarantees live in the module's `REFERENCE`, which `scripts/gen_cli_reference.py` puts in docs/cli.md. Options
a command names in `more` are left out of its help (listed by name on one line) but parse, complete and appear
in the reference like any other: git's and cargo's help show the common options and leave the rest to the manual.

Typer checks every value it parses (a default or a path argument included) with a pydantic `TypeAdapter`,
and importing pydantic costs a command more than the rest of its start (DESIGN §5: a command's fixed cost
<= 0.2 s over Python's start-up). A value that already has its parameter's type needs no check (see
`_Coercion`), so that a command given only strings and flags never imports it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup


class Group(TyperGroup):
    """The `ckptctl` group: its own flags show no `<bool>` either."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _light_coercion(_typeless_flags(super().get_params(ctx)))


#: Where the reference of every command lives, relative to the repository root.
DOCS = "docs/cli.md"


def docs_anchor(name: str) -> str:
    r"""The reference of `ckptctl NAME`: its heading's anchor in docs/cli.md (`## \`ckptctl NAME\``)."""
    return f"{DOCS}#ckptctl-{name}"


class Command(TyperCommand):
    """A Typer command with an unwrapped examples section, upper-case argument names, the options of `more` left
    out of its help, and the line naming its reference last."""

    #: Options (their first name) the help leaves to the reference; set per command by `add_command`.
    more: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, TyperArgument):
                # The argument's name (RUN, CKPT) says what it is; Typer's type column would add `<str>`.
                param.display_type_rich = _no_type  # type: ignore[method-assign]

    def get_params(self, ctx: Any) -> list[Any]:
        return _light_coercion(_typeless_flags(super().get_params(ctx)))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = param.metavar or (param.name or "").upper()
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_help(self, ctx: Any, formatter: Any) -> None:
        examples, self.epilog = self.epilog, None
        left_out: list[Any] = [p for p in self.params if p.opts[0] in self.more and not getattr(p, "hidden", False)]
        for param in left_out:
            param.hidden = True  # for this rendering only: the option still parses and completes
        try:
            super().format_help(ctx, formatter)
        finally:
            self.epilog = examples
            for param in left_out:
                param.hidden = False
        print_examples(examples or "", [p.opts[0] for p in left_out], docs_anchor(self.name or ""))


class _Coercion:
    """What Typer's coercion of a parameter returns, without building it where the value already has the
    parameter's type: None (no value given), a string for a `str` parameter (every path argument), a number
    or enum member for one of that type (only the command's own defaults are not strings: Typer's parser gives
    strings). Any other value gets Typer's own coercion, built then, with its checks and its error messages.

    It stands in the parameter's `_runtime_param`, the slot where Typer (0.29, pinned) keeps that coercion once
    built (`typer.core._TyperParameter.get_runtime_param`); where a later Typer has no such slot it is not set,
    and every value gets Typer's own coercion (as fast as Typer is, and as correct).
    """

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        annotation = param.type_descriptor.annotation
        if value is None:  # what Typer's `RuntimeParam.coerce` returns for no value, before any check
            return () if param.multiple or param.nargs == -1 else None
        if type(value) is annotation or (_is_enum(annotation) and isinstance(value, annotation)):
            return value
        param._runtime_param = None
        return param.get_runtime_param().coerce(value, param=param, ctx=ctx)


_COERCION = _Coercion()


def _is_enum(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, enum.Enum)


def _light_coercion(params: list[Any]) -> list[Any]:
    """`params` with `_Coercion` in place of Typer's own; asked for where the command parses (`get_params`),
    which also sees the help option and the completion options Typer adds after building the command."""
    for param in params:
        descriptor = getattr(param, "type_descriptor", None)
        unset = getattr(param, "_runtime_param", False) is None
        # A parameter with a parser of its own has it run on every value, as Typer does.
        if unset and descriptor is not None and descriptor.parameter_info.parser is None:
            param._runtime_param = _COERCION
    return params


def _no_type(ctx: Any) -> None:
    return None


def _typeless_flags(params: list[Any]) -> list[Any]:
    """A flag takes no value: an empty metavar keeps Typer from showing `<bool>` beside it."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


def print_examples(examples: str, more: list[str], docs: str) -> None:
    """The end of a command's help: its examples, each line as written (never wrapped or cropped), the options
    left to the reference, and where the reference is. (rich is imported here, where help is drawn, not by a
    command that runs: DESIGN §5.)"""
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True)
    if examples.strip():
        console.print()
        console.print(Text(" Examples", style="bold"))
        console.print()
        for line in examples.strip("\n").splitlines():
            console.print(Text(f"   {line}" if line else ""))
    console.print()
    if more:  # wrapped at the terminal's width, as the options are
        Console(highlight=False).print(Text(f" More options, in the reference: {', '.join(more)}"))
    console.print(Text(f" Docs: {docs}"))


def add_command(
    app: typer.Typer,
    name: str,
    function: Callable[..., Any],
    help: str,
    examples: str,
    *,
    more: tuple[str, ...] = (),
) -> None:
    """Register `function` as `ckptctl NAME`, with its help text, examples and the options its help leaves to the
    reference (`more`: their first names)."""
    command = type(f"{Command.__name__}_{name.replace('-', '_')}", (Command,), {"more": more})
    app.command(name, help=help, epilog=examples, cls=command)(function)
