"""Every backend behind `ckptctl.io` answers the same: one conformance suite run through the `io` functions
against a local folder, an fsspec store (`memory://`) and a listing snapshot of that store."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from ckptctl import io
from ckptctl.errors import CheckpointNotFound, CorruptCheckpoint
from ckptctl.io import snapshot

FILES = {"a.bin": b"0123456789", "sub/b.json": b'{"x": 1}', "sub/deep/c.txt": b"c" * 100}


@pytest.fixture(params=["local", "fsspec", "snapshot"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        for rel, data in FILES.items():
            (tmp_path / "root" / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "root" / rel).write_bytes(data)
        yield str(tmp_path / "root")
        return
    fs = fsspec.filesystem("memory")
    base = f"/backends-{os.getpid()}-{id(request)}"
    for rel, data in FILES.items():
        fs.pipe_file(f"{base}/{rel}", data)
    url = f"memory://{base}"
    with io.listing_snapshot(url) if request.param == "snapshot" else contextlib.nullcontext():
        if request.param == "snapshot":
            assert snapshot.covering(url) is not None
        yield url
    with contextlib.suppress(FileNotFoundError):
        fs.rm(base, recursive=True)


def test_queries(root: str) -> None:
    assert [(e.name, e.is_dir) for e in io.list_dir(root)] == [("a.bin", False), ("sub", True)]
    assert {rel: e.size for rel, e in io.list_tree(root).items()} == {rel: len(d) for rel, d in FILES.items()}
    assert {rel: e.size for rel, e in io.list_tree(io.join(root, "sub")).items()} == {"b.json": 8, "deep/c.txt": 100}
    assert io.exists(io.join(root, "a.bin")) and io.exists(io.join(root, "sub"))
    assert io.is_dir(io.join(root, "sub/deep")) and not io.is_dir(io.join(root, "a.bin"))
    assert not io.exists(io.join(root, "nothing")) and not io.is_dir(io.join(root, "nothing"))
    assert io.file_size(io.join(root, "sub/deep/c.txt")) == 100
    with pytest.raises(CheckpointNotFound):
        io.list_dir(io.join(root, "nothing"))
    assert io.list_tree(io.join(root, "nothing")) == {}


def test_reads_count_what_crosses_the_boundary(root: str) -> None:
    url = io.join(root, "a.bin")
    with io.counting() as read:
        assert io.read_bytes(url) == b"0123456789"
        assert io.read_bytes(url, 2, 3) == b"234"
        assert io.read_ranges([(url, 0, 1), (url, 9, 1)]) == [b"0", b"9"]
        assert io.read_text(io.join(root, "sub/b.json"), max_size=8) == '{"x": 1}'
        with io.open_read(url) as f:
            assert f.read(4) == b"0123"
    assert read.bytes_read == 10 + 3 + 2 + 8  # what the caller reads from an open file it counts itself
    with io.counting() as again:
        io.read_bytes(url)
    assert again.bytes_read == (0 if snapshot.covering(root) else 10)  # a snapshot reads small files once
    with pytest.raises(CorruptCheckpoint, match="larger than"):
        io.read_bytes(url, max_size=9)
    with pytest.raises(CheckpointNotFound):
        io.read_bytes(io.join(root, "nothing"))


def test_writes_and_deletes(root: str, tmp_path: Path) -> None:
    io.write_bytes_atomic(io.join(root, "sub/marker"), b"m")
    source = tmp_path / "upload.src"
    source.write_bytes(b"u" * 7)
    io.upload_file(str(source), io.join(root, "new/up.bin"))  # folders are made as needed
    assert io.read_bytes(io.join(root, "sub/marker")) == b"m"
    assert io.read_bytes(io.join(root, "new/up.bin")) == b"u" * 7
    io.delete_file(io.join(root, "sub/marker"))
    io.delete_file(io.join(root, "sub/marker"))  # a missing file is not an error
    io.delete_files([io.join(root, "a.bin"), io.join(root, "new/up.bin")])
    io.delete_tree(io.join(root, "new"))
    io.delete_tree(io.join(root, "sub"))
    io.delete_tree(io.join(root, "sub"))
    if snapshot.covering(root) is None:  # a snapshot does not see what changed during its block
        assert io.list_tree(root) == {}
