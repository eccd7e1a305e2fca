"""blake3 digests: of whole files (parallel, mmap on local files) and of bytes as they are written.

blake3 is used rather than sha256 because it hashes at memory speed on several threads; the manifest
records the algorithm name so that another one can be added without breaking old manifests.
"""

from __future__ import annotations

import os
from typing import IO

import blake3

from ckptctl import io
from ckptctl.errors import StorageError

ALGORITHM = "blake3"
_REMOTE_BLOCK = 8 << 20


def file_digest(url: str) -> str:
    """Hex blake3 digest of a file; local files are memory-mapped and hashed on every core."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if io.is_local(url):
        path = io.local_path(url)
        try:
            size = os.path.getsize(path)
            if size:
                hasher.update_mmap(path)
        except FileNotFoundError as exc:
            raise StorageError(f"file vanished while hashing: {url}") from exc
        except OSError as exc:
            raise StorageError(f"cannot read {url}: {exc.strerror or exc}") from exc
        io.count_read(size)
        return hasher.hexdigest()
    with io.open_read(url) as f:
        while block := f.read(_REMOTE_BLOCK):
            io.count_read(len(block))
            hasher.update(block)
    return hasher.hexdigest()


class HashingWriter:
    """Wraps a binary file: every byte written is hashed and counted, so no second read is needed."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._hasher.update(data)
        written = self._raw.write(data)
        self.size += len(data)
        return written

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()
