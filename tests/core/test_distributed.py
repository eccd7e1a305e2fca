"""Multi-rank saves through torch DCP: 2 gloo ranks with FSDP2, restored in 1 process and in 2 ranks."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from ckptctl.core import CheckpointManager, CheckpointWarning
from ckptctl.core import distributed as dist_
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import FileRecord, read_manifest
from tests.core import _workers
from tests.core.util import assert_same

pytestmark = pytest.mark.slow


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def test_layout_of_a_two_rank_save(fsdp_run: Path) -> None:
    step_dir = fsdp_run / "run" / "step-3"
    manifest = read_manifest(str(step_dir))
    assert manifest is not None and manifest.native
    assert manifest.world_size == 2 and manifest.step == 3 and manifest.metrics == {"loss": 0.25}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {p.name for p in (step_dir / "dcp").iterdir()}
    assert manifest.components["model"].storage == "dcp" and manifest.components["optimizer"].storage == "dcp"
    assert manifest.components["scheduler"].storage == "safetensors"
    assert set(manifest.components["rng"].files) == {
        f"rng.rank-{r}.{ext}" for r in (0, 1) for ext in ("json", "safetensors")
    }
    on_disk = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()} - {"ckptctl-manifest.json"}
    assert set(manifest.files) == on_disk
    for rel, record in manifest.files.items():  # each rank hashed its own files; rank 0 the metadata
        assert file_digest(str(step_dir / rel)) == record.blake3, rel
    assert (fsdp_run / "run" / "latest").read_text() == "step-3\n"
    assert not [p for p in (fsdp_run / "run").iterdir() if ".staging-" in p.name]


def test_two_rank_save_restores_in_a_single_process(fsdp_run: Path) -> None:
    expected = load(fsdp_run / "expected.pt")
    model = _workers._fsdp_model(seed=42)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    sampler = _workers.ResumableSampler(16, seed=42)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        assert CheckpointManager(fsdp_run / "run").restore(state) == 3
    after = _workers.draws()  # a single process takes rank 0's generators

    assert_same(expected["model"], dict(model.state_dict()), "model")
    assert_same(expected["optimizer"], get_optimizer_state_dict(model, optimizer), "optimizer")
    assert_same(expected["scheduler"], scheduler.state_dict(), "scheduler")
    assert_same(expected["sampler"], sampler.state_dict(), "sampler")
    assert_same(load(fsdp_run / "draws-save-0.pt"), after, "draws")


@pytest.mark.parametrize("run", ["run", "single"])
def test_restores_in_two_fresh_ranks(fsdp_run: Path, run: str) -> None:
    """`run`: the 2-rank DCP save. `single`: a single-process save of the same state (full tensors,
    optimizer keyed by index) that FSDP2 ranks shard on load."""
    expected = load(fsdp_run / "expected.pt")
    restored = load(fsdp_run / f"restored-{run}.pt")
    for key in ("model", "optimizer", "scheduler", "sampler"):
        assert_same(expected[key], restored[key], key)
    for rank in (0, 1):
        # each rank continues its own random stream; a single-process save has only one to give
        source = f"draws-save-{rank if run == 'run' else 0}.pt"
        assert_same(load(fsdp_run / source), load(fsdp_run / f"draws-restore-{run}-{rank}.pt"), f"rank {rank} draws")


def test_ranks_draw_different_numbers(fsdp_run: Path) -> None:
    # guards the test above against a trivial pass: the two ranks' generators really differ
    assert not torch.equal(load(fsdp_run / "draws-save-0.pt")["torch"], load(fsdp_run / "draws-save-1.pt")["torch"])


def test_rank_files_are_plain_json(fsdp_run: Path) -> None:
    doc = json.loads((fsdp_run / "run" / "step-3" / "rng.rank-1.json").read_text())
    assert set(doc["tree"]) == {"python", "numpy", "torch"}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_save_dcp_records_every_file_it_writes_as_written(tmp_path: Path) -> None:
    # In one process (no group): the records are taken from the bytes torch wrote, no file is read back.
    folder = tmp_path / "dcp"
    state = {"model": {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.ones(3)}, "counter": 7}
    records = dist_.save_dcp(str(folder), state)
    assert set(records) == {p.name for p in folder.iterdir()} == {"__0_0.distcp", ".metadata"}
    for name, record in records.items():
        assert record == FileRecord((folder / name).stat().st_size, file_digest(str(folder / name))), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_items_are_read_straight_into_the_state_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A whole stored chunk whose target is a contiguous host tensor of its dtype and shape is read into that
    # tensor's memory (no torch.load, no second copy); any other target goes through torch's path. Both exact.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    saved = {
        "w": torch.randn(64, 32),
        "half": torch.randn(8, 4).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "t": torch.randn(6, 5),
        "n": 7,
    }
    folder = str(tmp_path / "dcp")
    dist_.save_dcp(folder, saved)
    state: dict[str, Any] = {
        "w": torch.zeros(64, 32),
        "half": torch.zeros(8, 4, dtype=torch.bfloat16),
        "scalar": torch.tensor(0.0),
        "empty": torch.ones(0, 3),
        "t": torch.zeros(5, 6).t(),  # not contiguous: torch's path
        "n": 0,
    }
    memory = {key: value.data_ptr() for key, value in state.items() if isinstance(value, torch.Tensor)}
    loads: list[object] = []
    real_load = torch.load

    def counted_load(*args: Any, **kwargs: Any) -> Any:
        loads.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counted_load)
    dcp.load(state, storage_reader=dist_._safe_reader(folder), planner=dist_._safe_planner(folder), no_dist=True)
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert state[key].dtype == value.dtype and torch.equal(state[key], value), key
            assert state[key].data_ptr() == memory[key], key  # loaded in place
    assert state["n"] == 7
    assert len(loads) == 1  # the transposed target's item only

    # A damaged item (the zip directory at the data file's end: its last item's) is left to torch, which fails.
    data = Path(folder, "__0_0.distcp")
    data.write_bytes(data.read_bytes()[:-22] + bytes(22))
    loads.clear()
    with pytest.raises(CheckpointException, match="central directory"):  # torch's words (a BaseException)
        dcp.load(state, storage_reader=dist_._safe_reader(folder), planner=dist_._safe_planner(folder), no_dist=True)
    assert loads


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_model_whose_every_item_is_read_straight_in_restores_and_autograd_sees_the_change(tmp_path: Path) -> None:
    # Nothing left for torch's own reader (a model-only state of contiguous host tensors): the load still
    # completes, exact, and each restored parameter counts as changed in place, as a copy_ would make it.
    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    folder = str(tmp_path / "dcp")
    dist_.save_dcp(folder, dist_.dcp_state({"model": ("module", saved)}, {"model": saved}))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    versions = [p._version for p in model.parameters()]
    dist_.load_dcp(folder, {"model": ("module", model)}, {"model": model})
    for (name, want), got in zip(saved.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    assert all(p._version > v for p, v in zip(model.parameters(), versions, strict=True))


def test_one_rank_fsdp2_group_saves_and_restores(tmp_path: Path, run_cli: Any) -> None:
    """FSDP2 on one GPU: a process group of one whose parameters are DTensors. Its saves go through DCP and
    restore exactly (sync and async), and a single-process save (what ckptctl wrote for one rank before)
    restores into it; `load_state_dict` of plain tensors into DTensors would fail."""
    from tests.writers.ranks import run_ranks

    model = _workers._fsdp_model(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))  # as `_fsdp_state`'s
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    scheduler.step()
    CheckpointManager(tmp_path / "single").save(1, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    run_ranks(_workers.fsdp_one_rank, (str(tmp_path),), 1)

    for step in (1, 2):
        saved, restored = load(tmp_path / f"saved-{step}.pt"), load(tmp_path / f"restored-{step}.pt")
        assert saved["optimizer"]["state"], "the optimizer had state to restore"
        for key in ("model", "optimizer", "scheduler", "sampler"):
            assert_same(saved[key], restored[key], f"step {step} {key}")
        step_dir = tmp_path / "run" / f"step-{step}"
        manifest = read_manifest(str(step_dir))
        assert manifest is not None and manifest.world_size == 1
        assert manifest.components["model"].storage == "dcp" and manifest.components["optimizer"].storage == "dcp"
        verified = run_cli("verify", step_dir, "--deep", "--json")
        assert verified.exit_code == 0 and verified.json["ok"], verified.stdout
    assert not torch.equal(
        load(tmp_path / "saved-1.pt")["model"]["0.weight"], load(tmp_path / "saved-2.pt")["model"]["0.weight"]
    )

    single = load(tmp_path / "restored-single.pt")
    assert_same(dict(model.state_dict()), single["model"], "single model")
    assert_same(get_optimizer_state_dict(model, optimizer), single["optimizer"], "single optimizer")
    assert_same(scheduler.state_dict(), single["scheduler"], "single scheduler")
