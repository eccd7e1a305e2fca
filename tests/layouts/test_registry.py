"""The registry of framework plugins: each one's reader and capabilities as dotted names, imported on first use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from ckptctl import CheckpointManager
from ckptctl.contract.capabilities import CONVERT_SOURCE, SLIMMER, ConvertSource, Slimmer
from ckptctl.layouts import capability, get_layout
from ckptctl.layouts.registry import _REGISTRY


def test_every_declared_capability_is_what_its_slot_says() -> None:
    declared = [(plugin.name, slot, target) for plugin in _REGISTRY for slot, target in plugin.capabilities.items()]
    assert declared
    for name, slot, target in declared:
        found = capability(name, slot)
        assert found is not None, target
        if slot is CONVERT_SOURCE:
            assert isinstance(found, ConvertSource), target
        if slot is SLIMMER:
            assert isinstance(found, Slimmer), target


def test_every_plugin_names_its_readers_checkpoint_files() -> None:
    """The registry's copy, which spares a file given as a checkpoint the import of every reader."""
    declared = {plugin.name: plugin.checkpoint_files for plugin in _REGISTRY}
    assert declared == {name: get_layout(name).checkpoint_files for name in declared}
    assert any(declared.values())


def test_a_layout_outside_the_registry_has_no_capability() -> None:
    assert capability("safetensors", CONVERT_SOURCE) is None


def test_detecting_a_checkpoint_imports_no_later_plugin_and_no_capability(tmp_path: Path) -> None:
    """The first layout in registry order that recognises a folder ends detection: a native checkpoint
    (the first) costs no other framework package, and reading it none of its capabilities."""
    CheckpointManager(str(tmp_path)).save(1, {"model": torch.nn.Linear(2, 2)})
    (step,) = [p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    script = (
        "import json, sys\n"
        "from ckptctl.layouts import detect\n"
        "layout, _ = detect(sys.argv[1])\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('ckptctl.frameworks.'))\n"
        "packages = sorted({m.split('.')[2] for m in loaded})\n"
        "print(json.dumps([layout.name, packages, [m for m in loaded if m.endswith('.convert')]]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(step)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert json.loads(proc.stdout) == ["native", ["native"], []]
