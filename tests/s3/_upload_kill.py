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


def killed_after_uploads(worker: str, src: str, dst: str, count: int) -> None:
    """The test's side: run `python -m WORKER SRC DST COUNT` (one upload at a time), wait until it says COUNT files
    are up, and SIGKILL it there."""
    import signal
    import subprocess
    import sys

    from tests.core.util import REPO, worker_env

    process = subprocess.Popen(
        [sys.executable, "-m", worker, src, dst, str(count)],
        cwd=REPO,
        env={**worker_env(), "CKPTCTL_IO_WORKERS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        assert line == f"uploaded {count}", (line, process.stderr.read() if process.stderr else "")
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
