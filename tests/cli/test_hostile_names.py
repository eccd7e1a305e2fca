"""Names from a checkpoint never drive the terminal or the shell (issue 21, points 2 and 3).

Run folders, file and tensor names hold terminal sequences (clear the screen, set the title, write the
clipboard, C1 CSI, DEL): human output shows them as escapes in every command and error, `--json` keeps them
exact. Folders named to break out of a shell word or a Python string: every suggested command and code line
gives back exactly the original path (`shlex.split`, `ast.parse`), and running it runs nothing else.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import shlex
import subprocess
from collections.abc import Callable, Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Component
from ckptctl.contract.resume import PlanContext
from ckptctl.layouts import get_layout, layout_names
from ckptctl.ops.resume_plan import profile_for
from ckptctl.quoting import printable
from tests.conftest import CliResult, copy_tree
from tests.writers.deepspeed_writer import WrittenDeepSpeed

Cli = Callable[..., CliResult]

#: Erase the screen, set the window title, write the clipboard (OSC 52), a C1 CSI, DEL.
SEQUENCES = ["\x1b[2J", "\x1b]0;title\x07", "\x1b]52;c;cHduZWQ=\x07", "\x9b31m", "\x7f"]
HOSTILE = "run" + "".join(SEQUENCES)
#: A name that is not UTF-8: its bytes 0x9b (a C1 CSI) and 0xe9 reach Python as surrogates (`os.fsdecode`).
NOT_UTF8 = os.fsdecode(b"raw\x9b2J\xe9")
#: Rich markup in tensor names: it must print as written and never open a style or a link.
MARKUP = ["[bold]x", "[link=https://example.com]y[/link]", "\x1b]8;;https://example.com\x07z"]

#: Any control character but the line break: none may reach a terminal from human output.
RAW = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
#: What rich itself writes to a colour terminal: styles, and the cursor moves of a progress bar.
RICH_OWN = re.compile(r"\x1b\[(?:[0-9;]*m|\?25[lh]|2K|[0-9]*[AG])|\r")

SHELL_NAME = "run $(touch PWNED) `touch PWNED`; touch PWNED #c"
PYTHON_NAME = "n\"); import os; os.system('touch PWNED'); (\"'"


@pytest.fixture
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "500")


@pytest.fixture
def hostile_run(demo_dir: Path, tmp_path: Path) -> Path:
    """The demo's native run (three steps the core wrote), inside a folder named with every sequence."""
    return copy_tree(demo_dir / "native", tmp_path / HOSTILE / "native")


def _commands(run: Path, out: Path) -> dict[str, tuple[str | Path, ...]]:
    step = run / "step-30"
    return {
        "list": ("list", run.parent),
        "inspect": ("inspect", step, "--limit", "3"),
        "verify": ("verify", run),
        "diff": ("diff", run / "step-20", step),
        "resume-plan": ("resume-plan", run),
        "prune": ("prune", run, "--keep-last", "1", "--grace", "0s", "--dry-run"),
        "convert": ("convert", step, out),
    }


def _strings(document: Any) -> Iterator[str]:
    if isinstance(document, str):
        yield document
    elif isinstance(document, dict):
        for value in document.values():
            yield from _strings(value)
    elif isinstance(document, list):
        for value in document:
            yield from _strings(value)


@pytest.mark.usefixtures("wide")
@pytest.mark.parametrize("name", [HOSTILE, NOT_UTF8], ids=["sequences", "not-utf8"])
def test_human_output_escapes_a_run_folder_name(run_cli: Cli, demo_dir: Path, tmp_path: Path, name: str) -> None:
    run = copy_tree(demo_dir / "native", tmp_path / name / "native")
    for command, args in _commands(run, tmp_path / name / "hf").items():
        result = run_cli(*args)
        assert result.exit_code in (0, 1), (command, result.stderr)
        shown = result.stdout + result.stderr
        assert RAW.search(shown) is None, (command, shown)
        assert printable(name) in shown, (command, shown)


@pytest.mark.usefixtures("wide")
def test_json_output_keeps_the_exact_name(run_cli: Cli, hostile_run: Path, tmp_path: Path) -> None:
    for command, args in _commands(hostile_run, tmp_path / HOSTILE / "hf-json").items():
        result = run_cli(*args, "--json")
        assert result.exit_code in (0, 1), (command, result.stderr)
        assert RAW.search(result.stderr) is None, (command, result.stderr)
        assert any(str(hostile_run) in s for s in _strings(result.json)), (command, result.stdout)


