"""Regressions from the CLI safety review: user strings are never markup, `demo --force` only replaces a demo,
options are declared once, and prune never asks to confirm a plan it did not show."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptctl.checkpoint import Component
from scripts.gen_cli_reference import render
from tests.conftest import CliResult, copy_tree
from tests.ops.test_prune import write_run

Cli = Callable[..., CliResult]

MARKUP_NAMES = ["exp[lr=3e-4]", "run[/bold]"]


@pytest.fixture
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """A console wide enough that rich never folds a path across lines."""
    monkeypatch.setenv("COLUMNS", "500")


@pytest.mark.usefixtures("wide")
@pytest.mark.parametrize("name", MARKUP_NAMES)
def test_folder_names_that_look_like_markup_print_verbatim(
    run_cli: Cli, demo_dir: Path, tmp_path: Path, name: str
) -> None:
    run = copy_tree(demo_dir / "native", tmp_path / name / "native")
    step = run / "step-30"
    commands = {
        "list": ("list", tmp_path),
        "inspect": ("inspect", step, "--limit", "3"),
        "verify": ("verify", run),
        "resume-plan": ("resume-plan", run),
        "diff": ("diff", step, step),
        "convert": ("convert", step, tmp_path / name / "hf", "--mapping", "none"),  # a toy model: no config
    }
    for command, args in commands.items():
        result = run_cli(*args)
        assert result.exit_code == 0, (command, result.stderr)
        assert f"{name}/native" in result.stdout or f"{name}/hf" in result.stdout, (command, result.stdout)


@pytest.mark.usefixtures("wide")
@pytest.mark.parametrize("name", MARKUP_NAMES)
def test_notes_and_warnings_print_user_strings_verbatim(
    run_cli: Cli, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    from ckptctl.cli.output import Output

    empty = tmp_path / name
    empty.mkdir(parents=True)  # "run[/bold]" is two folders, "run[" and "bold]"
    listed = run_cli("list", empty)
    assert listed.exit_code == 0, listed.stderr
    assert f"no checkpoints found below {empty}" in listed.stderr
    Output().warn(f"{name} is odd")
    assert f"warning: {name} is odd" in capsys.readouterr().err


def test_demo_force_refuses_a_folder_it_did_not_write(run_cli: Cli, tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    result = run_cli("demo", precious, "--force", "--no-distributed", "--steps", "10")
    assert result.exit_code == 2
    assert "refusing to replace" in result.stderr and ".ckptctl-demo" in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(os.listdir(precious)) == ["thesis.tex"]


@pytest.mark.parametrize("where", ["cwd", "parent", "home"])
def test_demo_force_never_replaces_the_working_or_home_folder(
    run_cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / ".ckptctl-demo").write_text("")
    (work / ".ckptctl-demo").write_text("")  # even a marker does not make these deletable
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path))
    target = {"cwd": ".", "parent": "..", "home": "~"}[where]
    result = run_cli("demo", os.path.expanduser(target), "--force", "--no-distributed", "--steps", "10")
    assert result.exit_code == 2 and "refusing to replace" in result.stderr
    assert (work / ".ckptctl-demo").exists() and (tmp_path / ".ckptctl-demo").exists()


def test_demo_force_replaces_an_earlier_demo(run_cli: Cli, tmp_path: Path) -> None:
    folder = tmp_path / "demo"
    first = run_cli("demo", folder, "--no-distributed", "--steps", "10", "--json")
    assert first.exit_code == 0, first.stderr
    assert (folder / ".ckptctl-demo").is_file()
    (folder / "leftover.txt").write_text("from the earlier demo")
    again = run_cli("demo", folder, "--force", "--no-distributed", "--steps", "10", "--json")
    assert again.exit_code == 0, again.stderr
    assert not (folder / "leftover.txt").exists()
    assert (folder / ".ckptctl-demo").is_file() and (folder / "native" / "step-10").is_dir()


@pytest.mark.usefixtures("wide")
@pytest.mark.parametrize("command", ["inspect", "convert", "diff"])
def test_component_choices_are_shared_and_listed(run_cli: Cli, command: str) -> None:
    help_text = run_cli(command, "--help").stdout
    if command == "convert":  # a rarer option of convert: its help names it, the reference lists the choices
        assert "--component" in help_text
        help_text = render().split("## `ckptctl convert`")[1].split("\n## ")[0]
    assert all(c.value in help_text for c in Component), help_text
    bad = run_cli(command, "x", *(["y"] if command != "inspect" else []), "--component", "weights")
    assert bad.exit_code == 2 and "--component" in bad.stderr and "trainer_state" in bad.stderr


def test_one_display_path() -> None:
    import ckptctl.cli.list
    import ckptctl.cli.prune
    import ckptctl.ops.prune
    from ckptctl.ops.report import display_path

    assert display_path("s3://bucket/run/step-10", "s3://bucket/run") == "step-10"
    assert display_path("/elsewhere/step-10", "/runs/a") == "/elsewhere/step-10"
    for module in (ckptctl.cli.list, ckptctl.cli.prune, ckptctl.ops.prune):
        assert not hasattr(module, "_relative")


@pytest.mark.usefixtures("wide")
@pytest.mark.parametrize("command", ["list", "resume-plan"])
def test_run_commands_share_the_layout_filter_option(run_cli: Cli, command: str) -> None:
    # `list --layout` filters; its help used to say it skips detection (the checkpoint commands' option).
    help_text = run_cli(command, "--help").stdout
    assert "Consider only checkpoints of this layout" in help_text
    assert "Skip detection" not in help_text


def test_convert_counts_the_other_files(wide: None, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptctl.cli.convert import _render
    from ckptctl.cli.output import Output
    from ckptctl.ops.convert import ConvertResult

    def files_line(files: tuple[str, ...]) -> str:
        result = ConvertResult(
            src="src",
            dst="dst",
            to="hf",
            layout="hf",
            tensors=1,
            bytes=4,
            files=files,
            bytes_read=4,
            seconds=1.0,
            dtype=None,
        )
        capsys.readouterr()
        _render(Output(), result)
        return next(line for line in capsys.readouterr().out.splitlines() if "files:" in line)

    assert files_line(("model.safetensors",)).strip() == "files: model.safetensors"
    assert "(+ 2 more)" in files_line(("model.safetensors", "config.json", "ckptctl-digests.json"))
    assert "(+ 1 more)" in files_line(("config.json",))


class _Terminal(io.StringIO):
    """stdin as a terminal where the user would type `y`."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("mode", ["--json", "--quiet"])
def test_prune_never_prompts_for_a_plan_it_did_not_show(
    run_cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    run = write_run(tmp_path / "run")
    before = sorted(p.name for p in run.glob("step-*"))
    monkeypatch.setattr(sys, "stdin", _Terminal("y\n"))
    result = run_cli("prune", run, "--keep-last", "2", "--grace", "0", mode)
    assert result.exit_code == 2
    assert "Delete" not in result.stderr and "--yes" in result.stderr
    # Nothing but the error: no plan, no prompt (with --json, the error as JSON).
    assert result.stdout == "" if mode == "--quiet" else result.json["error"]["exit_code"] == 2
    assert sorted(p.name for p in run.glob("step-*")) == before
