"""How every command is registered and how its help reads at any terminal width.

Typer's rich help reflows prose paragraphs (so the help texts keep each paragraph on one source line) but
it would also wrap an example in the middle of a command. Examples are therefore kept apart, in the
command's epilog, and printed after the options exactly as written: one command per line, never wrapped
(the terminal soft-wraps a long one, so a copy-paste still gets it whole). The usage line names the
arguments as the reference does (`SRC DST`, not `{src} {dst}`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperArgument, TyperCommand, TyperGroup


class Group(TyperGroup):
    """The `ckptctl` group: its own flags show no `<bool>` either."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _typeless_flags(super().get_params(ctx))


class Command(TyperCommand):
    """A Typer command with an unwrapped examples section and upper-case argument names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, TyperArgument):
                # The argument's name (RUN, CKPT) says what it is; Typer's type column would add `<str>`.
                param.display_type_rich = _no_type  # type: ignore[method-assign]

    def get_params(self, ctx: Any) -> list[Any]:
        return _typeless_flags(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = param.metavar or (param.name or "").upper()
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_help(self, ctx: Any, formatter: Any) -> None:
        examples, self.epilog = self.epilog, None
        try:
            super().format_help(ctx, formatter)
        finally:
            self.epilog = examples
        if examples:
            print_examples(examples)


def _no_type(ctx: Any) -> None:
    return None


def _typeless_flags(params: list[Any]) -> list[Any]:
    """A flag takes no value: an empty metavar keeps Typer from showing `<bool>` beside it."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


def print_examples(examples: str) -> None:
    """The examples section of a command's help, each line as written (never wrapped or cropped)."""
    console = Console(highlight=False, soft_wrap=True)
    console.print()
    console.print(Text(" Examples", style="bold"))
    console.print()
    for line in examples.strip("\n").splitlines():
        console.print(Text(f"   {line}" if line else ""))
    console.print()


def add_command(app: typer.Typer, name: str, function: Callable[..., Any], help: str, examples: str) -> None:
    """Register `function` as `ckptctl NAME`, with its help text and examples."""
    app.command(name, help=help, epilog=examples, cls=Command)(function)
