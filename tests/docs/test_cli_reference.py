"""docs/cli.md is generated from the CLI and must not go stale (`make completions` regenerates it)."""

from __future__ import annotations

import typer.main

from ckptctl.cli.app import app
from scripts.gen_cli_reference import OUT, render


def test_cli_reference_is_current() -> None:
    assert OUT.exists(), "docs/cli.md missing: run `make completions`"
    assert OUT.read_text() == render(), "docs/cli.md is stale: run `make completions`"


def test_cli_reference_documents_every_command_and_option() -> None:
    text = render()
    group = typer.main.get_command(app)
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        assert f"## `ckptctl {name}`" in text
        for param in command.params:
            if param.param_type_name == "option":
                assert f"`{param.opts[0]}`" in text
