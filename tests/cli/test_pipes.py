"""What pipes, cron jobs and CI logs see (issue 11): whole rows at any width, help that reads at 80 columns,
one error style, and a closed pipe that is no failure. Real processes with real pipes where it matters: a child
forked by a pre-imported server (tests/hostile/harness.py) under the environment of the test, and a fresh
interpreter where a shell pipeline is the point (the awk example, `| head -1`)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest

from ckptctl.cli.app import COMMANDS, app
from ckptctl.layouts import layout_names
from tests.conftest import CliResult, copy_tree
from tests.hostile.harness import Outcome, close_servers_by_environment, run_in_environment
from tests.ops.test_prune import write_run
from tests.writers.trainer_writer import WrittenTrainerRun

Cli = Callable[..., CliResult]
REPO = Path(__file__).resolve().parents[2]


def ckptctl(*args: object, columns: int = 80) -> Outcome:
    """`ckptctl ARGS` as a fresh interpreter would run it, stdout and stderr on pipes (not a terminal), COLUMNS
    set: forked by a server started under that environment (tests/hostile/harness.py: what Typer and rich read
    from the environment as they import is this one), ~0.1 CPU-s a command instead of ~0.7."""
    return run_in_environment([str(a) for a in args], _environment(columns), cwd=REPO, timeout=120)


def _environment(columns: int) -> dict[str, str]:
    """This process's environment for a command on pipes: no colour forced, COLUMNS set, this checkout first."""
    environment = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    environment.update(COLUMNS=str(columns), PYTHONPATH=str(REPO))
    return environment


@pytest.fixture(scope="module", autouse=True)
def _servers() -> Iterator[None]:
    """The servers `ckptctl` started (one per width) live as long as this module's tests."""
    yield
    close_servers_by_environment()


@pytest.fixture
def native_run(tmp_path: Path) -> Path:
    """A run of six checkpoints written by `CheckpointManager`, deep enough for long paths."""
    return write_run(tmp_path / "a-run-folder-with-a-name-long-enough-to-fill-a-narrow-terminal" / "run")


@pytest.fixture
def trainer_copy(trainer_run: WrittenTrainerRun, tmp_path: Path) -> Path:
    """The Trainer's output folder (`checkpoint-2/`, `checkpoint-4/`), copied so a test may change it."""
    return copy_tree(trainer_run.output_dir, tmp_path / "out")


# --- tables -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("columns", [40, 60, 80])
def test_piped_list_keeps_every_row_whole_at_any_width(trainer_copy: Path, columns: int) -> None:
    # A save the Trainer is still writing: everything but trainer_state.json, which it writes last.
    copy_tree(trainer_copy / "checkpoint-4", trainer_copy / "checkpoint-10")
    (trainer_copy / "checkpoint-10" / "trainer_state.json").unlink()
    proc = ckptctl("list", trainer_copy, columns=columns)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["path", "step", "epoch", "state", "layout", "size", "created", "latest", "note"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == ["checkpoint-2", "checkpoint-4", "checkpoint-10"]
    assert rows["checkpoint-10"].split()[1:4] == ["10", "-", "in_progress"]
    assert rows["checkpoint-10"].endswith("no trainer_state.json yet: being written")  # its own column
    assert rows["checkpoint-4"].split()[3] == "complete"
    assert all(line == line.rstrip() for line in lines)  # no padding to a terminal width
    assert proc.stderr == f"3 checkpoint(s) in {trainer_copy}\n"


def test_piped_list_has_one_line_per_checkpoint_and_cells_awk_can_count(native_run: Path) -> None:
    proc = ckptctl("list", native_run, "--limit", "3", columns=40)
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["path", "step-10", "step-20", "step-30"]
    # Every row has every cell: the header's 7 words, plus one each for `16.0 KiB` and `11-24 15:10:43`.
    assert {len(line.split()) for line in lines[1:]} == {len(lines[0].split()) + 2}
    assert all(line.split()[-1] in ("-", "*") for line in lines[1:])  # empty cells read `-`
    assert proc.stderr == f"3 of 6 checkpoint(s) in {native_run}\n"


def test_the_awk_example_of_the_help_works(native_run: Path) -> None:
    script = f'"{sys.executable}" -m ckptctl list "{native_run}" --state complete | awk \'NR > 1 {{print $1}}\''
    proc = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "40"},
        timeout=120,
    )
    assert proc.stdout.split() == [f"step-{s}" for s in (10, 20, 30, 40, 50, 60)]


