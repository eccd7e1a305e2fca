"""`python -m torch.distributed.run ... -m tests.ops._commands_in_ranks SPEC.json OUT`: several `ckptctl` commands
run one after another by the same ranks, which join one gloo group for the first and leave it after the last.

A job's start-up (a launcher and two ranks, each importing torch: ~5 CPU-s) costs more than the small commands
test_distributed_work runs in it; one job for several commands checks each the same way for one start-up.

SPEC.json maps a name to a command's arguments. Each rank writes its stdout and stderr of the command NAME to
OUT/NAME.RANK.out and OUT/NAME.RANK.err and, once every command ended, the exit codes to OUT/codes.RANK.json;
once it left the group, the names of its threads still running to OUT/threads.RANK.json (null without /proc).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from ckptctl.cli import ranks
from ckptctl.cli.app import main
from ckptctl.ops.distributed_work import leave


def run(args: list[str], out: Path, err: Path) -> int:
    """`ckptctl ARGS` through `main`, the error boundary `python -m ckptctl` has, its streams in files."""
    with (
        out.open("w") as stdout,
        err.open("w") as stderr,
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        try:
            main(args)
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return 0


spec: dict[str, list[str]] = json.loads(Path(sys.argv[1]).read_text())
folder, rank = Path(sys.argv[2]), os.environ["RANK"]
# A command leaves the group when it ends; a second `init_process_group` in the same job would wait on the
# first one's rendezvous keys. Kept until the last command ended, the group is joined once (`join` reuses it).
ranks.leave = lambda: None  # type: ignore[assignment]
codes = {name: run(args, folder / f"{name}.{rank}.out", folder / f"{name}.{rank}.err") for name, args in spec.items()}
(folder / f"codes.{rank}.json").write_text(json.dumps(codes))
leave()
tasks = Path("/proc/self/task")
threads = sorted((task / "comm").read_text().strip() for task in tasks.iterdir()) if tasks.is_dir() else None
(folder / f"threads.{rank}.json").write_text(json.dumps(threads))
