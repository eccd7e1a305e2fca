"""Special files where a checkpoint's small files belong (issue 16, point 5).

A FIFO as `latest`, `trainer_state.json`, `.metadata` or the prune lock used to block every command
forever; `/dev/zero` or a sparse 4 GiB file in their place made them read until MemoryError. ckptctl reads
only regular files, and metadata only up to a size no real one reaches: each command now ends at once,
in little memory, naming the file when it needed it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptctl.core.lock import LOCK_NAME
from tests.hostile.conftest import Source, message_of, plant
from tests.hostile.harness import run_ckptctl, run_with_address_space


#: How each kind of special file is put in place of the real one.
def _sparse(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(4 << 30)


KINDS = {
    "fifo": os.mkfifo,
    "dev-zero": lambda path: path.symlink_to("/dev/zero"),
    "sparse-4GiB": _sparse,
}
#: What `stat` says of each kind, in ckptctl's messages.
SAID = {"fifo": "FIFO", "dev-zero": "character device", "sparse-4GiB": "larger than"}


@dataclass(frozen=True)
class Target:
    """A small file commands read, and what they must do when something else is in its place.

    `runs` holds (arguments, expected exit code, whether the message must name the file); `{run}` and
    `{ckpt}` stand for the copy and its checkpoint.
    """

    source: str
    file: str
    runs: tuple[tuple[tuple[str, ...], int, bool], ...]


TARGETS = {
    # An unreadable pointer names nothing: the run lists and plans as if it had none.
    "latest": Target(
        "native",
        "latest",
        ((("list", "{run}", "--json"), 0, False), (("resume-plan", "{run}", "--json"), 0, False)),
    ),
    "trainer_state": Target(
        "trainer",
        "checkpoint-4/trainer_state.json",
        ((("list", "{run}", "--json"), 0, False), (("verify", "{ckpt}", "--json"), 1, True)),
    ),
    "dcp_metadata": Target(
        "dcp",
        "step-30/.metadata",
        ((("inspect", "{ckpt}"), 2, True), (("verify", "{ckpt}", "--json"), 1, True)),
    ),
    # A side file that convert copies beside the model (issue 21.5: MemoryError before): nothing is written.
    # (The DCP source has no config: `--mapping none` writes its stored names, else it is refused for that.)
    "tokenizer": Target(
        "dcp",
        "tokenizer.json",
        ((("convert", "{ckpt}", "{run}/out", "--to", "hf", "--mapping", "none", "--json"), 2, True),),
    ),
}


@pytest.fixture(scope="session")
def special(tmp_path_factory: pytest.TempPathFactory, sources: dict[str, Source]) -> dict[tuple[str, str], Path]:
    """A copy of each target's run per kind, with the special file in place: (target, kind) -> run."""
    root = tmp_path_factory.mktemp("hostile-special")
    made = {}
    for name, target in {**TARGETS, "lock": Target("native", LOCK_NAME, ())}.items():
        for kind, make in KINDS.items():
            run = plant(sources[target.source], root / f"{name}-{kind}", target.file)
            make(run / target.file)
            made[name, kind] = run
    return made


RUNS = [(name, kind, run) for name, target in TARGETS.items() for kind in KINDS for run in target.runs]


@pytest.mark.parametrize(("name", "kind", "run"), RUNS, ids=[f"{name}-{kind}-{run[0][0]}" for name, kind, run in RUNS])
def test_a_special_file_ends_the_command_at_once(
    special: dict[tuple[str, str], Path],
    sources: dict[str, Source],
    name: str,
    kind: str,
    run: tuple[tuple[str, ...], int, bool],
) -> None:
    args, code, named = run
    target = TARGETS[name]
    folder = special[name, kind]
    checkpoint = folder / sources[target.source].checkpoint
    outcome = run_ckptctl([a.format(run=folder, ckpt=checkpoint) for a in args], timeout=30)
    outcome.assert_refused(code)
    if named:
        message = message_of(outcome)
        assert Path(target.file).name in message and SAID[kind] in message, message
    if args[0] == "convert":
        assert json.loads(outcome.stdout)["error"]["type"] == "CorruptCheckpoint"
        assert not (folder / "out").exists()
    if name == "latest" and args[0] == "list":
        assert not any(c["latest"] for c in json.loads(outcome.stdout)["checkpoints"])


#: The address space some schedulers grant a job (`ulimit -v`, RLIMIT_AS). Conversions import torch, whose import
#: alone needs 0.6 to 0.8 GiB of address space on the suite's machines (below ~0.6 GiB it aborts: "cannot allocate
#: memory for thread-local data"), so 1 GiB is the figure of the issue and still leaves room for the work.
ADDRESS_SPACE = 1 << 30


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_side_file_is_refused_under_an_address_space_limit(
    special: dict[tuple[str, str], Path], sources: dict[str, Source], kind: str
) -> None:
    """Issue 33: bounded reads allocated their whole cap first (`f.read(cap + 1)`: 1 GiB for DCP's `.metadata`),
    so under RLIMIT_AS = 1 GiB convert died with `internal error: MemoryError` before it reached the side file."""
    folder = special["tokenizer", kind]
    out = folder / "out-limited"
    args = ["convert", str(folder / sources["dcp"].checkpoint), str(out), "--to", "hf", "--mapping", "none", "--json"]
    outcome = run_with_address_space(args, ADDRESS_SPACE, timeout=30)
    outcome.assert_refused(2)
    message = message_of(outcome)
    assert "tokenizer.json" in message and SAID[kind] in message, message
    assert not out.exists()


def test_conversions_and_their_verify_run_under_an_address_space_limit(
    sources: dict[str, Source], tmp_path: Path
) -> None:
    """The same conversions, of whole checkpoints (an HF model folder to DCP, a DCP step to HF), and `verify` of
    what they wrote, all under RLIMIT_AS = 1 GiB."""
    for source, to in (("hf", "dcp"), ("dcp", "hf")):
        out = tmp_path / f"{source}-to-{to}"
        src = sources[source].run / sources[source].checkpoint
        raw = ("--mapping", "none") if to == "hf" else ()  # the DCP source keeps no config: its stored names
        converted = run_with_address_space(["convert", str(src), str(out), "--to", to, *raw, "--json"], ADDRESS_SPACE)
        assert converted.returncode == 0, converted.stderr
        assert json.loads(converted.stdout)["tensors"] > 0
        verified = run_with_address_space(["verify", str(out), "--json"], ADDRESS_SPACE)
        assert verified.returncode == 0 and json.loads(verified.stdout)["ok"], verified.stdout + verified.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_file_as_the_prune_lock(special: dict[tuple[str, str], Path], kind: str) -> None:
    """No lock of ours: a FIFO or a device is refused at once (exit 2); a regular file that is not one of our
    locks is another tool's lock, held (exit 1) until it goes stale."""
    run = special["lock", kind]
    outcome = run_ckptctl(["prune", str(run), "--keep-last", "1", "--yes", "--wait", "0"], timeout=30)
    outcome.assert_refused(1 if kind == "sparse-4GiB" else 2)
    assert LOCK_NAME in outcome.stderr
    if kind != "sparse-4GiB":
        assert SAID[kind] in outcome.stderr
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == ["step-10", "step-20", "step-30"]
