"""torch's own DCP writer, writing one data file per call: what `convert --to dcp` and `reshard --to dcp` write
a DCP folder with, a bounded group of tensors at a time, and `.metadata` last."""

from __future__ import annotations

import queue
from typing import Any

__all__ = ["data_file_writer"]


def data_file_writer(path: str, name: str) -> Any:
    """torch's `FileSystemWriter` of the DCP folder `path` that writes a plan into the data file `name`."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class DataFileWriter(FileSystemWriter):
        """torch's writer of a DCP folder, writing the items of a plan into the one data file `name`
        (torch names a rank's files `__{rank}_{n}` from 0 on each call), and a `.metadata` without the
        save's random id and staging path (`storage_meta`, which no loader needs), so that the same
        conversion gives the same bytes."""

        def __init__(self, path: str, name: str) -> None:
            super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
            self.name = name

        def write_data(self, plan: Any, planner: Any) -> Any:
            files: queue.Queue[tuple[Any, str, list[Any]]] = queue.Queue()
            files.put((self.fs.concat_path(self.path, self.name), self.name, plan.items))
            return self._write_data(planner, files)

        def storage_meta(self) -> None:
            return None

    return DataFileWriter(path, name)
