"""Malformed JSON and TOML, numbers no count can hold, absurd option values and deep runs (issue 16, point 4).

Each case is a real run with one file replaced: JSON nested 100,000 levels deep (RecursionError in the
standard parser), an integer of 5,000 digits (ValueError), `Infinity` where a step, a size or a world size
belongs (OverflowError in `int()`). Each used to end in "internal error"; now the command either goes on
without the file (a listing shows the checkpoint as broken) or stops with a ckptctl message naming it,
in bounded memory. `CheckpointManager.restore()` raises `CorruptCheckpoint` for the same files.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl.core import CheckpointManager
from ckptctl.core.entries import CheckpointWarning
from ckptctl.errors import CorruptCheckpoint
from tests.core import _workers
from tests.hostile.conftest import BIG_INT, DEEP_JSON, Source, json_with, message_of, plant
from tests.hostile.harness import Outcome, run_ckptctl

Make = Callable[[Path], None]


def text(content: str) -> Make:
    return lambda path: path.write_text(content)


def field(*keys: Any, raw: str) -> Make:
    return lambda path: json_with(path, keys, raw)


@dataclass(frozen=True)
class Case:
    """One hostile file: where it goes, what it holds, and what each command must do with it.

    `runs` holds (arguments, expected exit code); `{run}` and `{ckpt}` stand for the copy and its checkpoint.
    """

    id: str
    source: str
    file: str
    make: Make
    runs: tuple[tuple[tuple[str, ...], int], ...]


VERIFY = ("verify", "{ckpt}", "--json")
INSPECT = ("inspect", "{ckpt}", "--json")
LIST = ("list", "{run}", "--json")

CASES = [
    Case("config-deep", "hf", "config.json", text(DEEP_JSON), ((VERIFY, 1), (INSPECT, 0))),
    Case("config-bigint", "hf", "config.json", field("hidden_size", raw=BIG_INT), ((VERIFY, 1), (INSPECT, 0))),
    Case("index-deep", "hf-sharded", "model.safetensors.index.json", text(DEEP_JSON), ((VERIFY, 1), (INSPECT, 0))),
    Case(
        "index-bigint",
        "hf-sharded",
        "model.safetensors.index.json",
        field("metadata", "total_size", raw=BIG_INT),
        ((VERIFY, 1),),
    ),
    Case("trainer-state-deep", "trainer", "checkpoint-4/trainer_state.json", text(DEEP_JSON), ((VERIFY, 1), (LIST, 0))),
    Case(
        "trainer-state-bigint",
        "trainer",
        "checkpoint-4/trainer_state.json",
        field("global_step", raw=BIG_INT),
        ((VERIFY, 1), (LIST, 0)),
    ),
    Case(
        "trainer-state-infinity",
        "trainer",
        "checkpoint-4/trainer_state.json",
        field("global_step", raw="Infinity"),
        ((VERIFY, 1), (LIST, 0)),
    ),
    Case("step-info-deep", "areal", "recover_info/step_info.json", text(DEEP_JSON), ((VERIFY, 1), (LIST, 0))),
    Case(
        "step-info-bigint",
        "areal",
        "recover_info/step_info.json",
        field("global_step", raw=BIG_INT),
        ((VERIFY, 1), (LIST, 0)),
    ),
    Case(
        "rng-deep",
        "native",
        "step-30/rng.json",
        text(DEEP_JSON),
        ((VERIFY, 1), (("resume-plan", "{run}", "--json"), 0)),
    ),
    Case(
        "manifest-step-infinity",
        "native",
        "step-30/ckptctl-manifest.json",
        field("step", raw="Infinity"),
        ((INSPECT, 2), (VERIFY, 1), (LIST, 0)),
    ),
    Case(
        "manifest-world-size-infinity",
        "native",
        "step-30/ckptctl-manifest.json",
        field("world_size", raw="Infinity"),
        ((INSPECT, 2), (VERIFY, 1), (LIST, 0)),
    ),
    Case(
        "manifest-size-infinity",
        "native",
        "step-30/ckptctl-manifest.json",
        field("files", "model.safetensors", "size", raw="-Infinity"),
        ((INSPECT, 2), (VERIFY, 1), (LIST, 0)),
    ),
    Case(
        "manifest-step-bigint",
        "native",
        "step-30/ckptctl-manifest.json",
        field("step", raw=BIG_INT),
        ((INSPECT, 2), (VERIFY, 1), (LIST, 0)),
    ),
    Case(
        "policy-deep",
        "native",
        "ckptctl.toml",
        text("[retention]\nkeep_last = " + "[" * 100_000 + "]" * 100_000 + "\n"),
        ((("prune", "{run}", "--dry-run"), 2),),
    ),
    Case(
        "policy-bigint",
        "native",
        "ckptctl.toml",
        text(f"[retention]\nkeep_last = {BIG_INT}\nmax_total_size = {BIG_INT}\n"),
        ((("prune", "{run}", "--dry-run"), 2),),
    ),
]
RUNS = [(case, args, code) for case in CASES for args, code in case.runs]


@pytest.fixture(scope="session")
def planted(tmp_path_factory: pytest.TempPathFactory, sources: dict[str, Source]) -> dict[str, tuple[Path, Path]]:
    """Every case's copy of its run, with the hostile file in place: id -> (run, checkpoint)."""
    root = tmp_path_factory.mktemp("hostile-json")
    made = {}
    for case in CASES:
        source = sources[case.source]
        run = plant(source, root / case.id, case.file)
        original = source.run / case.file
        if original.exists():
            shutil.copyfile(original, run / case.file)
        case.make(run / case.file)
        made[case.id] = (run, run / source.checkpoint)
    return made


