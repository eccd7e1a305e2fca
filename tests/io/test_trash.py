"""`io.trash`, the one delete routine: the manager's retention and `prune` delete the same way, so either
finishes what a crash of the other left; the trash folder goes once empty; object stores lose their
completion markers first."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptctl import io
from ckptctl.core import CheckpointManager, CheckpointWarning, RetentionPolicy
from ckptctl.io import trash
from ckptctl.layouts import scan_run
from ckptctl.ops.prune import prune
from ckptctl.ops.verification import verify_checkpoint
from tests.ops.test_prune import NO_GRACE, write_run


class Killed(BaseException):
    """Stands for SIGKILL: nothing below the point it is raised at runs."""


def kill_after_the_rename(monkeypatch: pytest.MonkeyPatch) -> None:
    def killed(*args: object) -> None:
        raise Killed

    monkeypatch.setattr(trash, "remove_entry", killed)


def leftovers(run: Path) -> list[str]:
    return sorted(p.name for p in (run / trash.TRASH_NAME).iterdir())


@pytest.mark.parametrize("crashed", ["prune", "retention"])
def test_a_crash_between_rename_and_delete_is_finished_by_either(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crashed: str
) -> None:
    run = write_run(tmp_path / "run", [1, 2, 3])
    kill_after_the_rename(monkeypatch)
    if crashed == "prune":
        with pytest.raises(Killed):
            prune(str(run), RetentionPolicy(keep_last=2), grace=NO_GRACE)
    else:  # the manager deletes on a background thread: its failure comes back as a warning
        manager = CheckpointManager(run, policy=RetentionPolicy(keep_last=3))
        manager.save(4, {"w": torch.ones(2)})
        with pytest.warns(CheckpointWarning, match="retention in .* failed"):
            manager.wait()
    monkeypatch.undo()
    (left,) = leftovers(run)
    assert left.startswith("step-1.")  # out of sight: no reader lists it
    assert "step-1" not in [io.name_of(r.url) for r in scan_run(str(run))]

    if crashed == "prune":  # the manager's next retention empties what prune left
        manager = CheckpointManager(run, policy=RetentionPolicy(keep_last=3))
        manager.save(4, {"w": torch.ones(2)})
        manager.wait()
    else:  # and prune empties what the manager's retention left
        report = prune(str(run), RetentionPolicy(keep_last=3), grace=NO_GRACE)
        assert report.trash_freed_bytes > 0 and not report.deleted
    assert not (run / trash.TRASH_NAME).exists()
    assert CheckpointManager(run).all_steps() == [2, 3, 4]
    for step in (2, 3, 4):
        assert verify_checkpoint(str(run / f"step-{step}")).ok


def test_the_trash_goes_once_empty_and_stays_while_it_holds_something(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [1, 2, 3])
    first, second = trash.retire(str(run / "step-1")), trash.retire(str(run / "step-2"))
    assert first.trash == second.trash == str(run / trash.TRASH_NAME) and len(leftovers(run)) == 2
    trash.purge(first)
    assert leftovers(run) == [os.path.basename(second.url)]  # another deletion is still using it
    trash.purge(second)
    assert sorted(os.listdir(run)) == ["latest", "step-3"]
    assert trash.empty(str(run / trash.TRASH_NAME)) == 0  # a missing trash is empty


def test_a_trash_removed_under_a_rename_is_made_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process empties and removes the trash between our mkdir and our rename."""
    run = write_run(tmp_path / "run", [1, 2])
    real_mkdir = os.mkdir
    calls = []

    def mkdir_then_lose_it(path: str, *args: object, dir_fd: int | None = None, **kwargs: object) -> None:
        real_mkdir(path, *args, dir_fd=dir_fd, **kwargs)  # type: ignore[arg-type]
        calls.append(path)
        if len(calls) == 1:
            os.rmdir(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", mkdir_then_lose_it)
    retired = trash.retire(str(run / "step-1"))
    monkeypatch.undo()
    assert len(calls) == 2 and os.path.isdir(retired.url)
    trash.purge(retired)
    assert sorted(os.listdir(run)) == ["latest", "step-2"]


def test_a_folder_that_cannot_be_renamed_loses_its_markers_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint that is another filesystem's mount point cannot be renamed into the trash."""
    run = write_run(tmp_path / "run", [1, 2])
    real_rename = os.rename

    def rename(src: str, dst: str, **dir_fds: int) -> None:
        if src.endswith("step-1"):
            raise OSError(errno.EXDEV, "Invalid cross-device link", src)
        real_rename(src, dst, **dir_fds)

    monkeypatch.setattr(os, "rename", rename)
    retired = trash.retire(str(run / "step-1"), lambda files: [["ckptctl-manifest.json"]])
    assert retired == trash.Retired(str(run / "step-1")) and not (run / "step-1" / "ckptctl-manifest.json").exists()
    assert [(r.step, r.state.value) for r in scan_run(str(run))] == [(1, "broken"), (2, "complete")]
    trash.purge(retired)
    assert sorted(os.listdir(run)) == ["latest", "step-2"]


@pytest.fixture
def store() -> Iterator[str]:
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/trash-test-{os.getpid()}"
    for rel in ("index.json", "a/meta.json", "a/x.bin", "b.bin", "shard-1.bin", "rng.json"):
        fs.pipe_file(f"{root}/ckpt/{rel}", rel.encode())
    yield f"memory://{root}"
    with contextlib.suppress(FileNotFoundError):
        fs.rm(root, recursive=True)


def test_object_stores_delete_marker_tiers_first(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    batches: list[list[str]] = []
    real = io.delete_files

    def delete_files(urls: list[str]) -> None:
        batches.append(sorted(io.relative_to(u, f"{store}/ckpt") for u in urls))
        real(urls)

    monkeypatch.setattr(io, "delete_files", delete_files)
    seen: list[dict[str, int]] = []

    def markers(files: dict[str, int]) -> list[list[str]]:
        seen.append(files)
        return [["index.json"], ["a/meta.json", "shard-1.bin", "not-there.json"]]

    retired = trash.retire(f"{store}/ckpt", markers)
    assert retired == trash.Retired(f"{store}/ckpt")
    assert seen == [
        {rel: len(rel) for rel in ("a/meta.json", "a/x.bin", "b.bin", "index.json", "rng.json", "shard-1.bin")}
    ]
    assert batches == [["index.json"], ["a/meta.json", "shard-1.bin"]]
    assert sorted(io.list_tree(f"{store}/ckpt")) == ["a/x.bin", "b.bin", "rng.json"]
    trash.purge(retired)
    assert not io.exists(f"{store}/ckpt")

    trash.delete_objects(store, [], [["x"]])  # nothing to delete is no request at all
    assert len(batches) == 2


def test_parts_of_a_folder_go_in_order_and_the_rest_stays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint whose folder also holds other checkpoints: only its own entries go, in the caller's
    order (markers first), through the trash."""
    run = write_run(tmp_path / "run", [1])
    (run / "model.safetensors").write_bytes(b"w" * 100)
    (run / "config.json").write_text("{}")
    moved: list[str] = []
    real_rename = os.rename
    monkeypatch.setattr(
        os, "rename", lambda a, b, **fds: (moved.append(os.path.basename(a)), real_rename(a, b, **fds))[1]
    )
    entries = {e.name: e for e in io.list_dir(str(run))}
    trash.delete_parts(str(run), [entries["config.json"], entries["model.safetensors"]])
    monkeypatch.undo()
    assert moved == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(run)) == ["latest", "step-1"] and verify_checkpoint(str(run / "step-1")).ok


def test_quarantine_records_are_read_and_a_fifo_in_place_of_one_is_no_record(tmp_path: Path) -> None:
    """A FIFO planted as a quarantine record used to block `repair --undo` in its open (issue 33): it reads as no
    record (left in quarantine, `repair --undo` says so), and a real record is read whole."""
    run = tmp_path / "run"
    for name in ("kept", "planted"):
        (run / name).mkdir(parents=True)
        trash.quarantine(str(run / name), str(run), b'{"origin": "%s"}' % name.encode())
    record = run / trash.TRASH_NAME / trash.QUARANTINE_NAME / f"planted{trash.RECORD_SUFFIX}"
    record.unlink()
    os.mkfifo(record)
    assert trash.quarantined(str(run)) == [("kept", b'{"origin": "kept"}'), ("planted", b"")]
