"""Every verify mode against `cat` of the same files, warm and cold, with its peak memory, in one run.

Builds a torch DCP checkpoint with `dcp.save` (FileSystemWriter, 2 writer threads: 2 `.distcp` files, as
2 ranks write) of `--gb` GB of fp32 tensors (64 MiB each, plus 256 small ones, as a model's norms and biases
are), then runs each mode as a `ckptctl verify` child process and reports the median of `--repeat` runs,
all modes in turn round after round (interleaved, so a noisy machine's drift falls on every mode alike):

- `cat FILES > /dev/null`: the read floor (the peer every ratio is against);
- `sha256sum FILES`: the tool people reach for (DESIGN §5: digest verify >= 8x faster);
- `--quick`: structure only;
- plain verify without a manifest: the CRC-32 of every zip record (every DCP item is a torch.save zip);
  also as 2 ranks (`--workers 2`: the items shared by bytes, each rank reading its share; its peak RSS is
  the largest rank's);
- `--deep` and `--deep --check-finite` (without a manifest: CRC-32s as well);
- `--write-manifest` (blake3 of every file and CRC-32s, one pass), then plain verify with the manifest
  (digests) and `--deep` with it.

Warm: the page cache holds the files (cat'ed before). Cold: `posix_fadvise(DONTNEED)` drops the files'
pages before each run (no root needed; a note is printed if it had no effect). Peak RSS is the child's
`ru_maxrss` (it includes the ~20 MiB of this script's own interpreter, which a forked child starts with). Targets (issue 14): every mode <= 1.5x cat, warm and cold; peak RSS < 300 MiB at any size.

Usage: python bench/verify_throughput.py [--gb 1] [--repeat 3] [--dir DIR] [--no-cold]
The acceptance run is on >= 4 GB:  python bench/verify_throughput.py --gb 4.5 --dir /path/on/the/disk
(it needs --gb of free disk and memory for the page cache; the folder is deleted afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The children's environment: this checkout first on the path (then whatever the caller set).
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
TENSOR_ELEMENTS = 16 << 20  # 64 MiB of fp32
SMALL_TENSORS = 256


def build_checkpoint(folder: Path, gb: float) -> None:
    """A DCP save of about `gb` GB; memory stays at 256 MiB (tensors are views that DCP copies one by one)."""
    import torch
    import torch.distributed.checkpoint as dcp

    generator = torch.Generator().manual_seed(0)
    base = torch.randn(4, TENSOR_ELEMENTS, generator=generator)
    big = max(1, round(gb * 1e9 / (TENSOR_ELEMENTS * 4)))
    # Views of a larger storage: DCP's writer clones each before writing it, so only one copy is alive.
    state = {f"model.layers.{i}.weight": base[i % 4] for i in range(big)}
    state |= {f"model.layers.{i}.norm": torch.randn(4096, generator=generator) for i in range(SMALL_TENSORS)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder), thread_count=2))


@dataclass(frozen=True)
class Measure:
    seconds: float  # the child's wall time, start to exit
    peak_mib: float  # its peak RSS
    work: float | None = None  # the verify call alone (in-process children), imports excluded


def run_child(argv: Sequence[str]) -> Measure:
    """Wall time and peak RSS of a child process that must succeed; `work` if it prints its own time."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=ENV)
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own rusage (communicate() would lose it)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited with {proc.returncode}: {err.read().decode()[-2000:]}")
        text = out.read().decode().strip()
    work = float(text.rsplit(None, 1)[-1]) if text.startswith("work") else None
    return Measure(seconds, usage.ru_maxrss / 1024, work)


