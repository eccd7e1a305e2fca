"""`HashingWriter`: the digest and size of what it wrote, whichever path (inline, or hashed on a helper
thread while written in parts with the disk's writeback started early) the writes took."""

from __future__ import annotations

import io
import os
from pathlib import Path

import blake3
import numpy as np
import pytest

from ckptctl.formats import digest
from ckptctl.formats.digest import HashingWriter


@pytest.mark.parametrize("part", [digest._PART, 3 << 20])
def test_large_writes_in_parts_hash_and_write_every_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part: int
) -> None:
    monkeypatch.setattr(digest, "_PART", part)
    rng = np.random.default_rng(0)
    pieces = [b"header", rng.bytes(5 << 20), memoryview(rng.bytes(7 << 20 | 5)), b"", rng.bytes(1000)]
    path = tmp_path / "f.bin"
    with open(path, "wb") as raw:
        out = HashingWriter(raw)
        for piece in pieces:
            assert out.write(piece) == len(piece)
        raw.flush()
        os.fsync(raw.fileno())
    expected = b"".join(bytes(p) for p in pieces)
    assert path.read_bytes() == expected
    assert out.size == len(expected)
    assert out.hexdigest() == blake3.blake3(expected).hexdigest()


def test_an_in_memory_file_has_no_writeback_but_the_same_digest() -> None:
    data = np.arange(1 << 19, dtype=np.float32).tobytes()  # 2 MiB: the overlapped path
    buffer = io.BytesIO()
    out = HashingWriter(buffer)
    out.write(data)
    assert buffer.getvalue() == data
    assert out.hexdigest() == blake3.blake3(data).hexdigest()
