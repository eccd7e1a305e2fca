"""What a command writes into its staging folder is on disk before the commit makes it visible: every file the
digests record (the torch.save archives and copied files of `reshard`, which their writers do not sync) and
every folder holding them, so that a power cut after the rename cannot leave a complete-looking DST of short
files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptctl.ops import commit
from ckptctl.ops.commit import write_digests

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fd through /proc")


def test_write_digests_syncs_every_file_and_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    (out / "global_step2" / "zero" / "w").mkdir(parents=True)
    for rel in ("latest_universal", "global_step2/mp_rank_00_model_states.pt", "global_step2/zero/w/fp32.pt"):
        (out / rel).write_bytes(b"x" * 10)
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(commit.os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "fsync", recording_fsync)  # io.fsync_dir's
    write_digests(str(out), {})
    files = {str(p) for p in out.rglob("*") if p.is_file() and p.name != "ckptctl-digests.json"}
    folders = {str(p) for p in out.rglob("*") if p.is_dir()} | {str(out)}
    assert files <= set(synced), files - set(synced)
    assert folders <= set(synced), folders - set(synced)
    # the files before the digests that vouch for them, and the top folder after the digests
    last_file = max(synced.index(f) for f in files)
    assert last_file < synced.index(str(out / "ckptctl-digests.json"))
    assert synced[-1] == str(out)
