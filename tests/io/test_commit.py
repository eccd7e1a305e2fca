"""`io.commit`, the one commit protocol: a local install swaps a folder in whole (with or without an atomic
exchange) and leaves no trash behind; an object store upload puts the marker last and undoes itself
markers first."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptctl import io
from ckptctl.errors import StorageError
from ckptctl.io import commit, trash


def folder(path: Path, **files: str) -> Path:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


@pytest.mark.parametrize("atomic", [True, False], ids=["exchange", "two-renames"])
def test_install_replaces_a_folder_whole_and_retires_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, atomic: bool
) -> None:
    if not atomic:
        monkeypatch.setattr(io, "exchange", lambda a, b: False)  # a filesystem without renameat2
    final = folder(tmp_path / "out", old="1", marker="old")
    staging = folder(tmp_path / ".out.staging")
    (staging / "new").write_text("2")
    commit.write_marker(str(staging), "marker", b"new")

    replaced = commit.install(str(staging), str(final))
    assert replaced is not None and replaced.trash == str(tmp_path / trash.TRASH_NAME)
    assert sorted(os.listdir(replaced.url)) == ["marker", "old"]  # the old folder, whole, in the trash
    assert sorted(os.listdir(final)) == ["marker", "new"] and (final / "marker").read_text() == "new"
    trash.purge(replaced)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_install_into_a_missing_or_empty_folder_is_a_rename(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for target in ("missing", "empty"):
        staging = folder(tmp_path / f".{target}.staging", marker="x")
        assert commit.install(str(staging), str(tmp_path / target)) is None
    assert sorted(os.listdir(tmp_path)) == ["empty", "missing"]


@pytest.fixture
def store() -> Iterator[str]:
    import fsspec

    root = f"/commit-test-{os.getpid()}"
    yield f"memory://{root}"
    with contextlib.suppress(FileNotFoundError):
        fsspec.filesystem("memory").rm(root, recursive=True)


def test_an_upload_puts_its_batches_in_order_and_the_marker_last(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    staging = folder(tmp_path / "staging", first="f", big="x" * 100, small="x", marker="m")
    old = f"{store}/ckpt"
    io.write_bytes_atomic(f"{old}/stale", b"from before")
    order: list[str] = []
    real = io.upload_file
    monkeypatch.setattr(io, "upload_file", lambda path, url: (order.append(io.name_of(url)), real(path, url))[1])
    monkeypatch.setenv("CKPTCTL_IO_WORKERS", "1")

    upload = commit.ObjectStoreUpload(str(staging), old, lambda files: [["marker"]])
    upload.clear()
    upload.upload([["first"], ["small", "big"]])
    upload.finish("marker")
    assert order == ["first", "big", "small", "marker"]  # a batch goes largest first
    assert sorted(io.list_tree(old)) == ["big", "first", "marker", "small"]


def test_a_failed_upload_is_undone_marker_first(tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    staging = folder(tmp_path / "staging", a="1", b="2", marker="m")
    url = f"{store}/ckpt"
    upload = commit.ObjectStoreUpload(str(staging), url, lambda files: [["marker"]])
    upload.upload([["a"]])
    upload.finish("marker", b"written from memory")
    assert io.read_bytes(f"{url}/marker") == b"written from memory"

    def broken(path: str, target: str) -> None:
        raise StorageError("connection reset")

    monkeypatch.setattr(io, "upload_file", broken)
    with pytest.raises(StorageError):
        upload.upload([["b"]])
    deleted: list[list[str]] = []
    real = io.delete_files
    monkeypatch.setattr(io, "delete_files", lambda urls: (deleted.append([io.name_of(u) for u in urls]), real(urls))[1])
    upload.undo()
    assert deleted == [["marker"], ["a"]] and io.list_tree(url) == {}
