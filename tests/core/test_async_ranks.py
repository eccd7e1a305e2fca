"""Async multi-rank saves: 2 gloo ranks with FSDP2 (`_workers._async_saves`, in the session's `fsdp_run`).

Each rank copies its shards to host memory in `save` and writes them on a thread of its own; rank 0 commits
once both have written. The same spawn also makes rank 1's write fail, then kills rank 1 mid-write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from ckptctl.core import CheckpointManager
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import read_manifest
from ckptctl.ops.listing import list_run
from ckptctl.ops.verification import verify_run
from tests.core import _workers
from tests.core.util import assert_same

pytestmark = pytest.mark.slow


def report(fsdp_run: Path, rank: int) -> dict[str, Any]:
    return torch.load(fsdp_run / f"async-report-{rank}.pt", weights_only=True)


def test_async_save_returns_before_the_commit_and_holds_the_state_at_save(fsdp_run: Path) -> None:
    for rank in (0, 1):
        # save() returned before anything was committed; the loop trained a step before the write began
        assert report(fsdp_run, rank)["committed_while_writing"] == []
        assert report(fsdp_run, rank)["committed"] == [3]
    model = _workers._fsdp_model(seed=42)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    sampler = _workers.ResumableSampler(16, seed=42)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
    assert CheckpointManager(fsdp_run / "async").restore(state) == 3
    expected = torch.load(fsdp_run / "expected.pt", weights_only=True)  # the state the sync save wrote
    assert_same(expected["model"], dict(model.state_dict()), "model")
    assert_same(expected["optimizer"], get_optimizer_state_dict(model, optimizer), "optimizer")
    assert_same(expected["scheduler"], scheduler.state_dict(), "scheduler")
    assert_same(expected["sampler"], sampler.state_dict(), "sampler")


def test_async_save_writes_the_files_of_a_sync_save(fsdp_run: Path) -> None:
    sync, done = read_manifest(str(fsdp_run / "run" / "step-3")), read_manifest(str(fsdp_run / "async" / "step-3"))
    assert sync is not None and done is not None
    assert done.world_size == 2 and done.metrics == {"loss": 0.25} and set(done.files) == set(sync.files)
    assert done.components == sync.components
    for rel, record in done.files.items():  # every rank hashed its own files, as in a sync save
        assert file_digest(str(fsdp_run / "async" / "step-3" / rel)) == record.blake3, rel
        if rel.endswith(".distcp"):
            assert record.size == sync.files[rel].size, rel


def test_a_rank_failing_in_the_background_fails_the_next_save_on_every_rank(fsdp_run: Path) -> None:
    for rank in (0, 1):
        assert report(fsdp_run, rank)["next_save"].startswith("StorageError: saving step 4")
        assert "No space left on device" in report(fsdp_run, rank)["next_save"]
    assert report(fsdp_run, 0)["after_failure"] == ["latest", "step-3"]  # nothing of step 4 is left


def test_a_rank_killed_mid_write_commits_nothing(fsdp_run: Path) -> None:
    run = fsdp_run / "async"
    assert report(fsdp_run, 0)["wait_after_kill"].startswith("StorageError: saving step 6 failed: lost contact")
    manager = CheckpointManager(run)
    assert manager.all_steps() == [3] and manager.latest_step() == 3 and manager.pointer() == "step-3"
    listed = list_run(str(run))
    assert [(c.step, c.state) for c in listed.checkpoints] == [(3, "complete")]
    verified = verify_run(str(run))
    assert verified.ok and [r.step for r in verified.results] == [3]
