"""blake3 digests: of whole files (read through a small reused buffer) and of bytes as they are written.

blake3 is used rather than sha256 because it hashes at memory speed on several threads; the manifest
records the algorithm name so that another one can be added without breaking old manifests.
"""

from __future__ import annotations

from typing import IO

import blake3

from ckptctl import io
from ckptctl.errors import CheckpointNotFound, StorageError
from ckptctl.io.sweep import Feed, Span, Sweep

ALGORITHM = "blake3"


class DigestSink:
    """The `io.sweep.SpanSink` of a whole file's blake3 digest (its span must be `ordered`).

    A sweep that has threads to spare gives them to the sink of a large file (`io.sweep.ThreadedSink`),
    which then hashes its larger updates on threads of its own.
    """

    __slots__ = ("_hasher", "error")

    def __init__(self) -> None:
        self._hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        self.error: str | None = None

    def use_threads(self, threads: int) -> None:
        # blake3's threaded hash of the same bytes is the same digest, by design.
        self._hasher = blake3.blake3(max_threads=threads)

    def piece(self, offset: int) -> Feed:
        if offset:
            raise ValueError("a digest is fed from the start of its file, in order (an ordered span)")
        return self._hasher.update

    def failed(self, message: str) -> None:
        self.error = message

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


def file_digest(url: str) -> str:
    """Hex blake3 digest of a file, read through a small reused buffer (no memory map: memory stays flat).

    Raises:
        StorageError: the file vanished or could not be read whole.
    """
    try:
        size = io.file_size(url)
    except CheckpointNotFound as exc:
        raise StorageError(f"file vanished while hashing: {url}") from exc
    sink = DigestSink()
    Sweep([Span(url, 0, size, sink, ordered=True)]).run(1)
    if sink.error is not None:
        raise StorageError(f"cannot hash {url}: {sink.error}")
    return sink.hexdigest()


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