def test_a_colour_terminal_gets_rich_styles_and_nothing_else(
    run_cli: Cli, hostile_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tables fitted to the terminal, facts as a grid, styled states and progress bars: the terminal paths.
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "400")
    for command, args in _commands(hostile_run, hostile_run.parent / "hf").items():
        result = run_cli(*args)
        assert result.exit_code in (0, 1), (command, result.stderr)
        shown = RICH_OWN.sub("", result.stdout + result.stderr)
        assert RAW.search(shown) is None, (command, shown)
        assert printable(HOSTILE) in shown, (command, shown)


def test_errors_escape_names_and_json_errors_keep_them(run_cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / HOSTILE / "step-10"
    # A usage error quotes the value as Click writes it (a Python repr), which escapes it already.
    for args in (("inspect", missing), ("verify", missing), ("list", tmp_path, "--sort", HOSTILE)):
        result = run_cli(*args)
        assert result.exit_code == 2, result.stderr
        assert result.stderr.startswith("error: ") and RAW.search(result.stderr) is None, result.stderr
        assert printable(HOSTILE) in result.stderr
        error = run_cli(*args, "--json").json["error"]
        assert error["exit_code"] == 2
        assert HOSTILE in error["message"] if args[0] != "list" else printable(HOSTILE) in error["message"]


@pytest.fixture
def markup_tensors(tmp_path: Path) -> tuple[Path, Path]:
    """Two safetensors files (written by safetensors) whose tensor names hold markup and sequences; the
    second one's values differ, so that diff lists every name."""
    import torch
    from safetensors.torch import save_file

    names = [HOSTILE, *MARKUP]
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({name: torch.zeros(2, 2) for name in names}, str(a))
    save_file({name: torch.ones(2, 2) for name in names}, str(b))
    return a, b


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_tensor_names_are_neither_markup_nor_sequences(
    run_cli: Cli, markup_tensors: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, terminal: bool
) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    if terminal:
        monkeypatch.setenv("FORCE_COLOR", "1")
        monkeypatch.setenv("TERM", "xterm-256color")
    a, b = markup_tensors
    names = [HOSTILE, *MARKUP]
    for args in (("inspect", a), ("diff", a, b, "--all")):
        result = run_cli(*args)
        assert result.exit_code in (0, 1), result.stderr
        shown = RICH_OWN.sub("", result.stdout + result.stderr)
        assert RAW.search(shown) is None, shown
        for name in names:
            assert printable(name) in shown, (name, shown)
        assert "\x1b]8;" not in result.stdout  # no hyperlink opened by [link=...]
    assert sorted(t["name"] for t in run_cli("inspect", a, "--json").json["tensors"]) == sorted(names)
    assert sorted(t["name"] for t in run_cli("diff", a, b, "--json").json["changed"]) == sorted(names)


def test_warnings_and_progress_descriptions_are_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    from ckptctl.cli.output import Output, RichProgress

    Output().warn(f"{HOSTILE} [bold]is odd")
    Output().note(HOSTILE)
    err = capsys.readouterr().err
    assert RAW.search(err) is None and f"warning: {printable(HOSTILE)} [bold]is odd" in err
    assert printable(HOSTILE) + "\n" in err

    buffer = StringIO()
    console = Console(file=buffer, force_terminal=True, width=200)
    progress = RichProgress(console, enabled=True)
    progress.start(f"hashing {HOSTILE} [link=https://example.com]x", 10)
    progress.advance(5)
    progress.finish()
    drawn = RICH_OWN.sub("", buffer.getvalue())
    assert RAW.search(drawn) is None and "\x1b]8;" not in buffer.getvalue()


# --------------------------------------------------------------------------------------------------
# Point 3: every suggested command and code line gives back exactly the original path.
# --------------------------------------------------------------------------------------------------


class _Recorder:
    """Stands in for every name a suggested Python line uses: records each call and its arguments."""

    def __init__(self, calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]], name: str) -> None:
        self._calls, self._name = calls, name

    def __getattr__(self, attribute: str) -> _Recorder:
        return _Recorder(self._calls, f"{self._name}.{attribute}")

    def __call__(self, *args: Any, **kwargs: Any) -> _Recorder:
        self._calls.append((self._name, args, kwargs))
        return _Recorder(self._calls, f"{self._name}()")


