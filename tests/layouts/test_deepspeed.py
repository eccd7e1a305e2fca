"""The DeepSpeed layout on save folders written by DeepSpeed itself (2 CPU ranks, bf16, ZeRO-2 and ZeRO-3)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptctl import io
from ckptctl.checkpoint import CheckpointState, Component, ProblemKind
from ckptctl.families.zero_tag.names import tag_files
from ckptctl.formats.chunks import read_tensor
from ckptctl.formats.safe_pickle import state_fields
from ckptctl.formats.torch_pickle import open_torch_pickle
from ckptctl.frameworks.deepspeed.layout import DeepSpeedLayout
from ckptctl.layouts import detect, scan_run
from ckptctl.ops.verification import verify_checkpoint, verify_run
from tests.conftest import CliResult, copy_tree
from tests.writers.deepspeed_writer import WrittenDeepSpeed

LAYOUT = DeepSpeedLayout()
Cli = Callable[..., CliResult]


class Payload:
    """Pickles as `func(*args)`: what a malicious checkpoint carries."""

    def __init__(self, func: object, *args: object) -> None:
        self.func = func
        self.args = args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


@pytest.fixture(params=[0, 2, 3], ids=["zero0", "zero2", "zero3"])
def run(request: pytest.FixtureRequest, deepspeed_runs: dict[int, WrittenDeepSpeed]) -> WrittenDeepSpeed:
    return deepspeed_runs[request.param]


def _needs_zero(run: WrittenDeepSpeed) -> None:
    if run.zero_stage == 0:
        pytest.skip("without ZeRO there are no optim states files")


@pytest.fixture
def run_copy(run: WrittenDeepSpeed, tmp_path: Path) -> Path:
    """A private copy of the save folder (latest + both tags) that a test may damage."""
    return copy_tree(run.save_dir, tmp_path / "run")


def _kinds(url: Path) -> list[tuple[str, str]]:
    return [(p.kind, p.path) for p in LAYOUT.verify(LAYOUT.open(str(url))) if p.severity == "error"]


def test_list_finds_both_tags_and_the_latest(run: WrittenDeepSpeed) -> None:
    refs = sorted(scan_run(str(run.save_dir)), key=lambda r: r.step or 0)
    assert [(io.name_of(r.url), r.layout, r.step, r.state, r.latest) for r in refs] == [
        ("global_step2", "deepspeed", 2, CheckpointState.COMPLETE, False),
        ("global_step4", "deepspeed", 4, CheckpointState.COMPLETE, True),
    ]
    assert refs[1].size_bytes == sum(p.stat().st_size for p in run.latest.iterdir())


def test_open_reports_stage_world_size_and_progress(run: WrittenDeepSpeed) -> None:
    checkpoint = LAYOUT.open(str(run.latest))
    meta = checkpoint.metadata
    assert checkpoint.ref.step == 4 and checkpoint.ref.latest
    assert checkpoint.world_size == run.world_size
    partitions = None if run.zero_stage == 0 else 2
    assert (meta["zero_stage"], meta["dp_world_size"], meta["partition_count"]) == (run.zero_stage, 2, partitions)
    assert meta["precision"] == "bf16"
    assert meta["progress"] == {"global_steps": 4, "global_samples": 16, "skipped_steps": 0, **run.client_state}
    assert checkpoint.components == {
        Component.MODEL,
        Component.OPTIMIZER,
        Component.SCHEDULER,
        Component.TRAINER_STATE,
        Component.EXTRA,
    }
    assert Component.RNG in checkpoint.missing_components  # DeepSpeed saves no RNG state


def test_model_index_reads_what_zero_to_fp32_reconstructs(run: WrittenDeepSpeed) -> None:
    reference = run.reference_tensors()
    checkpoint = LAYOUT.open(str(run.latest))
    model = {e.name: e for e in checkpoint.tensors(Component.MODEL)}
    assert set(model) == set(reference)
    assert sum(e.numel for e in model.values()) == run.model_parameters
    for name, entry in model.items():
        tensor = read_tensor(checkpoint.url, entry)
        # ZeRO 0-2: the bf16 module weights; ZeRO-3: the fp32 partitions (frozen ones: bf16 fragments).
        assert tensor.dtype == getattr(torch, entry.dtype)
        assert torch.equal(tensor, reference[name].to(tensor.dtype)), name
    if run.zero_stage == 3:
        assert {e.dtype for n, e in model.items() if n not in run.frozen} == {"float32"}
        assert all(len(e.chunks) >= 2 for e in model.values())  # pieces from both ranks
    else:
        assert {e.dtype for e in model.values()} == {"bfloat16"}
        assert all(len(e.chunks) == 1 for e in model.values())
        fp32 = {e.name.removeprefix("optimizer.fp32."): e for e in checkpoint.tensors() if "fp32." in e.name}
        for name, entry in fp32.items():
            assert torch.equal(read_tensor(checkpoint.url, entry), reference[name]), name


def test_optimizer_state_is_unflattened_per_parameter(run: WrittenDeepSpeed) -> None:
    checkpoint = LAYOUT.open(str(run.latest))
    optimizer = {e.name: e for e in checkpoint.tensors(Component.OPTIMIZER)}
    if run.zero_stage == 0:  # the optimizer's own state dict, inside the model states, as stored
        saved = torch.load(next(run.latest.glob("*model_states.pt")), map_location="cpu", weights_only=False)
        exp_avg = saved["optimizer"]["optimizer_state_dict"]["state"][0]["exp_avg"]
        assert torch.equal(
            read_tensor(checkpoint.url, optimizer["optimizer.optimizer_state_dict.state.0.exp_avg"]), exp_avg
        )
        return
    trainable = [n for n in run.reference_tensors() if n not in run.frozen]
    for name in trainable:
        for key in ("exp_avg", "exp_avg_sq"):
            entry = optimizer[f"optimizer.state.{name}.{key}"]
            assert entry.shape == run.reference_tensors()[name].shape
    assert "optimizer.state.group0.step" in optimizer
    if run.zero_stage != 2:
        return
    # ZeRO-2 records where each rank's fragment of each parameter lies in its flat partition
    # (`param_slice_mappings`): an account of the layout independent of the one computed from param_shapes.
    for path in sorted(run.latest.glob("*optim_states.pt")):
        opened = open_torch_pickle(str(path))
        state = opened.root["optimizer_state_dict"]
        found = opened.byte_range(state["base_optimizer_state"]["state"][0]["exp_avg"])
        assert found is not None
        for name, fragment in state["param_slice_mappings"][0].items():
            where = state_fields(fragment, name)
            chunks = [c for c in optimizer[f"optimizer.state.{name}.exp_avg"].chunks if c.file == path.name]
            assert sum(c.numel for c in chunks) == where["numel"], name
            assert chunks[0].byte_offset == found[0] + 4 * where["start"], name


def test_open_index_and_verify_read_little_and_need_no_deepspeed(run: WrittenDeepSpeed) -> None:
    # A fresh process in which importing deepspeed, transformers, accelerate, numpy or torch fails.
    code = (
        "import sys\n"
        "for m in ('torch', 'deepspeed', 'transformers', 'accelerate', 'numpy'): sys.modules[m] = None\n"
        "from ckptctl import io\n"
        "from ckptctl.frameworks.deepspeed.layout import DeepSpeedLayout\n"
        f"checkpoint = DeepSpeedLayout().open({str(run.latest)!r})\n"
        "entries = checkpoint.tensor_index()\n"
        "inspect_bytes = io.READ_STATS.bytes_read\n"
        "problems = DeepSpeedLayout().verify(checkpoint)\n"
        "print(inspect_bytes, len(entries), len(problems))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    inspect_bytes, entries, problems = map(int, out.stdout.split())
    size = sum(p.stat().st_size for p in run.latest.iterdir())
    assert entries > 0 and problems == 0
    # The zip directories and data.pkl of the rank files, never the tensor records (the data.pkl files
    # of a model this small are a sizeable part of it; the report gives the figure for a larger one).
    assert inspect_bytes < size // 4


def test_verify_run_is_ok(run: WrittenDeepSpeed) -> None:
    report = verify_run(str(run.save_dir))
    assert report.ok and len(report.results) == 2


def test_missing_optim_rank_file(run: WrittenDeepSpeed, run_copy: Path) -> None:
    _needs_zero(run)
    tag = run_copy / "global_step4"
    last = sorted(tag.glob("*optim_states.pt"))[-1]
    last.unlink()
    # Under ZeRO-2 the names cannot tell that the highest rank is missing: the dp_world_size the rank-0
    # model states record does (issue 12: a tag missing a rank file is never complete); under ZeRO-3 the
    # per-rank model states show it too.
    assert detect(str(tag))[1].state is CheckpointState.BROKEN
    assert _kinds(tag) == [(ProblemKind.MISSING_FILE, last.name)]
    assert not verify_checkpoint(str(tag)).ok


def test_missing_rank_0_file_is_broken_in_list(run: WrittenDeepSpeed, run_copy: Path) -> None:
    _needs_zero(run)
    tag = run_copy / "global_step4"
    first = sorted(tag.glob("*optim_states.pt"))[0]
    first.unlink()
    refs = {io.name_of(r.url): r for r in scan_run(str(run_copy))}
    assert refs["global_step4"].state is CheckpointState.BROKEN
    assert first.name in refs["global_step4"].note
    assert refs["global_step2"].state is CheckpointState.COMPLETE


def test_zero3_model_states_of_every_rank_are_required(
    deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path: Path
) -> None:
    tag = copy_tree(deepspeed_runs[3].latest, tmp_path / "global_step4")
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    assert detect(str(tag))[1].state is CheckpointState.BROKEN
    assert (ProblemKind.MISSING_FILE, "zero_pp_rank_1_mp_rank_00_model_states.pt") in _kinds(tag)


def test_truncated_model_states(run_copy: Path) -> None:
    tag = run_copy / "global_step4"
    victim = next(tag.glob("*model_states.pt"))
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size * 2 // 3])
    result = verify_checkpoint(str(tag))
    assert not result.ok
    assert [(p.kind, p.path) for p in result.problems] == [(ProblemKind.TRUNCATED, victim.name)]


def test_truncated_optim_states_keep_their_directory_but_lose_data(run: WrittenDeepSpeed, run_copy: Path) -> None:
    _needs_zero(run)
    # Cutting out the middle keeps the zip directory at the end: the records it points at are now
    # past the end of the file, which verify finds from the local headers.
    tag = run_copy / "global_step4"
    victim = sorted(tag.glob("*optim_states.pt"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[:1000] + data[-3000:])
    assert ProblemKind.TRUNCATED in {kind for kind, _ in _kinds(tag)}


def test_latest_naming_a_missing_tag(run_copy: Path, run_cli: Cli) -> None:
    (run_copy / "latest").write_text("global_step99")
    refs = scan_run(str(run_copy))
    assert not any(r.latest for r in refs)
    problems = LAYOUT.verify(LAYOUT.open(str(run_copy / "global_step4")))
    assert [(p.kind, p.path) for p in problems] == [(ProblemKind.MISSING_FILE, "../latest")]
    assert "global_step99" in problems[0].message
    result = run_cli("verify", run_copy, "--json")
    assert result.exit_code == 1 and not result.json["ok"]


def test_hostile_model_states_are_refused_and_nothing_runs(run_copy: Path, tmp_path: Path, run_cli: Cli) -> None:
    marker = tmp_path / "pwned"
    tag = run_copy / "global_step4"
    victim = next(tag.glob("*model_states.pt"))
    # A real model states dict with a payload among its client state, written by torch.save.
    states = torch.load(victim, map_location="cpu", weights_only=False)
    states["client_note"] = Payload(os.system, f"touch {marker}")
    torch.save(states, victim)
    result = run_cli("verify", tag, "--json")
    assert result.exit_code == 1
    assert "Traceback" not in result.stderr
    [problem] = [p for p in result.json["problems"] if p["severity"] == "error"]
    assert problem["kind"] == "unsafe_pickle" and "posix.system" in problem["message"]
    inspected = run_cli("inspect", tag)
    assert inspected.exit_code == 2 and "posix.system" in inspected.stderr and "Traceback" not in inspected.stderr
    assert not marker.exists()


def test_extra_rank_files_are_warnings(deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path: Path) -> None:
    tag = copy_tree(deepspeed_runs[2].latest, tmp_path / "global_step4")
    rank1 = next(tag.glob("*zero_pp_rank_1_*optim_states.pt"))
    shutil.copy(rank1, tag / rank1.name.replace("rank_1_", "rank_2_"))  # left by an earlier 3-rank save
    problems = LAYOUT.verify(LAYOUT.open(str(tag)))
    assert [(p.kind, p.severity) for p in problems] == [(ProblemKind.UNEXPECTED_FILE, "warning")]


def test_identify_reads_nothing(tmp_path: Path) -> None:
    for name in ("mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (tmp_path / name).write_bytes(b"identify never reads these")
    before = io.READ_STATS.bytes_read
    ref = LAYOUT.identify(str(tmp_path), io.list_dir(str(tmp_path)))
    assert ref is not None and ref.state is CheckpointState.COMPLETE
    # Only the rank-0 model states are read (for the world size they record: issue 12); never an optim file.
    assert io.READ_STATS.bytes_read - before <= (tmp_path / "mp_rank_00_model_states.pt").stat().st_size
    files = tag_files(io.list_dir(str(tmp_path)))
    assert files is not None and files.bf16 and not files.per_dp_model_files
