"""Writing a DCP folder's data files one tensor at a time, and `.metadata` last: with torch's own writer
(`data_file_writer`: `convert --to dcp`), or without torch (`write_data_file`: `reshard --to dcp`, whose
tensors are byte ranges of the source's files).

A data file torch's `FileSystemWriter` writes (torch 2.13, `filesystem._write_item`, the default TORCH_SAVE
serialization) is its items one after another, each a whole `torch.save` archive written into the open file:
a tensor as `torch.save(tensor)`, any other value as the bytes `DefaultSavePlanner.transform_object` made with
`torch.save(value)`; the storage record of an item is the archive's offset and length. `torch.save` into a
stream names the archive's folder `archive` and counts its zip offsets from the archive's first byte.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import IO, Any, NamedTuple, cast

from ckptctl import io
from ckptctl.errors import StorageError
from ckptctl.formats.digest import HashingStream, HashingWriter
from ckptctl.formats.manifest import FileRecord
from ckptctl.formats.torch_save_writer import HASH_THREADS, FdWriter, write_torch_archive

__all__ = ["DataFile", "data_file_writer", "write_data_file"]

#: The archive folder `torch.save` names when it writes into a stream (`PyTorchStreamWriter`'s default).
_STREAM_ARCHIVE = "archive"


class DataFile(NamedTuple):
    """What `write_data_file` wrote: each item's (key, offset, length) in order, and the file's size and digest."""

    items: list[tuple[str, int, int]]
    file: FileRecord


def write_data_file(path: str, items: Sequence[tuple[str, Callable[[], Any]]]) -> DataFile:
    """Write the DCP data file `path` (a new file) without torch: each item's value, asked for when its turn comes
    and let go once written, as the `torch.save` archive torch's writer writes for it (a
    `torch_save_writer.RawTensor` as a tensor, read from where its bytes are; anything else as a plain value),
    hashed as it is written (the file is not synced). Returns each item's (key, offset, length), in order, and
    the file's size and digest.

    Raises:
        StorageError: the file cannot be written; CorruptCheckpoint: a tensor's source bytes are not there whole.
    """
    records: list[tuple[str, int, int]] = []
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from exc
    try:
        out = HashingWriter(FdWriter(fd), threads=HASH_THREADS)
        for key, value_of in items:
            value = value_of()
            offset = out.size
            length = write_torch_archive(out, value, _STREAM_ARCHIVE, path)
            del value
            records.append((key, offset, length))
        io.start_writeback(fd, 0, out.size)  # the commit's fsync then waits less
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    return DataFile(records, FileRecord(out.size, out.hexdigest()))


def data_file_writer(path: str, name: str) -> Any:
    """torch's `FileSystemWriter` of the DCP folder `path` that writes a plan into the data file `name`."""
    from io import UnsupportedOperation

    from torch.distributed.checkpoint.filesystem import FileSystemWriter, _write_item
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.futures import Future

    # `_write_item` is private: its signature is torch 2.13's (transforms, stream, data, item, storage_key,
    # serialization_format) on the torch the suite runs; older releases took (stream, data, item, storage_key).
    streams_items = list(inspect.signature(_write_item).parameters)[:1] == ["transforms"]

    class DataFileWriter(FileSystemWriter):
        """torch's writer of a DCP folder, writing the items of a plan into the one data file `name`
        (torch names a rank's files `__{rank}_{n}` from 0 on each call), and a `.metadata` without the
        save's random id and staging path (`storage_meta`, which no loader needs), so that the same
        conversion gives the same bytes.

        `write_data` writes each item with torch's own `_write_item`, in torch's order (byte items, then
        tensors in plan order), as torch's single-threaded CPU writer does, but resolves each tensor only when
        its item comes up and lets it go once written: torch's loop keeps every tensor of the file alive until
        the file is closed (for its safetensors format), which would hold a whole parameter row and its
        moments at once. The file is hashed as it is written (`written`)."""

        def __init__(self, path: str, name: str) -> None:
            super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
            self.name = name
            #: Size and digest of the data file, hashed while written (None: torch's own loop wrote it).
            self.written: FileRecord | None = None

        def write_data(self, plan: Any, planner: Any) -> Any:
            if not (
                streams_items and hasattr(self, "serialization_format")
            ):  # a torch whose private `_write_item` differs: its own loop (more memory)
                return super().write_data(plan, planner)
            items = [item for item in plan.items if item.type == WriteItemType.BYTE_IO]
            items += [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
            results = []
            with self.fs.create_stream(self.fs.concat_path(self.path, self.name), "wb") as raw:
                # Hashed as written, so that the digests file need not read it back (torch types the stream
                # an `IOBase`: it is the binary file `FileSystem.create_stream` opened).
                stream = HashingStream(cast("IO[bytes]", raw))
                for item in items:
                    data = planner.resolve_data(item)
                    if item.type != WriteItemType.BYTE_IO:
                        data = data.detach().cpu()
                        if data.untyped_storage().size() != data.nbytes:
                            # As torch's loader: a view is saved with its own storage, not its base's.
                            data = data.clone()
                    results.append(
                        _write_item(self.transforms, stream, data, item, self.name, self.serialization_format)
                    )
                    del data
                if self.sync_files:
                    try:
                        os.fsync(stream.fileno())
                    except (AttributeError, UnsupportedOperation):
                        os.sync()
                stream.flush()
            self.written = FileRecord(stream.size, stream.hexdigest())
            done: Future[list[Any]] = Future()
            done.set_result(results)
            return done

        def storage_meta(self) -> None:
            return None

    return DataFileWriter(path, name)