@pytest.mark.parametrize(("case", "args", "code"), RUNS, ids=[f"{case.id}-{args[0]}" for case, args, _ in RUNS])
def test_a_malformed_file_is_reported_by_name(
    planted: dict[str, tuple[Path, Path]], case: Case, args: tuple[str, ...], code: int
) -> None:
    run, checkpoint = planted[case.id]
    outcome = run_ckptctl([a.format(run=run, ckpt=checkpoint) for a in args])
    outcome.assert_refused(code)
    name = Path(case.file).name
    if code:
        assert name in message_of(outcome), (case.id, outcome.stdout[-2000:], outcome.stderr)
    elif args[0] == "list":
        _assert_listed_or_broken(outcome, checkpoint, name)


def _assert_listed_or_broken(outcome: Outcome, checkpoint: Path, name: str) -> None:
    """`list` goes on: the checkpoint is there, and when its marker is what is damaged it reads as broken
    with a note naming the file."""
    entries = {Path(c["url"]): c for c in json.loads(outcome.stdout)["checkpoints"]}
    assert checkpoint in entries, entries.keys()
    entry = entries[checkpoint]
    if name == "ckptctl-manifest.json":
        assert entry["state"] == "broken" and name in entry["note"], entry


# ------------------------------------------------------------------------------------------ options


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--grace", "9" * 40 + "d"),
        ("--older-than", BIG_INT + "d"),
        ("--older-than", "99999999999999w"),
        ("--max-total-size", BIG_INT + "PB"),
        ("--max-total-size", "9" * 30 + "EB"),
    ],
)
def test_absurd_prune_options_are_usage_errors(sources: dict[str, Source], option: str, value: str) -> None:
    outcome = run_ckptctl(["prune", str(sources["native"].run), "--keep-last", "1", "--dry-run", option, value])
    outcome.assert_refused(2)
    assert option in outcome.stderr


def test_an_absurd_shard_size_is_a_usage_error(sources: dict[str, Source], tmp_path: Path) -> None:
    dcp = sources["dcp"]
    outcome = run_ckptctl(
        [
            "convert",
            str(dcp.run / dcp.checkpoint),
            str(tmp_path / "out"),
            "--to",
            "hf",
            "--max-shard-size",
            BIG_INT + "GB",
        ]
    )
    outcome.assert_refused(2)
    assert "--max-shard-size" in outcome.stderr and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ deep runs

DEPTH = 400


@pytest.fixture(scope="session")
def deep_run(tmp_path_factory: pytest.TempPathFactory, sources: dict[str, Source]) -> tuple[Path, Path]:
    """A native checkpoint 400 folders below its run folder (deeper than Python's stack allows to recurse)."""
    run = tmp_path_factory.mktemp("hostile-deep") / "run"
    bottom = run.joinpath(*["d"] * DEPTH)
    bottom.mkdir(parents=True)
    native = sources["native"]
    checkpoint = Path(shutil.copytree(native.run / native.checkpoint, bottom / "step-30"))
    return run, checkpoint


