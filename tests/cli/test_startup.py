"""A command imports only what it runs (DESIGN §5: a command's fixed cost <= 0.2 s over Python's start-up):
the modules `ckptctl verify FILE` imports, asserted as a set (bench/startup.py measures the seconds), and the
parameter coercion that spares a command pydantic, checked against Typer's own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import typer.main
from safetensors.numpy import save_file

from ckptctl.cli.app import COMMANDS, build_app
from ckptctl.cli.command import _Coercion
from ckptctl.cli.report import DEFAULT_LAST
from ckptctl.ops import report_page
from tests.writers.dcp_writer import WrittenDcp

ROOT = Path(__file__).resolve().parents[2]

#: Imported by no command that reads a small checkpoint: the frameworks, numeric libraries and pydantic, which
#: Typer builds its coercion on.
HEAVY = ("torch", "numpy", "transformers", "safetensors", "accelerate", "deepspeed", "fsspec", "pydantic")


#: Readers a safetensors file never needs: torch.save's zip and pickle, DCP's metadata, resume plans.
_OTHER_FORMATS = {
    "ckptctl.formats.dcp_metadata",
    "ckptctl.formats.safe_pickle",
    "ckptctl.formats.torch_pickle",
    "ckptctl.formats.torch_save",
    "ckptctl.formats.raw_chunks",
    "ckptctl.families.dcp_folder",
    "ckptctl.contract.resume",
    "ckptctl.contract.training_state",
}


#: Imported where they are used, and a safetensors file's verify uses none: rich where a terminal, a table or a
#: progress bar is drawn (Typer's rich help with it), the capabilities' dataclasses by a command that asks for
#: one (the registry holds their slots, `contract.slots`), TOML's parser, zlib-ng for torch.save CRCs, ctypes
#: for the C calls of writers (`io.local`).
_WHERE_USED = {"rich", "typer.rich_utils", "ckptctl.contract.capabilities", "tomllib", "zlib_ng", "ctypes"}


def _imported(*args: str) -> tuple[int, str, set[str]]:
    """Exit code, stdout and the modules loaded at the end of `ckptctl ARGS`, run in a fresh interpreter."""
    script = (
        "import json, sys\n"
        "from ckptctl.cli.app import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit as exit:\n"
        "    print(json.dumps({'code': exit.code, 'modules': sorted(sys.modules)}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=True, cwd=ROOT)
    stdout, _, last = proc.stdout.rpartition("\n{")
    outcome = json.loads("{" + last)
    return outcome["code"], stdout, set(outcome["modules"])


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


def test_verify_of_a_file_imports_only_what_it_runs(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    save_file({"weight": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(weights))

    code, stdout, modules = _imported("verify", str(weights), "--json")
    # Printed for a person, to a pipe (a script's log): the same lines rich would print, without rich.
    plain_code, plain_stdout, plain_modules = _imported("verify", str(weights))

    assert code == 0 and json.loads(stdout)["ok"] is True
    assert plain_code == 0 and plain_stdout == f"ok  {weights} (safetensors; structure)"
    assert {m for m in modules | plain_modules if m in _WHERE_USED or m.split(".")[0] in _WHERE_USED} == set()
    assert _heavy(modules) == []
    # Only the command's own module of the command-line modules, and no framework's reader: a safetensors
    # file is no framework's checkpoint file (`Plugin.checkpoint_files`).
    assert {m for m in modules if m.startswith("ckptctl.cli.")} <= {
        "ckptctl.cli.app",
        "ckptctl.cli.command",
        "ckptctl.cli.options",
        "ckptctl.cli.output",
        "ckptctl.cli.ranks",
        "ckptctl.cli.verify",
    }
    assert sorted(m for m in modules if m.startswith("ckptctl.frameworks.")) == []
    # The other commands' library code: slim (with prune and the run lock) and resume-plan are for --latest
    # and slimmed checkpoints alone.
    assert {"ckptctl.ops.slim", "ckptctl.ops.prune", "ckptctl.ops.resume_plan", "ckptctl.core.lock"} & modules == set()
    # Nor the readers of other formats: torch.save pickles and DCP metadata (their import is most of the rest).
    assert {m for m in modules if m in _OTHER_FORMATS} == set()
    # Nor the content checks: a safetensors file without a manifest has no byte to check beyond its header.
    assert {"ckptctl.ops.content", "ckptctl.ops.digests", "ckptctl.ops.sweeping", "blake3"} & modules == set()


def test_verify_of_a_dcp_folder_imports_no_resume_profile_nor_capability(raw_dcp: WrittenDcp) -> None:
    """Finding which layout a DCP folder is imports the readers tried before `dcp`'s: not what they resume as
    (`contract.resume`, each plugin's `resume` module) nor the capabilities' dataclasses, nor `secrets` and
    `socket` (names and records of the native layout's saves, which verify only reads)."""
    code, stdout, modules = _imported("verify", str(raw_dcp.path), "--json")

    assert code == 0 and json.loads(stdout)["layout"] == "dcp"
    assert "ckptctl.frameworks.native.layout" in modules  # tried first, so the check below means something
    assert sorted(m for m in modules if m == "ckptctl.contract.resume" or m.endswith(".resume")) == []
    assert {"ckptctl.contract.capabilities", "secrets", "socket"} & modules == set()
    assert _heavy(modules) == []


def test_help_imports_every_command_and_nothing_heavy() -> None:
    """`ckptctl --help` imports every command's module: none imports heavy code at module level."""
    code, stdout, modules = _imported("--help")

    assert code == 0 and "verify" in stdout
    assert set(COMMANDS.values()) <= modules
    assert _heavy(modules) == []
    assert (
        DEFAULT_LAST == report_page.DEFAULT_LAST
    )  # one value (`ops.report`), which `cli.report` takes without that module


def test_the_light_coercion_returns_what_typer_returns() -> None:
    """Every parameter's default that is a value, and a string for each string parameter (every path
    argument), across every command: where `_Coercion` skips Typer's coercion, Typer's own returns the same."""
    group = typer.main.get_command(build_app())
    checked = []
    for command in group.commands.values():  # type: ignore[attr-defined]
        for param in command.params:
            values = [param.default] if param.default is not None and not callable(param.default) else []
            values += ["runs/a b"] if param.type_descriptor.annotation is str else []
            for value in values:
                param._runtime_param = None
                expected = param.get_runtime_param().coerce(value, param=param, ctx=None)
                ours = _Coercion().coerce(value, param, None)
                checked.append((command.name, param.name, value, ours == expected and type(ours) is type(expected)))
    assert len(checked) > 50 and [c for c in checked if not c[3]] == []


def test_every_command_runs_from_its_own_module_alone() -> None:
    """Each command's app has that command, under the name `COMMANDS` gives it (what `main` dispatches on)."""
    for name in COMMANDS:
        assert [c.name for c in build_app([name]).registered_commands] == [name]
