"""Run the real `ckptctl` command on hostile input in a child process: exit code, output, peak memory, no hang.

Hostile input must end in a ckptctl message and exit 1 or 2, in bounded memory and time, whatever it holds.
A child process is the only honest way to check that: a crash (SIGSEGV), a hang or a runaway allocation
would take the test process down with it. `os.wait4` gives the child's own peak RSS, provided the child was
not forked from a large process: Linux counts the memory a process had when it called exec into its peak,
so a command forked straight from pytest (which holds torch and the session's fixtures) would report
pytest's size. The command is therefore started by a small launcher process, which waits for it and
reports its exit status and peak RSS.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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


#: Run by a fresh interpreter: start the command (a fork of this small process), wait for it, and write
#: "EXIT_CODE PEAK_RSS_KIB" to the file descriptor given as the first argument.
_LAUNCHER = """
import os, subprocess, sys
report = int(sys.argv[1])
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
os.write(report, f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}".encode())
"""


def run_ckptctl(args: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S, env: dict[str, str] | None = None) -> Outcome:
    """Run `python -m ckptctl ARGS` in a child process group; a run past `timeout` is killed and fails the test."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    start = time.monotonic()
    report_read, report_write = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(report_write), sys.executable, "-m", "ckptctl", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=full_env,
        start_new_session=True,
        pass_fds=(report_write,),
    )
    os.close(report_write)
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
        proc.wait()
    finally:
        timer.cancel()
    with os.fdopen(report_read, "rb") as report:
        reported = report.read().decode()
    for reader in readers:
        reader.join(timeout=10)
    out = chunks.get("out", b"").decode(errors="replace")
    err = chunks.get("err", b"").decode(errors="replace")
    if hung.is_set():
        raise AssertionError(f"ckptctl {' '.join(args)} hung (> {timeout} s)\nstderr={err[-2000:]}")
    if not reported:
        raise AssertionError(f"the launcher of ckptctl {' '.join(args)} failed (rc={proc.returncode})\n{err[-2000:]}")
    returncode, max_rss_kib = map(int, reported.split())
    # ru_maxrss is in KiB on Linux
    return Outcome(tuple(args), returncode, out, err, max_rss_kib * 1024, time.monotonic() - start)
