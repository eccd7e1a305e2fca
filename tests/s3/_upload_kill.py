"""What the kill workers share: `io.upload_file` made to stop the process once COUNT files are up, until the
test SIGKILLs it (the workers run with `CKPTCTL_IO_WORKERS=1`, so that exactly COUNT files are up by then)."""

from __future__ import annotations

import threading
import time

from ckptctl import io


def hang_after_uploads(count: int) -> None:
    """Patch `io.upload_file`: after the COUNT-th upload, say so on stdout and wait to be killed."""
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
