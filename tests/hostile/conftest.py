"""Real checkpoints for the hostile-input tests, and how to plant one hostile file in a copy of them.

The runs are those the rest of the suite writes with real writers (the demo's native, DCP and HF runs,
the HF Trainer's output folder, a `save_pretrained` model, AReaL's trial from the FSDP2 writer); a variant
is a copy of one of them with a single file replaced. Variants are made once per session by the test
modules' own session fixtures and only read by the tests.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CliResult
from tests.hostile.harness import Outcome
from tests.writers.rl_runs import WrittenFsdpRuns
from tests.writers.trainer_writer import WrittenTrainerRun

__all__ = [
    "BIG_INT",
    "DEEP_JSON",
    "Source",
    "demo_state",
    "json_with",
    "message_of",
    "plant",
    "problems_of",
    "refresh_manifest",
]

#: JSON nested 100,000 levels deep: Python's parser gives up with RecursionError.
DEEP_JSON = "[" * 100_000 + "]" * 100_000
#: An integer of 5,000 digits: more than `int()` converts from text (4,300), a plain ValueError.
BIG_INT = "9" * 5000
_MARK = "\x00planted\x00"


@dataclass(frozen=True)
class Source:
    """A run written by a real writer: the folder to copy, and its checkpoint relative to it."""

    run: Path
    checkpoint: str = "."


@pytest.fixture(scope="session")
def sources(
    demo_dir: Path, trainer_run: WrittenTrainerRun, hf_model_dirs: dict[str, Path], fsdp_runs: WrittenFsdpRuns
) -> dict[str, Source]:
    """The runs hostile files are planted in, by name (the AReaL trial and ROLL output folder are the session's
    `fsdp_runs`: variants are copies, so one 2-rank run serves the whole suite)."""
    return {
        "native": Source(demo_dir / "native", "step-30"),
        "dcp": Source(demo_dir / "dcp", "step-30"),
        "hf": Source(demo_dir / "hf"),
        "hf-sharded": Source(hf_model_dirs["sharded"]),
        "trainer": Source(trainer_run.output_dir, "checkpoint-4"),
        "areal": Source(fsdp_runs.areal_trial, "default/recover_checkpoint"),
        "roll": Source(fsdp_runs.roll_output, f"{fsdp_runs.roll_launch.name}/checkpoint-2"),
    }


def plant(source: Source, root: Path, rel: str, content: str | bytes | None = None) -> Path:
    """Copy the run of `source` to `root` and replace its file `rel` by `content` (None: remove it, for the
    caller to put something else there). Returns the copy's root."""
    shutil.copytree(source.run, root, symlinks=True)
    target = root / rel
    if target.exists() or target.is_symlink():
        target.unlink()
    if content is not None:
        target.write_bytes(content.encode() if isinstance(content, str) else content)
    return root


def json_with(path: Path, keys: tuple[Any, ...], raw: str) -> None:
    """Rewrite the JSON file at `path` with the value at `keys` replaced by the JSON text `raw` (`Infinity`,
    an integer of 5,000 digits: what `json.dumps` will not write, and a hostile file may hold)."""
    doc = json.loads(path.read_text())
    node = doc
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = _MARK
    path.write_text(json.dumps(doc, indent=1).replace(json.dumps(_MARK), raw))


def refresh_manifest(step_dir: Path, *rels: str) -> None:
    """Make the manifest of a native step record the planted files `rels` (relative to `step_dir`) as they
    are now, as an attacker sharing the run would: their sizes and digests then check out."""
    from ckptctl.formats.digest import file_digest

    path = step_dir / "ckptctl-manifest.json"
    manifest = json.loads(path.read_text())
    for rel in rels:
        manifest["files"][rel].update(size=(step_dir / rel).stat().st_size, blake3=file_digest(str(step_dir / rel)))
    path.write_text(json.dumps(manifest))


def demo_state() -> dict[str, Any]:
    """A fresh model, optimizer and scheduler of `ckptctl demo`'s shapes: what a restore of the demo's runs
    loads into."""
    import torch

    from ckptctl.demo import _model

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler}


def problems_of(outcome: Outcome | CliResult) -> list[dict[str, Any]]:
    """The problems of `verify --json` output, over a checkpoint or a run."""
    doc = json.loads(outcome.stdout)
    results = doc.get("results", [doc])
    return [p for result in results for p in result["problems"]]


def message_of(outcome: Outcome) -> str:
    """What a refused command told the user: its `error:` line (exit 2), or its problems (exit 1)."""
    if outcome.returncode == 2:
        return outcome.stderr
    return os.linesep.join(f"{p['path']}: {p['message']}" for p in problems_of(outcome))