@pytest.mark.parametrize("columns", [40, 60])
def test_a_narrow_terminal_leaves_columns_out_but_never_shortens_a_path(
    run_cli: Cli, native_run: Path, monkeypatch: pytest.MonkeyPatch, columns: int
) -> None:
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich treats stdout as a terminal
    monkeypatch.setenv("COLUMNS", str(columns))
    result = run_cli("list", native_run)
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in result.stdout.splitlines()]
    assert lines[0] == f"6 checkpoint(s) in {native_run}"  # the title: a person is watching
    assert [line.split()[0] for line in lines[2:]] == [f"step-{s}" for s in (10, 20, 30, 40, 50, 60)]
    assert all(len(line) <= columns for line in lines[1:])
    assert "left out to fit" in result.stderr and "created" in result.stderr


def test_a_wide_terminal_shows_every_column(run_cli: Cli, native_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", "200")
    result = run_cli("list", native_run)
    header = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout.splitlines()[1]).split()
    assert header == ["path", "step", "state", "layout", "size", "created", "latest"]
    assert "left out" not in result.stderr


def test_created_shows_seconds_and_the_year_when_not_this_year(
    run_cli: Cli, hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    old = copy_tree(hf_model_dirs["single"], tmp_path / "exports" / "old")
    copy_tree(hf_model_dirs["single"], tmp_path / "exports" / "new")
    stamp = datetime(2023, 11, 2, 17, 4, 55).timestamp()
    for path in old.iterdir():
        os.utime(path, (stamp, stamp))
    result = run_cli("list", tmp_path / "exports")
    row = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert "2023-11-02 17:04:55" in row["old"]
    created = datetime.fromisoformat(run_cli("list", tmp_path / "exports", "--json").json["checkpoints"][0]["created"])
    assert re.search(r"  \d\d-\d\d \d\d:\d\d:\d\d  ", row["new"]) and str(created.year) not in row["new"]


def test_when_formats_local_times() -> None:
    from ckptctl.cli.output import when

    now = datetime(2025, 6, 1, 12, 0, 0).astimezone()
    assert when(datetime(2025, 5, 14, 9, 31, 2).astimezone(), now=now) == "05-14 09:31:02"
    assert when(datetime(2024, 12, 31, 23, 59, 59).astimezone(), now=now) == "2024-12-31 23:59:59"
    assert when(None) == "-"


def test_list_limit_says_how_many_of_how_many(run_cli: Cli, native_run: Path) -> None:
    result = run_cli("list", native_run, "--limit", "2")
    assert result.exit_code == 0 and "2 of 6 checkpoint(s)" in result.stderr
    assert run_cli("list", native_run, "--limit", "2", "--json").json["total"] == 6


def test_other_tables_print_whole_rows_when_piped(native_run: Path) -> None:
    plan = ckptctl("prune", native_run, "--keep-last", "1", "--grace", "0", "--dry-run", columns=40)
    assert plan.returncode == 0, plan.stderr
    rows = plan.stdout.splitlines()
    assert rows[1].split() == ["action", "path", "step", "state", "size", "why"]
    assert rows[-2].split()[:3] == ["keep", "step-60", "60"] and "newest complete" in rows[-2]
    inspected = ckptctl("inspect", native_run / "step-60", "--filter", "weight", columns=40)
    assert any(line.split()[:2] == ["model.weight", "model"] for line in inspected.stdout.splitlines())
    assert all(line == line.rstrip() for line in inspected.stdout.splitlines())


# --- help ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_help_reads_at_80_columns(command: str) -> None:
    proc = ckptctl(command, "--help", columns=80)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    examples = importlib.import_module(COMMANDS[command]).EXAMPLES.strip().splitlines()
    out_lines = [line.strip() for line in text.splitlines()]
    for example in examples:  # every example whole, on its own line, however long
        assert example in out_lines, (example, text)
    prose = [line for line in text.splitlines() if line.strip() not in examples]
    assert all(len(line) <= 80 for line in prose), text
    for metavar in ("<str>", "<bool>", "<list[", "<int range>", "{"):
        assert metavar not in text.replace("{print", ""), (metavar, text)
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    argument = {
        "convert": "SRC DST",
        "reshard": "SRC DST",
        "sync": "SRC DST",
        "average": "CKPT... DST",
        "diff": "A B",
        "demo": "DIR",
        "inspect": "CKPT",
        "verify": "PATH",
        "slim": "RUN|CKPT",
    }
    assert usage.split("[OPTIONS]")[1].strip() == argument.get(command, "RUN")


def test_help_paragraphs_reflow_at_any_width() -> None:
    narrow = ckptctl("diff", "--help", columns=60).stdout
    wide = ckptctl("diff", "--help", columns=200).stdout
    sentence = "shape and dtype changes, max-abs and relative-L2 difference per tensor"
    assert sentence in " ".join(wide.split()) and sentence in " ".join(narrow.split())
    assert max(len(line) for line in narrow.splitlines() if "ckptctl diff" not in line) <= 60
    # A paragraph is one line of a wide terminal, not lines broken where the source was broken.
    assert any(len(line.strip()) > 150 for line in wide.splitlines())


def test_the_layout_and_sort_options_name_their_choices() -> None:
    # wide enough for the whole list of layouts on one line of the options table
    text = " ".join(ckptctl("list", "--help", columns=260).stdout.split())
    assert "Sort by step, created, size or url" in text
    assert ", ".join(layout_names()) in text


# --- errors: one style, and JSON with --json ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("list", "RUN", "--limit", "0"), "invalid value for '--limit'"),
        (("list", "RUN", "--sort", "age"), "invalid value for '--sort'"),
        (("list", "RUN", "--state", "done"), "invalid value for '--state'"),
        (("convert", "A", "B", "--to", "onnx"), "invalid value for '--to': 'onnx' is not one of 'hf', 'dcp'"),
        (("prune", "RUN", "--older-than", "7"), "invalid value for '--older-than'"),
        (("prune", "RUN", "--keep-best", "loss:lowest"), "invalid value for '--keep-best'"),
        (("list",), "missing argument 'RUN'"),
        (("list", "RUN", "--nope"), "no such option: --nope"),
        (("list", "RUN", "--layout", "nosuch"), "no layout named 'nosuch'"),
    ],
)
def test_every_usage_error_reads_the_same(run_cli: Cli, native_run: Path, args: tuple[str, ...], message: str) -> None:
    argv = [str(native_run) if a == "RUN" else a for a in args]
    result = run_cli(*argv)
    assert result.exit_code == 2
    first, second = result.stderr.splitlines()
    assert first.startswith("error: ") and message in first, result.stderr
    assert second.startswith("hint: ")
    assert not re.search(r"[│╭╮╰╯─]|Usage:|Traceback", result.stderr)
    with_json = run_cli(*argv, "--json")
    assert with_json.exit_code == 2
    assert with_json.json == {
        "schema_version": 1,
        "error": {"type": with_json.json["error"]["type"], "message": first[7:], "hint": second[6:], "exit_code": 2},
    }


