"""The transfer helpers of `ckptctl.io` on an fsspec store: parallel range reads and downloads keep their
order and count every byte; a failed transfer stops the ones not yet started; a listing snapshot answers
as the store does, without asking it."""

from __future__ import annotations

import hashlib
import secrets
import threading
from pathlib import Path

import fsspec
import pytest

from ckptctl import io
from ckptctl.errors import CheckpointNotFound, StorageError
from ckptctl.io import remote as io_remote
from tests.s3.server import copy_to_store


@pytest.fixture
def blob(memory_store: str) -> tuple[str, bytes]:
    data = secrets.token_bytes(100_003)
    url = f"{memory_store}/io/{secrets.token_hex(4)}.bin"
    io.write_bytes_atomic(url, data)
    return url, data


def test_read_ranges_returns_each_range_in_request_order(blob: tuple[str, bytes]) -> None:
    url, data = blob
    requests = [(url, start, 1000) for start in range(99_000, -1, -9_000)]
    before = io.READ_STATS.bytes_read
    chunks = io.read_ranges(requests, max_workers=4)
    assert chunks == [data[s : s + 1000] for _, s, _ in requests]
    assert io.READ_STATS.bytes_read - before == sum(len(c) for c in chunks)


@pytest.mark.parametrize("workers", [1, 3, 16])
def test_download_file_in_parallel_blocks(
    blob: tuple[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    url, data = blob
    monkeypatch.setattr(io, "REMOTE_BLOCK", 7_000)  # 15 blocks, the last one short
    hasher = hashlib.sha256()
    size = io.download_file(url, str(tmp_path / "copy.bin"), hasher.update, max_workers=workers)
    assert size == len(data) and (tmp_path / "copy.bin").read_bytes() == data
    assert hasher.digest() == hashlib.sha256(data).digest()  # blocks reached the hasher in order


def test_download_of_a_missing_file_is_not_found(memory_store: str, tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFound):
        io.download_file(f"{memory_store}/io/absent.bin", str(tmp_path / "x"))


def test_parallel_map_stops_after_the_first_failure() -> None:
    started: list[int] = []
    gate = threading.Event()

    def work(i: int) -> int:
        started.append(i)
        if i == 0:
            raise StorageError("upload failed")
        gate.wait(0.05)
        return i

    with pytest.raises(StorageError, match="upload failed"):
        io.parallel_map(work, list(range(200)), max_workers=2)
    assert len(started) < 200  # the calls not yet started were cancelled
    assert io.parallel_map(lambda i: i * i, [3, 1, 2]) == [9, 1, 4]


@pytest.mark.parametrize("scheme", ["s3", "memory"])
def test_a_listing_snapshot_answers_as_the_store_does(
    demo_dir: Path, stores: dict[str, str], scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = copy_to_store(demo_dir / "native", f"{stores[scheme]}/snapshot-{secrets.token_hex(3)}")
    fs, path = fsspec.core.url_to_fs(root, use_listings_cache=False)
    fs.pipe_file(f"{path}/deep/a/b/c.txt", b"deep")
    folders = ["", "step-10", "step-30", "deep", "deep/a", "deep/a/b", "nothing"]
    files = ["latest", "step-30/ckptctl-manifest.json", "deep/a/b/c.txt", "nothing.txt"]

    def answers() -> list[object]:
        out: list[object] = []
        for rel in folders:
            url = f"{root}/{rel}".rstrip("/")
            try:
                listing: object = [(e.name, e.is_dir, e.size) for e in io.list_dir(url)]
            except CheckpointNotFound:
                listing = "not found"
            out += [listing, io.is_dir(url), io.exists(url), sorted((k, e.size) for k, e in io.list_tree(url).items())]
        for rel in files:
            url = f"{root}/{rel}"
            out += [io.exists(url), io.is_dir(url), io.file_size(url) if io.exists(url) else None]
        out.append(io.read_bytes(f"{root}/latest"))
        return out

    expected = answers()
    with io.listing_snapshot(f"{root}/"):
        calls: list[str] = []
        real_fs = io_remote._fs  # counts what reaches the store

        def counting_fs(url: str) -> tuple[object, str]:
            calls.append(url)
            return real_fs(url)

        monkeypatch.setattr(io_remote, "_fs", counting_fs)
        assert answers() == expected
        assert answers() == expected  # `latest`, a small file, is read once
        in_threads = io.parallel_map(lambda rel: io.is_dir(f"{root}/{rel}"), folders)
        assert calls == [f"{root}/latest"]
    assert in_threads == [True] * 6 + [False]
