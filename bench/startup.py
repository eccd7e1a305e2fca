"""A command's fixed cost: `ckptctl verify FILE`, `ckptctl list RUN` and `ckptctl --help` against Python's own
start-up (`python -c pass`, the floor every Python command pays), in one run (DESIGN §5: a command's fixed cost
<= 0.2 s over Python's start-up).

The inputs are small, so that what is measured is the start: FILE is a one-tensor safetensors file (written by
`safetensors.numpy`), RUN three checkpoints of a tiny model written by `CheckpointManager` (in a child: this
process never imports torch). Each command runs as a child process, all commands in turn round after round
(interleaved, so that a noisy machine's drift falls on each alike), after one warm-up round that is not counted;
medians are printed: wall seconds, CPU seconds (user + system, which a busy machine inflates less), ours / floor,
and the fixed cost (ours - floor, the target's figure). One run of each command under `python -X importtime`
then counts the modules it imports and sums their import time (the least of three runs).

The children write and read bytecode (`PYTHONDONTWRITEBYTECODE` unset, the cache under `--pycache`), as an
installed ckptctl has its `.pyc` files; without them every ckptctl module would be compiled in every run.

Usage: python bench/startup.py [--repeat 10] [--pycache DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The fixed cost a command may add to Python's own start-up (DESIGN §5), seconds.
TARGET_S = 0.2


@dataclass(frozen=True)
class Run:
    wall: float
    cpu: float


def environment(pycache: str) -> dict[str, str]:
    """The children's environment: this checkout first on the path, bytecode cached under `pycache`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = pycache
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def run_child(argv: Sequence[str], env: dict[str, str]) -> Run:
    """Wall and CPU seconds of a child that must succeed (its output is read and thrown away)."""
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own rusage
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            out.seek(0)
            raise SystemExit(f"{' '.join(argv)} failed: {out.read().decode()[-2000:]}")
    return Run(wall, usage.ru_utime + usage.ru_stime)


def imports(argv: Sequence[str], env: dict[str, str], runs: int = 3) -> tuple[int, float]:
    """The modules a command imports and the seconds their imports took (`-X importtime`: the sum of the
    cumulative times of the imports made at the top level, which contain the others; the least of `runs`)."""
    found: list[re.Match[str]] = []
    seconds = []
    for _ in range(runs):
        proc = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], capture_output=True, text=True, env=env)
        rows = [re.match(r"import time:\s+\d+ \|\s+(\d+) \| ( *)\S", line) for line in proc.stderr.splitlines()]
        found = [m for m in rows if m]
        seconds.append(sum(int(m.group(1)) for m in found if not m.group(2)) / 1e6)
    return len(found), min(seconds)


def build_run(folder: Path) -> None:
    """Three checkpoints of a tiny model, written by the core (run in a child: it imports torch)."""
    import torch

    from ckptctl.core import CheckpointManager

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(str(folder))
    for step in (100, 200, 300):
        manager.save(step, {"model": model, "optimizer": optimizer})


def ratio(what: str, ours: float, floor: float) -> None:
    """A line bench/summary.py collects into `make bench`'s table (medians)."""
    line = {"bench": "startup", "what": what, "ours_s": ours, "floor": "python -c pass", "floor_s": floor}
    print("RATIO " + json.dumps(line | {"target": f"<= floor + {TARGET_S} s"}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10, help="interleaved runs of each command (medians shown)")
    parser.add_argument("--pycache", default=os.path.join(tempfile.gettempdir(), "ckptctl-bench-pycache"))
    parser.add_argument("--build-run", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_run is not None:
        build_run(Path(args.build_run))
        return 0

    import numpy as np
    from safetensors.numpy import save_file

    env = environment(args.pycache)
    root = Path(tempfile.mkdtemp(prefix="ckptctl-startup-bench-"))
    try:
        weights = root / "model.safetensors"
        save_file({"weight": np.arange(16, dtype=np.float32).reshape(4, 4)}, str(weights))
        run = root / "run"
        subprocess.run([sys.executable, __file__, "--build-run", str(run)], check=True, env=env)
        ckptctl = [sys.executable, "-m", "ckptctl"]
        commands = {
            "python -c pass (the floor)": [sys.executable, "-c", "pass"],
            "ckptctl verify FILE": [*ckptctl, "verify", str(weights)],
            "ckptctl list RUN": [*ckptctl, "list", str(run)],
            "ckptctl --help": [*ckptctl, "--help"],
        }
        floor_label = next(iter(commands))
        runs: dict[str, list[Run]] = {label: [] for label in commands}
        for round_ in range(args.repeat + 1):  # the first round fills the bytecode and page caches
            for label, argv in commands.items():
                measured = run_child(argv, env)
                if round_:
                    runs[label].append(measured)
        wall = {label: statistics.median(r.wall for r in rs) for label, rs in runs.items()}
        cpu = {label: statistics.median(r.cpu for r in rs) for label, rs in runs.items()}
        print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
        print(f"medians of {args.repeat} interleaved runs; fixed cost = ours - floor (target <= {TARGET_S} s)")
        print(
            f"{'command':<28}{'wall s':>8}{'x floor':>8}{'cost s':>8}{'cpu s':>8}{'x floor':>8}{'modules':>9}{'import s':>9}"
        )
        for label, argv in commands.items():
            count, seconds = imports(argv, env)
            print(
                f"{label:<28}{wall[label]:>8.3f}{wall[label] / wall[floor_label]:>8.2f}"
                f"{wall[label] - wall[floor_label]:>8.3f}{cpu[label]:>8.3f}{cpu[label] / cpu[floor_label]:>8.2f}"
                f"{count:>9}{seconds:>9.3f}"
            )
        for label in list(commands)[1:]:
            ratio(label, wall[label], wall[floor_label])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
