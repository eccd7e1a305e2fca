"""Run the real `ckptctl` command on hostile input in a child process: exit code, output, peak memory, no hang.

Hostile input must end in a ckptctl message and exit 1 or 2, in bounded memory and time, whatever it holds.
A child process is the only honest way to check that: a crash (SIGSEGV), a hang or a runaway allocation
would take the test process down with it. `os.wait4` gives the child's own peak RSS, provided the child was
not forked from a large process: Linux starts a forked child's peak at its parent's size, and counts the
memory a process had when it called exec into its peak, so a command forked from pytest (which holds torch
and the session's fixtures) would report pytest's size.

Each command is therefore forked by a small server process of its own (`_Forkserver`), which has imported
what `python -m ckptctl` imports before it reads its arguments (`ckptctl.cli.app`), and the ckptctl and
Typer modules a command imports as it runs, except those that need torch or numpy: a child starts at least
as large as a fresh `python -m ckptctl` would be (its peak errs high, by a few MiB, never low), runs `main`
with the test's arguments, environment and working folder, its streams the test's pipes, in a session of
its own, and exits through the interpreter's normal shutdown. The server reports its exit status (a signal
as a negative code, as before) and peak RSS. Starting Python and importing the CLI once per test process
rather than once per command saves about half a CPU-second per command; the hostile tests run ~200.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
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
    #: The command's own user + system CPU time (what the suite's time budget counts).
    cpu_s: float

    def assert_refused(self, *codes: int) -> None:
        """Exit code in `codes` (default 1 or 2), a ckptctl message (no traceback, no "internal error"), and
        peak RSS under `MAX_RSS_BYTES`."""
        allowed = codes or (1, 2)
        detail = f"ckptctl {' '.join(self.args)}: rc={self.returncode}\nstdout={self.stdout[-2000:]}\nstderr={self.stderr[-2000:]}"
        assert self.returncode in allowed, detail
        assert "Traceback" not in self.stderr, detail
        assert "internal error" not in self.stderr.lower(), detail
        assert self.peak_rss_bytes < MAX_RSS_BYTES, f"peak RSS {self.peak_rss_bytes >> 20} MiB\n{detail}"


#: The server, run by a fresh interpreter with its end of a socket pair as the first argument. Each request is
#: one message: JSON [working folder, environment, arguments] with the child's stdin, stdout and stderr as
#: file descriptors; the answers are "PID" once the child is forked and "EXIT_CODE PEAK_RSS_KIB CPU_S" once it ended.
#: The child leaves `serve()` by returning, so that `main`'s SystemExit ends it as it ends `python -m ckptctl`
#: (atexit hooks, flushed streams).
_SERVER = """
import json, os, socket, sys
if len(sys.argv) > 2:  # an address-space limit (RLIMIT_AS), set before the imports: every child inherits it
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
channel = socket.socket(fileno=int(sys.argv[1]))
import gc, importlib, importlib.util, pkgutil
import ckptctl
from ckptctl.cli.app import app, main  # what `python -m ckptctl` imports before it reads its arguments

script = importlib.util.find_spec("ckptctl.__main__").origin  # sys.argv[0] of `python -m ckptctl`


class NoTorch:
    # Refuses torch and numpy: a module that imports them as it loads is left for the child to import.

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "numpy"):
            raise ImportError(name)


# What commands import as they run, imported once here: ckptctl's modules (not those that import torch or
# numpy, which would add ~200 MiB to every child's size) and what Typer imports to parse the arguments.
sys.meta_path.insert(0, NoTorch())
for module in pkgutil.walk_packages(ckptctl.__path__, "ckptctl."):
    if not module.name.endswith("__main__"):
        try:
            importlib.import_module(module.name)
        except ImportError:
            pass
del sys.meta_path[0]
import typer.main
typer.main.get_command(app)
try:
    import typer._adapters  # imported by Typer as it converts the first option's value (pydantic: ~0.2 s)
except ImportError:
    pass
