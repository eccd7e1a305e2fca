"""Hostile pickles planted into real checkpoints: `inspect` and `verify` refuse them in bounded memory.

Each case copies a checkpoint written by its framework (torch DCP, DeepSpeed, the HF Trainer, AReaL), replaces
ONE pickle in it with a hostile one from `pickle_payloads`, and runs the real `ckptctl` in a child process
(`harness.run_ckptctl`): no crash (the deep payloads overflowed the C stack before), no traceback or
"internal error", peak RSS under 512 MiB, no hang, and nothing the pickle names ever ran.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import copy_tree
from tests.hostile.harness import Outcome, run_ckptctl
from tests.hostile.pickle_payloads import PAYLOADS, plant
from tests.writers.dcp_writer import WrittenDcp
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.rl_runs import WrittenFsdpRuns
from tests.writers.trainer_writer import WrittenTrainerRun

#: Problem kinds a refused pickle may be reported under (the pickle names a global it may not, or does
#: not parse into what the file must hold).
REFUSED_KINDS = {"unsafe_pickle", "bad_metadata", "coverage"}


@pytest.fixture(scope="session")
def hostile_pickles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every payload written once per session, plus `deep_key_then_system`: a million-deep tuple key
    followed by `os.system("touch <marker>")`, whose marker must never appear."""
    root = tmp_path_factory.mktemp("hostile-pickles")
    written = {}
    for name, build in PAYLOADS.items():
        written[name] = root / f"{name}.pkl"
        written[name].write_bytes(build())
    marker = root / "pwned"
    command = f"touch {marker}".encode()
    deep_key = PAYLOADS["deep_tuple_key"]()[:-1]  # without STOP: the system call follows the dict
    call = b"\x8c\x05posix\x8c\x06system\x93" + b"\x8c" + bytes([len(command)]) + command + b"\x85R"
    written["deep_key_then_system"] = root / "deep_key_then_system.pkl"
    written["deep_key_then_system"].write_bytes(deep_key + b"0" + call + b".")
    written["marker"] = marker
    return written


@pytest.fixture(scope="session")
def dcp_checkpoint(raw_dcp: WrittenDcp) -> WrittenDcp:
    """The session's single-process DCP save (each case works on a copy)."""
    return raw_dcp


# (checkpoint to run the commands on, pickle to replace): relative to a private copy of the source folder.
Target = tuple[Path, Path]


def _dcp(written: WrittenDcp, work: Path) -> Target:
    ckpt = copy_tree(written.path, work / "step-1")
    return ckpt, ckpt / ".metadata"


def _deepspeed(name: str) -> Callable[[WrittenDeepSpeed, Path], Target]:
    def target(written: WrittenDeepSpeed, work: Path) -> Target:
        save_dir = copy_tree(written.save_dir, work / "save")
        tag = save_dir / written.tags[-1]
        return tag, tag / name

    return target


def _trainer(name: str) -> Callable[[WrittenTrainerRun, Path], Target]:
    def target(written: WrittenTrainerRun, work: Path) -> Target:
        ckpt = copy_tree(written.checkpoints[-1], work / written.checkpoints[-1].name)
        return ckpt, ckpt / name

    return target


def _areal(written: WrittenFsdpRuns, work: Path) -> Target:
    trial = copy_tree(written.areal_trial, work / "trial")
    return trial / "default" / "recover_checkpoint", trial / "recover_info" / "dataloader_info.pkl"


#: file → (session fixture with its checkpoint, how to copy it and find the pickle, whether `inspect` reads
#: that pickle). `inspect` reads only what it shows: RNG states, training arguments and data loader states
#: are read by `verify`, so `inspect` may succeed without touching them.
FILES: dict[str, tuple[str, Callable[..., Target], bool]] = {
    "dcp/.metadata": ("dcp_checkpoint", _dcp, True),
    "deepspeed/model_states": ("deepspeed_runs", _deepspeed("mp_rank_00_model_states.pt"), True),
    "deepspeed/optim_states": ("deepspeed_runs", _deepspeed("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"), True),
    "trainer/optimizer.pt": ("trainer_run", _trainer("optimizer.pt"), True),
    "trainer/rng_state.pth": ("trainer_run", _trainer("rng_state.pth"), False),
    "trainer/training_args.bin": ("trainer_run", _trainer("training_args.bin"), False),
    "areal/dataloader_info.pkl": ("fsdp_runs", _areal, False),
}


