"""`make bench`: every bench in bench/, at a size that finishes in about 10 minutes on 2 cores, then one table.

Each bench runs as a child (its own output passes through); the `RATIO {json}` lines that the verify,
diff, save and startup benches print are collected into the closing table: ours, the floor and the best peer (the
median seconds each bench measured, interleaved with ours in the same run), ours / floor, ours / peer, and
the target. The other benches print their own tables, which the closing one does not repeat.

The children run with bytecode caching on (`PYTHONDONTWRITEBYTECODE` unset, the cache under
`--pycache`): an installed ckptctl has its `.pyc` files, and compiling every module in every child would
be counted against ckptctl's commands and not against the peers' (torch ships compiled).

Then growth (issue 36): convert, verify, diff and the 2-rank save again at each of `--sizes` GB (default
0.25, 1 and 4), and a table of x floor and ours' peak RSS per size. Disk: the diff bench at S GB holds about
1.5 S GB, the others about 2 S GB, each removed before the next.

Usage: python bench/summary.py [--only verify,diff,save_peers] [--dir PATH] [--pycache PATH] [--sizes 0.25,1,4]
       [--growth-only]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Bench -> its arguments at `make bench` size, and the seconds after which it is stopped: 1035 in all.
BENCHES: dict[str, tuple[list[str], int]] = {
    "verify_throughput": (["--gb", "0.75", "--repeat", "3", "--core"], 140),
    "diff": (["--size-gib", "0.4", "--repeat", "3"], 100),
    "save_peers": (["--gb", "0.25", "--rounds", "4", "--ranks", "2"], 130),
    "save": (["--gb", "0.2", "--rounds", "3", "--ranks", "0"], 30),
    "convert": (["--layers", "2", "--width", "2048"], 60),
    "convert_zero": (["--stages", "2", "--layers", "2", "--hidden", "512", "--vocab", "8000"], 60),
    "list_inspect": (["--checkpoints", "100", "--tensors", "10000", "--repeat", "1", "--no-deepspeed"], 25),
    "scale": (["--layers", "2", "--width", "1024", "--ranks", "1", "2"], 55),
    "average": (["--inputs", "5", "--layers", "1", "--hidden", "512", "--vocab", "8000", "--dcp-width", "1024"], 150),
    "startup": (["--repeat", "10"], 45),
    "sync": (["--checkpoints", "5", "--mib", "64", "--repeat", "3"], 240),
}


#: Growth: the benches run again at each of `--sizes` GB (each argument list given the size), and seconds per GB
#: after which one is stopped (at least 240: building the inputs is most of a small run). Their RATIO lines give x floor and ours' peak RSS per size.
GROWTH: dict[str, tuple[list[str], str, int]] = {
    "convert": (["--layers", "4", "--cast-repeats", "0"], "--gb", 150),
    "verify_throughput": (["--repeat", "1", "--core", "--no-cold"], "--gb", 120),
    "diff": (["--repeat", "1"], "--size-gib", 150),
    "save_peers": (["--rounds", "2", "--ranks", "2"], "--gb", 300),
}
#: The largest size a growth bench runs at on a 24 GiB machine: the save bench's own process holds the state and
#: the peers' copies of it (at 4 GB its RSS reached 20 GiB and the kernel killed it), which ours does not.
GROWTH_MAX_GB = {"save_peers": 2.0}
DEFAULT_SIZES = "0.25,1,4"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}, load {load}"


def run(name: str, argv: list[str], limit: int, env: dict[str, str]) -> tuple[list[dict], str]:
    """Run one bench, echoing its output; its RATIO lines and how it ended."""
    print(f"\n===== bench/{name}.py {' '.join(argv)}", flush=True)
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,  # its children (ranks, timed commands) are stopped with it
    )
    stopped = threading.Event()

    def stop() -> None:
        stopped.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(limit, stop)
    timer.start()
    ratios = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            if line.startswith("RATIO "):
                ratios.append(json.loads(line[len("RATIO ") :]))
        code = proc.wait()
    finally:
        timer.cancel()
    if stopped.is_set():
        return ratios, f"stopped after {limit} s"
    seconds = time.perf_counter() - started
    return ratios, f"{seconds:.0f} s" + ("" if code == 0 else f", exit {code}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated bench names (default: all)")
    parser.add_argument("--pycache", default=os.path.join(tempfile.gettempdir(), "ckptctl-bench-pycache"))
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"GB sizes of the growth runs of {', '.join(GROWTH)} (default {DEFAULT_SIZES}; '' skips them)",
    )
    parser.add_argument("--growth-only", action="store_true", help="only the growth runs, not the table's benches")
    args = parser.parse_args()
    chosen = [n for n in BENCHES if (not args.only or n in args.only.split(",")) and not args.growth_only]
    sizes = [float(x) for x in args.sizes.split(",") if x]
    grown = [n for n in GROWTH if not args.only or n in args.only.split(",")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = args.pycache
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "ckptctl")], env=env, check=False)
    start_machine = machine()
    rows: list[dict] = []
    ended: dict[str, str] = {}
    for name in chosen:
        argv, limit = BENCHES[name]
        ratios, ended[name] = run(name, argv, limit, env)
        rows.extend(ratios)
    growth: dict[float, list[dict]] = {}
    for size in sizes:
        for name in grown:
            argv, size_option, per_gb = GROWTH[name]
            if size > GROWTH_MAX_GB.get(name, size):
                print(f"\n===== bench/{name}.py not run at {size:g} GB (more than {GROWTH_MAX_GB[name]:g} GB: memory)")
                continue
            ratios, ended[f"{name} {size:g} GB"] = run(
                name, [*argv, size_option, f"{size:g}"], max(240, int(per_gb * size)), env
            )
            growth.setdefault(size, []).extend(ratios)
    print(f"\n===== summary: {start_machine}; Python {platform.python_version()}")
    print("medians of interleaved runs; x floor = ours / floor, x peer = ours / best peer (lower is better)")
    head = f"{'what':<52}{'ours s':>8}{'floor':>20}{'x floor':>8}  {'best peer':<38}{'x peer':>7}  target"
    print(head)
    for r in rows:
        floor = f"{r['floor']} {r['floor_s']:.3f}"
        peer = f"{r['peer']} {r['peer_s']:.3f}" if r.get("peer") else "-"
        x_floor = r.get("ratio_floor", r["ours_s"] / r["floor_s"])
        x_peer = r.get("ratio_peer", r["ours_s"] / r["peer_s"]) if r.get("peer") else float("nan")
        print(
            f"{r['bench'] + ': ' + r['what']:<52}{r['ours_s']:>8.3f}{floor:>20}{x_floor:>8.2f}  {peer:<38}"
            f"{x_peer:>7.2f}  {r['target']}"
        )
    if growth:
        print_growth(growth)
    print("benches: " + ", ".join(f"{n} ({e})" for n, e in ended.items()))
    return 0


def print_growth(growth: dict[float, list[dict]]) -> None:
    """One row per measured thing: x floor and ours' peak RSS at each size (flat is the aim)."""
    sizes = sorted(growth)
    cells: dict[str, dict[float, str]] = {}
    for size in sizes:
        for r in growth[size]:
            x_floor = r.get("ratio_floor", r["ours_s"] / r["floor_s"])
            rss = f"{r['ours_rss'] / 2**20:.0f} MiB" if r.get("ours_rss") else "-"
            cells.setdefault(f"{r['bench']}: {r['what']}", {})[size] = f"{x_floor:.2f}x {rss}"
    print("\ngrowth: x floor and ours' peak RSS at each size (the floor of each row as in the table above;")
    print("'-': the bench does not measure that process's RSS: the save ranks are spawned by torch.multiprocessing)")
    print(f"{'what':<52}" + "".join(f"{f'{size:g} GB':>18}" for size in sizes))
    for what, by_size in cells.items():
        print(f"{what:<52}" + "".join(f"{by_size.get(size, 'not run'):>18}" for size in sizes))


if __name__ == "__main__":
    raise SystemExit(main())