assert "torch" not in sys.modules
# What is loaded now lives as long as the child: kept out of its garbage collections (which would otherwise
# walk it, at exit too, copying every page they touch).
gc.freeze()


def serve():
    while True:
        request, fds, _, _ = socket.recv_fds(channel, 1 << 20, 3)
        if not request:
            sys.exit(0)
        pid = os.fork()
        if pid == 0:
            return request, fds
        for fd in fds:
            os.close(fd)
        channel.send(str(pid).encode())
        _, status, usage = os.wait4(pid, 0)
        cpu = usage.ru_utime + usage.ru_stime
        channel.send(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss} {cpu}".encode())


request, fds = serve()
channel.close()
os.setsid()
for fd, std in zip(fds, (0, 1, 2)):
    os.dup2(fd, std)
    os.close(fd)
cwd, env, args = json.loads(request)
os.chdir(cwd)
os.environ.clear()
os.environ.update(env)
sys.argv = [script, *args]
main(args)
"""


#: Variables that change from test to test without changing what an import of ckptctl does: a server started
#: under an environment differing only in these serves (each child gets the test's own environment).
_PER_TEST_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})


class _Forkserver:
    """A `_SERVER` process started under `env`, forking one `ckptctl` child per `run`; with `address_space`, the
    server's RLIMIT_AS (which it sets first thing; every child it forks inherits it)."""

    def __init__(self, env: dict[str, str], address_space: int | None = None) -> None:
        self.env = env
        self.channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        with theirs:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _SERVER,
                    str(theirs.fileno()),
                    *([] if address_space is None else [str(address_space)]),
                ],
                stdin=subprocess.DEVNULL,
                stdout=self.log,
                stderr=self.log,
                env=env,
                pass_fds=(theirs.fileno(),),
            )

    def serves(self, env: dict[str, str]) -> bool:
        def same(variables: dict[str, str]) -> dict[str, str]:
            return {k: v for k, v in variables.items() if k not in _PER_TEST_VARIABLES}

        return self.process.poll() is None and same(env) == same(self.env)

    def run(
        self,
        args: Sequence[str],
        env: dict[str, str],
        timeout: float,
        cwd: str | None = None,
        reader_gone: bool = False,
    ) -> Outcome:
        """`ckptctl ARGS` in a forked child, in `cwd` (default this process's); one killed after `timeout`
        seconds fails the test. `reader_gone`: stdout's reader has closed its end before the child starts, so
        that every write to stdout meets a closed pipe (the stdout returned is empty)."""
        start = time.monotonic()
        out_read, out_write = os.pipe()
        if reader_gone:
            os.close(out_read)
        err_read, err_write = os.pipe()
        stdin = os.open(os.devnull, os.O_RDONLY)
        request = json.dumps([cwd or os.getcwd(), env, list(args)]).encode()
        try:
            socket.send_fds(self.channel, [request], [stdin, out_write, err_write])
        finally:
            for fd in (stdin, out_write, err_write):
                os.close(fd)
        chunks: dict[int, bytes] = {}

        def drain(fd: int) -> None:
            with os.fdopen(fd, "rb") as stream:
                chunks[fd] = stream.read()

        drained = (err_read,) if reader_gone else (out_read, err_read)
        readers = [threading.Thread(target=drain, args=(fd,), daemon=True) for fd in drained]
        for reader in readers:
            reader.start()
        answer = self.channel.recv(64)
        hung = threading.Event()
        timer = None
        if answer:
            pid = int(answer)

            def kill() -> None:
                hung.set()
                for kill_what in (os.killpg, os.kill):  # the group, unless the child has not yet made it
                    try:
                        kill_what(pid, signal.SIGKILL)
                        break
                    except ProcessLookupError:
                        pass

            timer = threading.Timer(timeout, kill)
            timer.start()
            try:
                answer = self.channel.recv(64)
            finally:
                timer.cancel()
        for reader in readers:
            reader.join(timeout=10)
        out = chunks.get(out_read, b"").decode(errors="replace")
        err = chunks.get(err_read, b"").decode(errors="replace")
        if hung.is_set():
            raise AssertionError(f"ckptctl {' '.join(args)} hung (> {timeout} s)\nstderr={err[-2000:]}")
        if not answer:
            self.log.seek(0)
            said = self.log.read().decode(errors="replace")
            raise AssertionError(f"the server forking ckptctl {' '.join(args)} failed\n{said[-2000:]}\n{err[-2000:]}")
        returncode, max_rss_kib, cpu_s = answer.split()
        # ru_maxrss is in KiB on Linux
        wall_s = time.monotonic() - start
        return Outcome(tuple(args), int(returncode), out, err, int(max_rss_kib) * 1024, wall_s, float(cpu_s))

    def close(self) -> None:
        self.channel.close()  # the server reads the end of its requests and exits
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


