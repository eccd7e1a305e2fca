"""Run the real `ckptctl` command on hostile input in a child process: exit code, output, peak memory, no hang.

Hostile input must end in a ckptctl message and exit 1 or 2, in bounded memory and time, whatever it holds.
A child process is the only honest way to check that: a crash (SIGSEGV), a hang or a runaway allocation
would take the test process down with it.

Peak memory is the child's `VmHWM` (the high-water mark of its own address space), which it writes to a file
as it exits. `wait4`'s `ru_maxrss` cannot be used: Linux carries the pre-exec high-water mark across
`exec`, and `subprocess` forks (vfork) from the test process, so a child of a 1 GB pytest worker would
report 1 GB whatever it did.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

#: Hostile input must be refused within this much memory (issue 16: < 512 MiB measured in the subprocess).
MAX_RSS_BYTES = 512 << 20
#: A command on hostile input that runs longer than this has hung.
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Outcome:
    """What one `ckptctl` run on hostile input did."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    peak_rss_bytes: int
    wall_s: float

    def assert_refused(self, *codes: int) -> None:
        """Exit code in `codes` (default 1 or 2), a ckptctl message (no traceback, no "internal error"), and
        peak RSS under `MAX_RSS_BYTES`."""
        allowed = codes or (1, 2)
        detail = f"ckptctl {' '.join(self.args)}: rc={self.returncode}\nstdout={self.stdout[-2000:]}\nstderr={self.stderr[-2000:]}"
        assert self.returncode in allowed, detail
        assert "Traceback" not in self.stderr, detail
        assert "internal error" not in self.stderr.lower(), detail
        assert self.peak_rss_bytes < MAX_RSS_BYTES, f"peak RSS {self.peak_rss_bytes >> 20} MiB\n{detail}"


#: Runs `python -m ckptctl ARGS` and records the process's VmHWM (KiB) at exit into $CKPTCTL_TEST_HWM_FILE.
_WRAPPER = """
import atexit, os, runpy, sys

def _record_peak():
    with open("/proc/self/status") as status:
        peak = next((line.split()[1] for line in status if line.startswith("VmHWM:")), "0")
    with open(os.environ["CKPTCTL_TEST_HWM_FILE"], "w") as out:
        out.write(peak)

atexit.register(_record_peak)
sys.argv = ["ckptctl", *sys.argv[1:]]
runpy.run_module("ckptctl", run_name="__main__", alter_sys=True)
"""


def run_ckptctl(args: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S, env: dict[str, str] | None = None) -> Outcome:
    """Run `python -m ckptctl ARGS` in a child process group; a run past `timeout` is killed and fails the test."""
    fd, hwm_file = tempfile.mkstemp(prefix="ckptctl-hwm-")
    os.close(fd)
    full_env = {**os.environ, "COLUMNS": "200", **(env or {}), "CKPTCTL_TEST_HWM_FILE": hwm_file}
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRAPPER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=full_env,
        start_new_session=True,
    )
    chunks: dict[str, bytes] = {}

    def drain(name: str, stream: object) -> None:
        chunks[name] = stream.read()  # type: ignore[attr-defined]

    readers = [
        threading.Thread(target=drain, args=(n, s), daemon=True)
        for n, s in (("out", proc.stdout), ("err", proc.stderr))
    ]
    for reader in readers:
        reader.start()
    hung = threading.Event()

    def kill() -> None:
        hung.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        _, status = os.waitpid(proc.pid, 0)
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    for reader in readers:
        reader.join(timeout=10)
    out = chunks.get("out", b"").decode(errors="replace")
    err = chunks.get("err", b"").decode(errors="replace")
    if hung.is_set():
        raise AssertionError(f"ckptctl {' '.join(args)} hung (> {timeout} s)\nstderr={err[-2000:]}")
    with open(hwm_file) as f:
        recorded = f.read().strip()
    os.unlink(hwm_file)
    # No record: the child died without running its exit handlers (a signal); the exit code says so.
    peak_kib = int(recorded) if recorded.isdigit() else 0
    return Outcome(tuple(args), proc.returncode, out, err, peak_kib * 1024, time.monotonic() - start)