def test_a_deeply_nested_run_is_walked_to_the_bottom(deep_run: tuple[Path, Path]) -> None:
    run, checkpoint = deep_run
    listed = run_ckptctl(["list", str(run), "--depth", "100000", "--json"])
    listed.assert_refused(0)
    assert [Path(c["url"]) for c in json.loads(listed.stdout)["checkpoints"]] == [checkpoint]
    pruned = run_ckptctl(["prune", str(run), "--keep-last", "1", "--dry-run", "--depth", "100000", "--json"])
    pruned.assert_refused(0)
    assert [Path(k["url"]) for k in json.loads(pruned.stdout)["keep"]] == [checkpoint]


# ------------------------------------------------------------------------------------------ restore()


@pytest.fixture(scope="session")
def core_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 of a tiny training run saved by `CheckpointManager` (model, AdamW, StepLR, a sampler)."""
    run = tmp_path_factory.mktemp("hostile-core") / "run"
    manager = CheckpointManager(run)
    state = _workers.build_training_state(seed=5)
    for step in (1, 2):
        state["model"](torch.randint(0, 32, (2, 8))).logsumexp(-1).mean().backward()
        state["optimizer"].step()
        state["scheduler"].step()
        manager.save(step, state)
    return run


def _in_manifest(step_dir: Path, rel: str) -> None:
    """Record the planted file's new size in the manifest, so that restore takes the step as whole."""
    manifest = step_dir / "ckptctl-manifest.json"
    doc = json.loads(manifest.read_text())
    doc["files"][rel]["size"] = (step_dir / rel).stat().st_size
    manifest.write_text(json.dumps(doc))


RESTORE_CASES = {
    "manifest-step-infinity": ("ckptctl-manifest.json", field("step", raw="Infinity")),
    "manifest-world-size-infinity": ("ckptctl-manifest.json", field("world_size", raw="Infinity")),
    "manifest-size-infinity": ("ckptctl-manifest.json", field("files", "model.safetensors", "size", raw="Infinity")),
    "manifest-step-bigint": ("ckptctl-manifest.json", field("step", raw=BIG_INT)),
    "manifest-deep": ("ckptctl-manifest.json", text(DEEP_JSON)),
    "rng-deep": ("rng.json", text(DEEP_JSON)),
    "rng-bigint": ("rng.json", text('{"tree": ' + BIG_INT + "}")),
    "model-tree-a-list": ("model.json", text('{"tree": [1, 2, 3]}')),
    "optimizer-tree-numbers": ("optimizer.json", text('{"tree": {"state": 5, "param_groups": 7}}')),
    "scheduler-tree-a-list": ("scheduler.json", text('{"tree": [1]}')),
    "sampler-tree-a-string": ("sampler.json", text('{"tree": "x"}')),
}


@pytest.mark.parametrize("case", sorted(RESTORE_CASES))
def test_restore_refuses_a_malformed_file_with_a_ckptctl_error(core_run: Path, tmp_path: Path, case: str) -> None:
    rel, make = RESTORE_CASES[case]
    run = Path(shutil.copytree(core_run, tmp_path / "run"))
    step_dir = run / "step-2"
    make(step_dir / rel)
    if rel != "ckptctl-manifest.json":
        _in_manifest(step_dir, rel)
    with pytest.raises(CorruptCheckpoint, match=rel.replace(".", r"\.")):
        CheckpointManager(run).restore(_workers.build_training_state(seed=6), step=2)
    if rel == "ckptctl-manifest.json":
        # Asked for the newest valid step, restore passes over one whose manifest is damaged.
        with pytest.warns(CheckpointWarning, match="skipping newer broken ones"):
            assert CheckpointManager(run).restore(_workers.build_training_state(seed=6)) == 1
    else:
        # A step whose files are all there at their size is the newest valid one: restoring it says why not.
        with pytest.raises(CorruptCheckpoint, match=rel.replace(".", r"\.")):
            CheckpointManager(run).restore(_workers.build_training_state(seed=6))
