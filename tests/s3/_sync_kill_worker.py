"""A process that syncs SRC into DST and stops once COUNT files are up, until the test SIGKILLs it (run with
`CKPTCTL_IO_WORKERS=1`, so that exactly COUNT files are up by then).

Run: `python -m tests.s3._sync_kill_worker SRC DST COUNT` (with the S3 server's AWS_* variables set).
"""

from __future__ import annotations

import sys
import threading
import time

from ckptctl import io
from ckptctl.ops.sync import sync


def main(src: str, dst: str, count: int) -> None:
    real_upload = io.upload_file
    uploaded: list[str] = []
    lock = threading.Lock()

    def upload_then_hang(path: str, url: str) -> None:
        real_upload(path, url)
        with lock:
            uploaded.append(url)
            done = len(uploaded)
        if done >= count:
            print(f"uploaded {done}", flush=True)
            time.sleep(600)  # the test kills us here

    io.upload_file = upload_then_hang
    sync(src, dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