def drop_cache(files: Sequence[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def ratio(what: str, ours: float, floor: float, peer: float, peer_name: str, target: str, peak_mib: float) -> None:
    """A line bench/summary.py collects into `make bench`'s table (medians; `ours_rss`: the command's peak RSS)."""
    line = {
        "bench": "verify",
        "what": what,
        "ours_s": ours,
        "floor": "cat",
        "floor_s": floor,
        "ours_rss": peak_mib * 2**20,
    }
    print("RATIO " + json.dumps(line | {"peer": peer_name, "peer_s": peer, "target": target}))


def prepare(cold: bool, files: Sequence[Path], before: Sequence[Path] = ()) -> None:
    """Before a run: `before` deleted, then the cache dropped (cold) or filled (warm)."""
    for path in before:
        path.unlink(missing_ok=True)
    if cold:
        drop_cache(files)
    else:
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)


def median(runs: Sequence[Measure]) -> Measure:
    """The median run's time (and work), the largest peak: the figure to quote on a noisy machine."""
    works = [r.work for r in runs if r.work is not None]
    return Measure(
        statistics.median(r.seconds for r in runs),
        max(r.peak_mib for r in runs),
        statistics.median(works) if works else None,
    )


def verify_in_process(folder: str, flags: Sequence[str]) -> None:
    """A child that imports what verify needs, then times the verify call alone and prints `work SECONDS`.

    Imported before the clock: what a verify imports on first use too (the layouts' readers, which detection
    imports one by one until one claims the folder: DCP's is the 9th; zlib-ng; the deep read's locator),
    about 35 ms of a 0.75 GB call's ~100 on 2 cores; `command` counts them. Nothing is read before the clock.
    """
    from ckptctl.formats import raw_chunks  # noqa: F401  (--deep's locator)
    from ckptctl.formats.torch_zip import crc32_function
    from ckptctl.layouts.registry import all_layouts
    from ckptctl.ops.content import check_content  # noqa: F401
    from ckptctl.ops.verification import VerifyOptions, verify_path

    all_layouts()
    crc32_function()

    options = VerifyOptions(
        quick="--quick" in flags,
        deep="--deep" in flags,
        check_finite="--check-finite" in flags,
        write_manifest="--write-manifest" in flags,
    )
    start = time.perf_counter()
    report = verify_path(folder, options)
    seconds = time.perf_counter() - start
    if not report.ok:
        raise SystemExit(f"verify failed: {report.to_json()}")
    print(f"work {seconds:.4f}")


def _flags(flags: Sequence[str]) -> str:
    return "--verify-flags=" + ",".join(f.removeprefix("--") for f in flags)


#: Mode label -> verify flags; None for the peers (cat, sha256sum).
MODES: dict[str, tuple[str, ...] | None] = {
    "cat > /dev/null (the read floor)": None,
    "sha256sum": None,
    "verify --quick (structure)": ("--quick",),
    "verify, no manifest (CRC-32s)": (),
    "verify --workers 2, no manifest (2 ranks)": ("--workers", "2"),
    "verify --deep (CRC-32s, tensors)": ("--deep",),
    "verify --deep --check-finite": ("--deep", "--check-finite"),
    "verify --write-manifest (blake3 + CRC-32s)": ("--write-manifest",),
    "verify with manifest (digests)": (),
    "verify --deep with manifest": ("--deep",),
}
WRITE = "verify --write-manifest (blake3 + CRC-32s)"
#: The modes `--core` keeps: the floor, the peer, and the modes of the closing table.
CORE_MODES = (
    "cat > /dev/null (the read floor)",
    "sha256sum",
    "verify, no manifest (CRC-32s)",
    "verify --deep (CRC-32s, tensors)",
    "verify with manifest (digests)",
)
WITH_MANIFEST = ("verify with manifest (digests)", "verify --deep with manifest")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (>= 4 for the acceptance run)")
    parser.add_argument(
        "--repeat", type=int, default=3, help="interleaved runs per mode and cache state (medians shown)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where to build the checkpoint (default: a temp dir)")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache runs")
    parser.add_argument(
        "--core",
        action="store_true",
        help="only cat, sha256sum, plain verify, --deep and verify with a manifest (make bench's size)",
    )
    parser.add_argument("--build-into", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--verify-in-process", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--verify-flags", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.core:
        for label in [label for label in MODES if label not in CORE_MODES]:
            del MODES[label]
    if args.build_into is not None:  # the child that writes the checkpoint (see below)
        build_checkpoint(args.build_into, args.gb)
        return 0
    if args.verify_in_process is not None:
        verify_in_process(args.verify_in_process, [f"--{f}" for f in args.verify_flags.split(",") if f])
        return 0

    root = Path(tempfile.mkdtemp(prefix="ckptctl-verify-bench-", dir=args.dir))
    folder = root / "step-1"
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    crc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from ckptctl.formats.torch_zip import crc32_function; print(crc32_function().__module__)",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        check=True,
    ).stdout.strip()
    print(f"CRC-32 by: {crc}")
    try:
        # Written by a child: this process stays small, and children forked from it start with its memory
        # counted in their peak RSS (ru_maxrss survives exec), so it must not hold torch.
        subprocess.run([sys.executable, __file__, "--gb", str(args.gb), "--build-into", str(folder)], check=True)
        files = sorted(p for p in folder.iterdir() if p.is_file())
        total = sum(p.stat().st_size for p in files)
        digests = folder / "ckptctl-digests.json"
        states = ["warm"] if args.no_cold else ["warm", "cold"]
        cli = [sys.executable, "-m", "ckptctl", "verify", str(folder), "--json"]
        lib = [sys.executable, __file__, f"--verify-in-process={folder}"]
        peers = {
            "cat > /dev/null (the read floor)": ["sh", "-c", 'cat "$@" > /dev/null', "cat", *map(str, files)],
            "sha256sum": ["sha256sum", *map(str, files)],
        }
        # Every run of every mode in turn, round after round (A B C ... A B C ...): a drift of the machine's
        # speed (other processes on a shared machine) falls on every mode alike, and medians are quoted.
        # Runs without a manifest delete it first; the manifest is written before the runs that use it.
        jobs: list[tuple[str, str, str, list[str], tuple[Path, ...]]] = []  # label, state, kind, argv, delete
        for label, flags in MODES.items():
            for state in states:
                if flags is None:
                    jobs.append((label, state, "command", peers[label], ()))
                    continue
                gone = (digests,) if label not in WITH_MANIFEST else ()
                jobs.append((label, state, "command", [*cli, *flags], gone))
                if "--workers" not in flags:  # the ranks are processes of their own: only the command is timed
                    jobs.append((label, state, "call", [*lib, _flags(flags)], gone))
        runs: dict[tuple[str, str, str], list[Measure]] = {}
        for _ in range(args.repeat):
            for label, state, kind, argv, gone in jobs:
                if label in WITH_MANIFEST and not digests.exists():
                    run_child([*cli, "--write-manifest"])
                prepare(state == "cold", files, gone)
                runs.setdefault((label, state, kind), []).append(run_child(argv))
        results: dict[tuple[str, str], tuple[Measure, Measure | None]] = {}
        for label in MODES:
            for state in states:
                call = runs.get((label, state, "call"))
                results[(label, state)] = (median(runs[(label, state, "command")]), median(call) if call else None)

        print(
            f"checkpoint: {total / 1e9:.2f} GB in {len(files)} files (torch DCP: "
            f"{sum(1 for f in files if f.suffix == '.distcp')} .distcp and .metadata), medians of {args.repeat} interleaved runs.\n"
            "command: `ckptctl verify` end to end (process start and imports included); call: the verify call "
            "alone in a child that imported ckptctl first; x cat: seconds / seconds of cat in the same cache state; "
            "MiB: the child's peak RSS"
        )
        head = f"{'mode':<44}"
        for s in states:
            head += f"{s + ' cmd s':>13}{'x cat':>7}{'call s':>8}{'x cat':>7}{'GB/s':>7}{'MiB':>6}"
        print(head)
        floor = {s: results[(next(iter(peers)), s)][0].seconds for s in states}
        for label in MODES:
            row = f"{label:<44}"
            for s in states:
                command, call = results[(label, s)]
                work = call.work if call is not None and call.work is not None else command.seconds
                peak = max(command.peak_mib, call.peak_mib if call is not None else 0)
                row += f"{command.seconds:>13.2f}{command.seconds / floor[s]:>7.2f}"
                row += f"{work:>8.2f}{work / floor[s]:>7.2f}{total / 1e9 / work:>7.2f}{peak:>6.0f}"
            print(row)
        for s in states:
            sha = results[("sha256sum", s)][0].seconds / results[("verify with manifest (digests)", s)][0].seconds
            print(f"verify with manifest (command) is {sha:.1f}x faster than sha256sum ({s}; DESIGN target >= 8x)")
        if "cold" in states and floor["cold"] < 1.3 * floor["warm"]:
            print("note: cold cat is about as fast as warm cat: posix_fadvise(DONTNEED) may not have dropped the cache")
        quick = subprocess.run(
            [*cli, "--quick"], capture_output=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
        structural = json.loads(quick.stdout)["bytes_read"]
        print(f"verify --quick read {structural} bytes = {100 * structural / total:.4f}% of the checkpoint")
        for label, short in (
            ("verify, no manifest (CRC-32s)", "verify (CRC-32s)"),
            ("verify --deep (CRC-32s, tensors)", "verify --deep"),
            ("verify with manifest (digests)", "verify with manifest"),
        ):
            for s in states:
                command, call = results[(label, s)]
                sha = results[("sha256sum", s)][0].seconds
                target = "<= 1.5x cat" if s == "warm" else "<= 1.2x cat"
                if call is not None and call.work is not None:
                    ratio(f"{short}, {s} (call)", call.work, floor[s], sha, "sha256sum", target, call.peak_mib)
                if s == "warm":  # the command adds the interpreter's start and imports: a fixed cost
                    ratio(f"{short}, {s} (command)", command.seconds, floor[s], sha, "sha256sum", "-", command.peak_mib)
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
