"""A process that commits step 1 to a remote run, then starts uploading step 2 and stops midway (after the
RNG files and one data file) until the test SIGKILLs it.

Run: `python -m tests.s3._kill_worker s3://bucket/run` (with the S3 server's AWS_* variables set).
"""

from __future__ import annotations

import sys
import time

import torch

from ckptctl import io
from ckptctl.core import CheckpointManager


def main(root: str) -> None:
    manager = CheckpointManager(root)
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        model.weight.fill_(1.0)
    manager.save(1, {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})

    real_upload = io.upload_file

    def upload_then_hang(path: str, url: str) -> None:
        real_upload(path, url)
        if not url.rsplit("/", 1)[-1].startswith("rng"):
            print("uploading step 2", flush=True)
            time.sleep(600)  # the test kills us here

    io.upload_file = upload_then_hang  # type: ignore[assignment]
    with torch.no_grad():
        model.weight.fill_(2.0)
    manager.save(2, {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})


if __name__ == "__main__":
    main(sys.argv[1])