def _run_python(line: str, sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple, dict]]:
    """Parse `line` (one statement or several on a line, a comment after them) and run it in `sandbox`
    against recorders, with the real builtins: an injected `import os; os.system(...)` would really run."""
    tree = ast.parse(line)
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    calls: list[tuple[str, tuple, dict]] = []
    monkeypatch.chdir(sandbox)
    exec(compile(tree, "<hint>", "exec"), {"__builtins__": builtins, **{n: _Recorder(calls, n) for n in names}})
    assert all(isinstance(s, ast.Expr) for s in tree.body), line  # calls only: no import, no assignment
    return calls


def _run_shell(line: str, sandbox: Path) -> list[str]:
    """The words a POSIX shell passes for `line` (run with `printf` in front, so nothing else runs)."""
    shown = subprocess.run(
        ["sh", "-c", "printf '%s\\n' " + line], cwd=sandbox, capture_output=True, text=True, check=True
    ).stdout
    return shown.split("\n")[:-1]


def _sandbox(tmp_path: Path) -> Path:
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir(exist_ok=True)
    return sandbox


@pytest.mark.parametrize("name", [PYTHON_NAME, SHELL_NAME], ids=["python", "shell"])
def test_python_hints_give_back_the_path(
    run_cli: Cli, demo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # What each hint must call, and on which folder: the run (ckptctl's manager), the checkpoint (DCP).
    expected = {"native": "CheckpointManager", "dcp": "dcp.load"}
    sandbox = _sandbox(tmp_path)
    for layout, function in expected.items():
        run = copy_tree(demo_dir / layout, tmp_path / name / layout)
        plan = run_cli("resume-plan", run, "--json").json
        folder = str(run) if layout == "native" else plan["checkpoint"]["url"]
        calls = _run_python(plan["resume_hint"], sandbox, monkeypatch)
        named = [(f, a) for f, args, kwargs in calls for a in (*args, *kwargs.values()) if isinstance(a, str)]
        assert named == [(function, folder)], plan["resume_hint"]
        assert list(sandbox.iterdir()) == [], plan["resume_hint"]


def test_deepspeed_conversion_command_gives_back_the_tag(
    run_cli: Cli, deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_dir = copy_tree(deepspeed_runs[2].save_dir, tmp_path / SHELL_NAME / PYTHON_NAME)
    tag = save_dir / "global_step4"
    result = run_cli("resume-plan", save_dir, "--world-size", "4", "--json")
    assert result.exit_code == 1, result.stderr
    fix = result.json["world_size"]["fix"]
    words = [
        "python",
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(tag),
        "--output_folder",
        f"{tag}_universal",
        "--inject_missing_state",
    ]
    assert shlex.split(fix, comments=True) == words, fix
    sandbox = _sandbox(tmp_path)
    assert _run_shell(fix, sandbox) == words and list(sandbox.iterdir()) == []
    calls = _run_python(result.json["resume_hint"], sandbox, monkeypatch)
    assert calls == [("engine.load_checkpoint", (str(save_dir),), {"tag": "global_step4_universal"})]
    assert list(sandbox.iterdir()) == []
    # People see the same command, whole.
    assert fix in run_cli("resume-plan", save_dir, "--world-size", "4").stdout


def _hostile_context(tmp_path: Path, layout: str, target: int | None = None, **metadata: object) -> PlanContext:
    url = tmp_path / SHELL_NAME / PYTHON_NAME / "out" / "global_step4"
    url.mkdir(parents=True, exist_ok=True)
    ref = CheckpointRef(str(url), layout, 4, None, None, CheckpointState.COMPLETE, 0)
    checkpoint = Checkpoint(ref, frozenset({Component.MODEL, Component.OPTIMIZER}), 2, metadata, tensor_index=tuple)
    return PlanContext(str(io.parent_of(str(url))), checkpoint, (ref,), (), target, layout_of=get_layout)


#: Hints that are Python lines, shell words (flags for the framework's launcher), or a YAML line.
PYTHON_HINTS = {"native", "lightning", "dcp", "hf_trainer", "accelerate", "deepspeed", "peft", "hf"}
SHELL_HINTS = {"verl", "megatron", "torchtitan", "openrlhf", "open_instruct"}


def _paths(ctx: PlanContext) -> set[str]:
    """The paths a hint may name: the checkpoint, the folders above it, and their names."""
    url = Path(ctx.url)
    folders = [url, *list(url.parents)[:3]]
    return {str(f) for f in folders} | {f.name for f in folders}


@pytest.mark.parametrize("layout", sorted(PYTHON_HINTS | SHELL_HINTS | {"roll"}))
def test_every_framework_hint_gives_back_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    assert PYTHON_HINTS | SHELL_HINTS | {"roll"} <= set(layout_names())
    ctx = _hostile_context(tmp_path, layout)
    hint = profile_for(layout).hint(ctx)
    sandbox = _sandbox(tmp_path)
    if layout in PYTHON_HINTS:
        named = [
            a
            for _, args, kwargs in _run_python(hint, sandbox, monkeypatch)
            for a in (*args, *kwargs.values())
            if isinstance(a, str) and PYTHON_NAME in a
        ]
    elif layout in SHELL_HINTS:
        words = shlex.split(hint, comments=True)
        assert _run_shell(hint, sandbox) == words
        named = [re.sub(r"^[\w.]+=", "", w) for w in words if PYTHON_NAME in w]
    else:
        import yaml

        named = list(yaml.safe_load(hint).values())
    assert named and set(named) <= _paths(ctx), hint
    assert list(sandbox.iterdir()) == [], hint


@pytest.mark.parametrize("layout", ["deepspeed", "openrlhf", "open_instruct"])
def test_every_zero_conversion_fix_gives_back_the_path(tmp_path: Path, layout: str) -> None:
    ctx = _hostile_context(tmp_path, layout, target=16, zero_stage=2, dp_world_size=8)
    check = profile_for(layout).world_size(ctx)
    assert check.ok is False and check.fix
    sandbox = _sandbox(tmp_path)
    words = shlex.split(check.fix, comments=True)
    assert _run_shell(check.fix, sandbox) == words and list(sandbox.iterdir()) == []
    named = {w.removesuffix("_universal") for w in words if PYTHON_NAME in w}
    assert named and named <= _paths(ctx), check.fix


def test_error_hints_quote_the_command(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    run = copy_tree(demo_dir / "dcp", tmp_path / SHELL_NAME / "dcp")
    result = run_cli("inspect", run, "--json")  # a run of DCP folders, not a checkpoint: the hint says `ckptctl list`
    assert result.exit_code == 2
    hint = result.json["error"]["hint"]
    command = hint.split("use `", 1)[1].rsplit("` or pass", 1)[0]
    assert shlex.split(command) == ["ckptctl", "list", str(run)], hint
    assert _run_shell(command, _sandbox(tmp_path)) == ["ckptctl", "list", str(run)]


def test_demo_names_its_next_command_quoted(run_cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "500")
    folder = tmp_path / SHELL_NAME
    result = run_cli("demo", folder, "--no-distributed", "--steps", "10")
    assert result.exit_code == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("next: "))
    assert shlex.split(line.removeprefix("next: ")) == ["ckptctl", "list", str(folder)]


def test_json_round_trips_every_sequence(run_cli: Cli, hostile_run: Path) -> None:
    listed = run_cli("list", hostile_run, "--json").json
    urls = [c["url"] for c in listed["checkpoints"]]
    assert urls and all(u.startswith(str(hostile_run)) for u in urls)
    assert json.loads(json.dumps(listed)) == listed


@given(st.text())
@example("\u20280\u2028")  # YAML ends a line (and a comment) at U+2028
@example("\x85x\u2029")
def test_quoting_gives_back_any_text(text: str) -> None:
    """The helpers every suggestion is built with, on any text: one shell word, one Python string, one YAML
    value, a comment that no character ends, and nothing a terminal would act on."""
    from ckptctl.quoting import Code, comment, python_call, shell, yaml_value

    assert RAW.search(printable(text)) is None and "\n" not in printable(text)
    assert "\n" not in comment(text) and "\r" not in comment(text)
    word = text.replace("\x00", "")  # no shell word holds NUL
    assert shlex.split(shell("ckptctl", "list", word)) == ["ckptctl", "list", word]
    call = ast.parse(python_call("f", Code("state"), text, key=text) + comment(text)).body
    assert len(call) == 1 and isinstance(call[0], ast.Expr) and isinstance(call[0].value, ast.Call)
    assert [ast.literal_eval(a) for a in call[0].value.args[1:]] == [text]
    assert ast.literal_eval(call[0].value.keywords[0].value) == text
    if not any(0xD800 <= ord(c) <= 0xDFFF for c in text):  # a lone surrogate is no YAML text
        import yaml

        assert yaml.safe_load("k: " + yaml_value(text) + comment(text)) == {"k": text}
