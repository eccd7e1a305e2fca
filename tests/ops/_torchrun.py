"""`torchrun ARGS` (torch's own launcher, `torch.distributed.run`) in a process forked from the writers'
pre-imported server (`tests.writers.ranks.run_ranks`) rather than a fresh interpreter: the launcher imports
torch before it starts anything (~1.8 CPU-s a launch), and the server has it imported.

Only the launcher is forked: the ranks it starts are what a real `torchrun` starts, fresh interpreters running
`python -m MODULE` (`subprocess.Popen`), with the launcher's environment, working folder and streams, which
are the caller's: `launch` returns what `subprocess.run(capture_output=True, text=True)` of
`python -m torch.distributed.run ARGS` returns, exit code included (1 after an exception, its traceback on
stderr; a `SystemExit`'s code).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

__all__ = ["launch"]


def launch(args: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """`torchrun ARGS` under `env` (the whole environment) in `cwd`; past `timeout` seconds the launcher and
    its ranks are killed and `subprocess.TimeoutExpired` raised, as `subprocess.run` does."""
    from tests.writers.ranks import run_ranks

    with tempfile.TemporaryDirectory(prefix="ckptctl-torchrun-") as folder:
        stdout, stderr = Path(folder, "stdout"), Path(folder, "stderr")
        context = run_ranks(_launcher, (args, env, str(cwd), str(stdout), str(stderr)), 1, join=False)
        process = context.processes[0]
        process.join(timeout)
        if process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the launcher's session: it and its ranks
            process.join()
            raise subprocess.TimeoutExpired(["torchrun", *args], timeout, stdout.read_text(), stderr.read_text())
        return subprocess.CompletedProcess(
            ["torchrun", *args], process.exitcode, stdout.read_text(), stderr.read_text()
        )


def _launcher(rank: int, args: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """What `python -m torch.distributed.run ARGS` does, in a session of its own (for `launch` to end at once
    on a timeout), its streams the files `stdout` and `stderr`."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    with open(stdout, "w") as out, open(stderr, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    code: int | str | None = 0
    try:
        from torch.distributed import run

        sys.argv = [run.__file__, *args]
        run.main(args)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # as the interpreter ends on an uncaught exception
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(code)
