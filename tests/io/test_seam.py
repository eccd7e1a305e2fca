"""The storage questions commands ask `io` instead of asking whether a path is local: where a folder is
(`absolute`, `inside`, `same_file`), what may be done there (`lexists`, `writable`, `make_folder`, `fsync_dir`,
`trash.present`), and a lock file's four operations (`io.lockfile`), each on a local folder and on an fsspec
store (`memory://`)."""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from ckptctl import io
from ckptctl.errors import UnsafePath
from ckptctl.io import lockfile, trash


@pytest.fixture(params=["local", "fsspec"])
def folder(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path)
        return
    base = f"/seam-{os.getpid()}-{id(request)}"
    yield f"memory://{base}"
    with contextlib.suppress(FileNotFoundError):
        fsspec.filesystem("memory").rm(base, recursive=True)


def test_where_a_folder_is(tmp_path: Path) -> None:
    (tmp_path / "run" / "step-1").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(tmp_path / "run")
    (tmp_path / "run" / "f").write_bytes(b"x")
    os.link(tmp_path / "run" / "f", tmp_path / "hard")

    assert io.absolute(f"file://{tmp_path}/run/") == str(tmp_path / "run")
    assert io.absolute("s3://bucket/run/") == "s3://bucket/run"
    assert io.inside(str(tmp_path / "alias" / "step-1"), str(tmp_path / "run"))  # one place, two spellings
    assert io.inside(str(tmp_path / "run"), str(tmp_path / "run"))
    assert not io.inside(str(tmp_path / "runner"), str(tmp_path / "run"))
    assert io.inside("s3://b/run/step-1", "s3://b/run/")
    assert not io.inside("s3://b/runner", "s3://b/run")
    assert not io.inside(str(tmp_path / "run"), "s3://b" + str(tmp_path))  # never across stores
    assert io.same_file(str(tmp_path / "hard"), str(tmp_path / "alias" / "f"))
    assert not io.same_file("memory://a/f", "memory://b/f")


def test_what_may_be_done_there(folder: str) -> None:
    sub = io.join(folder, "a", "b")
    io.make_folder(sub)
    io.write_bytes_atomic(io.join(sub, "f"), b"data")
    io.fsync_dir(sub)  # a no-op on the store, which has no folders
    assert io.lexists(io.join(sub, "f")) and not io.lexists(io.join(sub, "g"))
    assert io.writable(sub)
    bin_ = io.join(folder, trash.TRASH_NAME)
    assert not trash.present(bin_)
    io.make_folder(bin_)
    io.write_bytes_atomic(io.join(bin_, "left-over"), b"")
    assert trash.present(bin_)


def test_a_link_where_the_trash_goes_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / trash.TRASH_NAME).symlink_to(tmp_path / "elsewhere")
    assert io.lexists(str(tmp_path / trash.TRASH_NAME))
    with pytest.raises(UnsafePath):
        trash.present(str(tmp_path / trash.TRASH_NAME))


def test_a_lock_file_is_created_once_kept_alive_and_taken_away(folder: str) -> None:
    url = io.join(folder, "lock")
    io.make_folder(folder)
    assert lockfile.read(url, 100) is None
    assert lockfile.create(url, b"mine")
    assert not lockfile.create(url, b"theirs")
    found = lockfile.read(url, 100)
    assert found is not None and found[0] == b"mine"
    lockfile.touch(url, b"mine")
    assert lockfile.read(url, 100) is not None
    assert lockfile.take_away(url, lambda aside: True)
    assert lockfile.read(url, 100) is None


def test_a_stale_lock_replaced_since_it_was_judged_is_not_taken_away(folder: str) -> None:
    """Two processes judged the same lock stale; the first took it away and holds its own now: the second's
    takeover, which re-checks what is there, leaves the first's lock in place (on an object store too)."""
    url = io.join(folder, "lock")
    io.make_folder(folder)
    assert lockfile.create(url, b"the stale one")

    def judged(at: str) -> bool:
        found = lockfile.read(at, 100)
        return found is not None and found[0] == b"the stale one"

    assert lockfile.take_away(url, judged)  # the first process
    assert lockfile.create(url, b"the first's")
    assert not lockfile.take_away(url, judged)  # the second, late
    found = lockfile.read(url, 100)
    assert found is not None and found[0] == b"the first's"


def test_a_lock_taken_meanwhile_is_given_back(tmp_path: Path) -> None:
    url = str(tmp_path / "lock")
    assert lockfile.create(url, b"new holder")
    assert not lockfile.take_away(url, lambda aside: Path(aside).read_bytes() == b"the stale one")
    assert Path(url).read_bytes() == b"new holder"
    assert [p.name for p in tmp_path.iterdir()] == ["lock"]  # nothing left aside


def test_a_local_lock_is_never_there_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock appears with its content or not at all: a process killed at the last moment before the lock
    is in place (here the link raises, as a kill would stop it) leaves no lock, so the next taker gets it at
    once; where a file system has no hard links the lock is still created."""
    url = str(tmp_path / "lock")
    seen: list[bytes] = []

    def killed(source: str, target: str, **_: object) -> None:
        seen.append(Path(source).read_bytes())  # what would have been linked: already whole
        raise KeyboardInterrupt

    def in_place(path: str, data: bytes) -> bool:
        raise AssertionError("created in place (where a kill can leave it empty) on a file system with links")

    with monkeypatch.context() as patch:  # the way for file systems without links is not taken here
        patch.setattr(lockfile, "_create_in_place", in_place)
        assert lockfile.create(url, b"first") and Path(url).read_bytes() == b"first"
    Path(url).unlink()

    monkeypatch.setattr(lockfile.os, "link", killed)
    with pytest.raises(KeyboardInterrupt):
        lockfile.create(url, b"mine")
    assert seen == [b"mine"] and not Path(url).exists()
    assert list(tmp_path.iterdir()) == []  # the unnamed (or removed) temporary file is gone too

    def no_links(source: str, target: str, **_: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(lockfile.os, "link", no_links)
    assert lockfile.create(url, b"theirs") and Path(url).read_bytes() == b"theirs"
    assert not lockfile.create(url, b"late")
    assert [p.name for p in tmp_path.iterdir()] == ["lock"]  # no temporary file left


def test_a_temporary_lock_left_by_a_kill_is_swept_by_a_later_create(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the file system has no unnamed files, the lock is written under a temporary name first; a process
    SIGKILLed between that write and the link leaves it behind, and the next taker of the lock removes it once
    it is old enough that no live process can still be about to link it."""
    monkeypatch.setattr(lockfile, "_link_unnamed", lambda path, data: None)
    url = str(tmp_path / "lock")
    old = tmp_path / "lock.tmp-4242-0badcafe"
    fresh = tmp_path / "lock.tmp-4343-00c0ffee"
    other = tmp_path / "other.tmp-4242-0badcafe"
    for leftover in (old, fresh, other):
        leftover.write_bytes(b"pid 4242")
    long_ago = time.time() - 3600
    os.utime(old, (long_ago, long_ago))
    os.utime(other, (long_ago, long_ago))
    assert lockfile.create(url, b"mine") and Path(url).read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock", fresh.name, other.name]
