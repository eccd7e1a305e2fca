"""Shell completions in completions/ are generated from the app and must not go stale."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from scripts.gen_completions import OUT, render


@pytest.mark.parametrize("name", sorted(render()))
def test_completion_scripts_are_current(name: str) -> None:
    committed = OUT / name
    assert committed.exists(), f"completions/{name} missing: run `make completions`"
    assert committed.read_text() == render()[name], f"completions/{name} is stale: run `make completions`"


def test_bash_completion_offers_the_commands_and_options(tmp_path: Path) -> None:
    script = OUT / "ckptctl.bash"
    probe = f"""
source {script}
COMP_WORDS=(ckptctl ver); COMP_CWORD=1; _ckptctl; echo "cmds:${{COMPREPLY[*]}}"
COMP_WORDS=(ckptctl verify --de); COMP_CWORD=2; _ckptctl; echo "opts:${{COMPREPLY[*]}}"
COMP_WORDS=(ckptctl list --state ''); COMP_CWORD=3; _ckptctl; echo "state:${{COMPREPLY[*]}}"
"""
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "cmds:verify" in out
    assert "opts:--deep" in out
    assert "state:complete in_progress broken" in out


@pytest.mark.parametrize(("shell", "name"), [("zsh", "_ckptctl"), ("fish", "ckptctl.fish")])
def test_other_shells_parse_their_script(shell: str, name: str) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    subprocess.run([shell, "-n", str(OUT / name)], check=True)
