"""A newcomer learns a command from its `--help` (issue 37): at 100 columns it fits 40 lines, ends with where its
reference is, and an option shared by several commands means one thing (one help text) everywhere. README.md
stays a guide (<= 300 lines) with a section per command, and docs/cli.md has an anchor for each."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import typer.main

from ckptctl.cli.app import COMMANDS, app
from ckptctl.cli.command import docs_anchor
from tests.conftest import CliResult
from tests.ops.test_prune import write_run

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = 100
MAX_HELP_LINES = 40
MAX_README_LINES = 300


def _all_help() -> dict[str, str]:
    """Every command's `--help` at 100 columns, in one interpreter (one process for the whole test)."""
    script = (
        "import contextlib, io, json, sys\n"
        "from ckptctl.cli.app import COMMANDS, main\n"
        "out = {}\n"
        "for name in COMMANDS:\n"
        "    buffer = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buffer):\n"
        "        try:\n"
        "            main([name, '--help'])\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    out[name] = buffer.getvalue()\n"
        "sys.__stdout__.write(json.dumps(out))\n"
    )
    env = {**os.environ, "COLUMNS": str(COLUMNS), "TERM": "dumb"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT, env=env)
    return json.loads(proc.stdout)


def _screen_lines(text: str) -> int:
    """Lines the help takes on a 100-column terminal: a longer line (an example) wraps there."""
    return sum(max(1, math.ceil(len(line) / COLUMNS)) for line in text.splitlines())


def test_every_command_help_fits_40_lines_and_names_its_reference() -> None:
    helps = _all_help()
    assert set(helps) == set(COMMANDS)
    too_long = {name: _screen_lines(text) for name, text in helps.items() if _screen_lines(text) > MAX_HELP_LINES}
    assert too_long == {}
    for name, text in helps.items():
        assert text.rstrip().splitlines()[-1].strip() == f"Docs: {docs_anchor(name)}", name
        assert "Examples" in text, name


def test_an_option_shared_by_several_commands_has_one_help_text() -> None:
    helps: dict[str, set[str]] = defaultdict(set)
    group = typer.main.get_command(app)
    for command in group.commands.values():  # type: ignore[attr-defined]
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden:
                helps[param.opts[0]].add(param.help or "")
    # Left as they are (renaming them would break command lines): `--to` names what is written, hf|dcp where a
    # model is written (convert, average), a framework's training state in reshard; `--steps` picks checkpoints
    # in average and counts training steps in demo; `--layout` reads a checkpoint as a layout, or filters a run's
    # checkpoints by it in list and resume-plan (see `cli.options.RunLayoutOpt`).
    exempt = {"--to", "--steps", "--layout"}
    assert {name: texts for name, texts in helps.items() if len(texts) > 1 and name not in exempt} == {}
    assert "processes" in " ".join(helps["--workers"]).lower()


def test_the_old_spelling_of_a_renamed_option_still_works_with_a_warning(
    run_cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """`sync --workers` (now `--transfers`): the same plan as the new spelling, and a warning naming it."""
    run = write_run(tmp_path / "run")
    old = run_cli("sync", run, tmp_path / "mirror", "--dry-run", "--json", "--workers", "2")
    new = run_cli("sync", run, tmp_path / "mirror", "--dry-run", "--json", "--transfers", "2")
    assert old.exit_code == new.exit_code == 0, old.stderr
    assert "--workers is deprecated here: use --transfers" in old.stderr
    assert "deprecated" not in new.stderr
    assert [c["url"] for c in old.json["checkpoints"]] == [c["url"] for c in new.json["checkpoints"]] != []


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_is_a_guide_with_a_section_per_command_and_each_has_a_reference_anchor() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= MAX_README_LINES
    sections = set(re.findall(r"^### `ckptctl ([a-z-]+)", readme, re.MULTILINE))
    assert sections == set(COMMANDS)
    cli_md = (ROOT / "docs" / "cli.md").read_text()
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", cli_md, re.MULTILINE)}
    for name in COMMANDS:
        page, anchor = docs_anchor(name).split("#")
        assert page == "docs/cli.md" and anchor in anchors, name
        assert f"]({docs_anchor(name)})" in readme, f"README's {name} section does not link its reference"