def _plant(request: pytest.FixtureRequest, file: str, payload: Path, work: Path) -> tuple[Path, Path, bool]:
    fixture, target, inspect_reads = FILES[file]
    written = request.getfixturevalue(fixture)
    if fixture == "deepspeed_runs":
        written = written[2]
    ckpt, pickled = target(written, work)
    assert pickled.is_file(), pickled
    plant(pickled, payload.read_bytes())
    return ckpt, pickled, inspect_reads


def _assert_verify_refuses(ckpt: Path, pickled: Path) -> Outcome:
    outcome = run_ckptctl(["verify", "--json", str(ckpt)])
    outcome.assert_refused(1)
    report = json.loads(outcome.stdout)
    assert report["ok"] is False
    errors = [p for p in report["problems"] if p.get("severity", "error") == "error"]
    assert errors and {p["kind"] for p in errors} <= REFUSED_KINDS | {"truncated"}, report
    return outcome


def _assert_inspect_refuses(ckpt: Path, inspect_reads: bool) -> None:
    outcome = run_ckptctl(["inspect", str(ckpt)])
    if inspect_reads:
        outcome.assert_refused(2)
        assert outcome.stderr.strip().startswith("error:") or "error" in outcome.stderr, outcome.stderr
    else:
        outcome.assert_refused(0, 2)