_server: _Forkserver | None = None
_lock = threading.Lock()


#: Servers for `run_in_environment`, one per environment (less `_PER_TEST_VARIABLES`), kept for the process's life.
_servers_by_environment: dict[frozenset[tuple[str, str]], _Forkserver] = {}


def _close_server() -> None:
    if _server is not None:
        _server.close()


def close_servers_by_environment() -> None:
    """Stop the servers `run_in_environment` and `run_with_address_space` started (each holds ~100 MiB: a test
    module closes them when done)."""
    for server in (*_servers_by_environment.values(), *_servers_by_limit.values()):
        server.close()
    _servers_by_environment.clear()
    _servers_by_limit.clear()


atexit.register(close_servers_by_environment)


atexit.register(_close_server)


def run_ckptctl(args: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S, env: dict[str, str] | None = None) -> Outcome:
    """`python -m ckptctl ARGS`, as forked by this process's server; a run past `timeout` is killed and fails the
    test. `env` adds variables: a server started under them runs that one command (what ckptctl reads from the
    environment as it imports must see them)."""
    global _server
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    with _lock:
        if env:
            own = _Forkserver(full_env)
            try:
                return own.run(args, full_env, timeout)
            finally:
                own.close()
        if _server is None or not _server.serves(full_env):
            _close_server()
            _server = _Forkserver(full_env)
        return _server.run(args, full_env, timeout)


#: Servers for `run_with_address_space`, one per limit.
_servers_by_limit: dict[int, _Forkserver] = {}


def run_with_address_space(args: Sequence[str], limit: int, timeout: float = DEFAULT_TIMEOUT_S) -> Outcome:
    """`python -m ckptctl ARGS` with at most `limit` bytes of address space (RLIMIT_AS, what `ulimit -v` and some
    schedulers set): forked by a server started under that limit, kept for later commands under the same one."""
    env = {**os.environ, "COLUMNS": "200"}
    with _lock:
        server = _servers_by_limit.get(limit)
        if server is None or not server.serves(env):
            if server is not None:
                server.close()
            server = _servers_by_limit[limit] = _Forkserver(env, limit)
        return server.run(args, env, timeout)


def run_in_environment(
    args: Sequence[str],
    env: dict[str, str],
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    reader_gone: bool = False,
) -> Outcome:
    """`python -m ckptctl ARGS` under exactly `env` (the whole environment, not additions to this process's), in
    `cwd`: forked by a server started under `env` and kept for later commands under the same environment, so
    that what Typer and rich read from the environment as they import (`COLUMNS`, `NO_COLOR`, `FORCE_COLOR`)
    is what a fresh interpreter under `env` would read. For tests that run a command at several widths or
    colour settings without paying for a fresh interpreter each time. `reader_gone`: see `_Forkserver.run`."""
    key = frozenset((k, v) for k, v in env.items() if k not in _PER_TEST_VARIABLES)
    with _lock:
        server = _servers_by_environment.get(key)
        if server is None or server.process.poll() is not None:
            server = _servers_by_environment[key] = _Forkserver(dict(env))
        return server.run(args, dict(env), timeout, None if cwd is None else os.fspath(cwd), reader_gone)