def test_list_layout_nosuch_names_the_known_layouts(run_cli: Cli, native_run: Path) -> None:
    result = run_cli("list", native_run, "--layout", "nosuch")
    assert result.exit_code == 2 and f"known layouts: {', '.join(layout_names())}" in result.stderr
    assert "no checkpoints found" not in result.stderr


def test_list_on_a_file_says_it_is_a_file(run_cli: Cli, native_run: Path) -> None:
    result = run_cli("list", native_run / "step-10" / "ckptctl-manifest.json")
    assert result.exit_code == 2 and "is a file, not a run folder" in result.stderr
    assert "no such" not in result.stderr


def test_errors_after_the_command_started_are_json_too(run_cli: Cli, tmp_path: Path) -> None:
    result = run_cli("inspect", tmp_path / "nope", "--json")
    assert result.exit_code == 2
    assert result.json["error"]["type"] == "CheckpointNotFound" and "nope" in result.json["error"]["message"]


# --- a closed pipe is no failure ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [("--help",), ("list", "--help"), ("list", "RUN"), ("list", "RUN", "--json"), ("inspect", "RUN/step-60")],
)
def test_a_reader_that_stops_early_is_no_failure(native_run: Path, args: tuple[str, ...]) -> None:
    argv = [a.replace("RUN", str(native_run)) for a in args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    # The reader is gone before ckptctl writes a byte: every write hits a closed pipe.
    gone = run_in_environment(argv, env, cwd=REPO, timeout=120, reader_gone=True)
    assert gone.returncode == 0, gone.stderr
    stderr = gone.stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr and "error" not in stderr
    # And as scripts write it.
    head = subprocess.run(
        ["bash", "-c", 'set -o pipefail; "$0" -m ckptctl "$@" | head -1', sys.executable, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert head.returncode == 0, head.stderr
    assert len(head.stdout.splitlines()) == 1


# --- progress and noise -------------------------------------------------------------------------------


@pytest.mark.parametrize(("term", "drawn"), [("dumb", False), ("xterm-256color", True)])
def test_progress_bars_only_where_a_line_can_be_redrawn(
    monkeypatch: pytest.MonkeyPatch, term: str, drawn: bool
) -> None:
    from ckptctl.cli.output import Output

    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("TERM", term)
    assert Output().progress()._enabled is drawn
    assert Output(quiet=True).progress()._enabled is False


def test_help_lists_every_command() -> None:
    text = ckptctl("--help").stdout
    assert all(name in text for name in COMMANDS)
    assert set(COMMANDS) == {c.name for c in app.registered_commands}