@pytest.mark.parametrize("file", list(FILES))
def test_a_deep_tuple_key_with_a_payload_is_refused_in_every_pickle(
    file: str, hostile_pickles: dict[str, Path], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # The million-deep key made the C unpickler overflow its stack (SIGSEGV) while hashing it; the system
    # call after it must be refused, not run.
    ckpt, pickled, inspect_reads = _plant(request, file, hostile_pickles["deep_key_then_system"], tmp_path)
    outcome = _assert_verify_refuses(ckpt, pickled)
    assert "unsafe_pickle" in {p["kind"] for p in json.loads(outcome.stdout)["problems"]}
    human = run_ckptctl(["verify", str(ckpt)])
    human.assert_refused(1)
    assert pickled.name in human.stdout + human.stderr
    _assert_inspect_refuses(ckpt, inspect_reads)
    assert not hostile_pickles["marker"].exists()


#: Files of `FILES` each payload is planted in: a reader of its own each (DCP metadata, a torch.save zip, a
#: bare pickle), whose parse sees what the unpickler built. The object flood is refused by the unpickler's
#: memory check as it reads, before any reader's parse (the same "unpickling took more than" message from
#: every reader): one file, the one where it peaks highest, proves it.
_PAYLOAD_FILES = ["dcp/.metadata", "trainer/optimizer.pt", "areal/dataloader_info.pkl"]
_EACH_PAYLOAD = [
    (file, payload)
    for payload in PAYLOADS
    if payload != "deep_tuple_key"
    for file in (_PAYLOAD_FILES[:1] if payload == "object_flood" else _PAYLOAD_FILES)
]


@pytest.mark.parametrize(("file", "payload"), _EACH_PAYLOAD)
def test_each_hostile_pickle_is_refused_in_bounded_memory(
    file: str, payload: str, hostile_pickles: dict[str, Path], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    ckpt, pickled, inspect_reads = _plant(request, file, hostile_pickles[payload], tmp_path)
    if file.startswith("areal/") and payload == "long_key_paths":
        # A data loader state is user data: a long key is odd but harmless once nothing copies it per path.
        run_ckptctl(["verify", "--json", str(ckpt)]).assert_refused(0, 1)
    else:
        _assert_verify_refuses(ckpt, pickled)
    if inspect_reads:  # (an inspect that never opens the file is run once, in the deep tuple key's test)
        _assert_inspect_refuses(ckpt, inspect_reads)


def test_the_plain_deep_tuple_key_is_refused_where_tensors_are_listed(
    hostile_pickles: dict[str, Path], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # Without a forbidden global, the pickle is well formed: what refuses it is the nesting of its key.
    ckpt, pickled, _ = _plant(request, "trainer/optimizer.pt", hostile_pickles["deep_tuple_key"], tmp_path)
    outcome = _assert_verify_refuses(ckpt, pickled)
    assert any("nest deeper" in p["message"] for p in json.loads(outcome.stdout)["problems"])
    _assert_inspect_refuses(ckpt, True)


def test_a_real_checkpoint_still_verifies(dcp_checkpoint: WrittenDcp, tmp_path: Path) -> None:
    # The same commands on the untouched copy: the bounds do not refuse what real writers write.
    ckpt = copy_tree(dcp_checkpoint.path, tmp_path / "step-1")
    assert run_ckptctl(["verify", str(ckpt)]).returncode == 0
    assert run_ckptctl(["inspect", "--json", str(ckpt)]).returncode == 0


def test_frames_larger_than_picklers_write_are_refused(dcp_checkpoint: WrittenDcp, tmp_path: Path) -> None:
    # The memory checks run between the unpickler's reads, and it reads a whole frame at once.
    ckpt = copy_tree(dcp_checkpoint.path, tmp_path / "step-1")
    body = b"(" + b"]" * (4 << 20) + b"l."
    (ckpt / ".metadata").write_bytes(b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body)
    outcome = run_ckptctl(["inspect", str(ckpt)])
    outcome.assert_refused(2)
    assert "frame" in outcome.stderr
    shutil.rmtree(ckpt)


#: The files of `FILES` that `test_a_hostile_pickle_in_a_whole_run` plants in, by name.
_FILE_NAMES = {"trainer/rng_state.pth": "rng_state.pth", "deepspeed/model_states": "mp_rank_00_model_states.pt"}


def _whole_run(file: str, request: pytest.FixtureRequest, work: Path) -> tuple[Path, Path]:
    """A copy of the whole run holding `file` (its newest checkpoint) and that checkpoint: resume-plan also
    reads the checkpoints it skips."""
    if file.startswith("trainer/"):
        written: WrittenTrainerRun = request.getfixturevalue("trainer_run")
        run = copy_tree(written.output_dir, work / "run")
        return run, run / written.checkpoints[-1].name
    deepspeed: WrittenDeepSpeed = request.getfixturevalue("deepspeed_runs")[2]
    run = copy_tree(deepspeed.save_dir, work / "run")
    return run, run / deepspeed.tags[-1]


@pytest.mark.parametrize(
    ("file", "payload"),
    [
        ("trainer/rng_state.pth", "deep_tuple_key"),  # resume-plan: RecursionError in str() of the key
        ("trainer/rng_state.pth", "long_key_paths"),  # resume-plan: the 16 MiB key in its warnings
        ("deepspeed/model_states", "repeated_large_encode"),  # 747 MiB: five reads of the file, 192 MiB each
    ],
)
def test_a_hostile_pickle_in_a_whole_run(
    file: str, payload: str, hostile_pickles: dict[str, Path], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    run, ckpt = _whole_run(file, request, tmp_path)
    pickled = ckpt / _FILE_NAMES[file]
    plant(pickled, hostile_pickles[payload].read_bytes())
    _assert_verify_refuses(ckpt, pickled)
    inspect = run_ckptctl(["inspect", str(ckpt), "--json"])
    if FILES[file][2]:
        inspect.assert_refused(2)
        assert pickled.name in json.loads(inspect.stdout)["error"]["message"]
    else:
        inspect.assert_refused(0)
    plan = run_ckptctl(["resume-plan", str(run), "--json"])
    plan.assert_refused(0)  # the step before it resumes; the hostile one is skipped, its file named
    doc = json.loads(plan.stdout)
    assert doc["checkpoint"]["url"] != str(ckpt)
    assert str(ckpt) in [s["url"] for s in doc["skipped"]], doc["skipped"]
    assert len(plan.stdout) + len(plan.stderr) < 100_000  # no 16 MiB key copied into a warning
