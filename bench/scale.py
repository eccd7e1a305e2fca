"""convert and verify split over 1, 2 and 4 ranks on one host (`--workers N`, the torchrun code path).

Writes the 2-rank FSDP2 DCP checkpoint of bench/convert.py (model + AdamW state; with the defaults a
512 MiB model in a 1.5 GiB checkpoint), checks that the disk holds it and the outputs, reads it once
(warm page cache), then for each rank count N:

  convert: `ckptctl convert CKPT OUT --max-shard-size <one layer> --mapping none --workers N` (one output
           file per layer, shared between the ranks by bytes); the output must be byte-identical to the 1-rank output,
  verify:  `ckptctl verify OUT --workers N` (blake3 of every file against ckptctl-digests.json, the files
           shared between the ranks).

Reported per row: wall time of the whole command (interpreter, imports and the ranks' rendezvous
included), the work time convert reports (its JSON `seconds`, rank 0's), bytes/s overall and per rank
(convert: over its work time; verify: over the wall time), and the wall-time ratio to 1 rank. The host's load average is printed before and after: on a shared
machine the ratios mean little without it. Everything written is deleted at the end (unless --keep).

Usage: python bench/scale.py [--layers 8] [--width 4096] [--ranks 1 2 4] [--repeats 1] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
#: Most the bench may put on disk (checkpoint + one output at a time + the 1-rank reference output).
LIMIT = 6 << 30


def _run(argv: list[str]) -> tuple[float, dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, json.loads(done.stdout)


def _ckptctl(*args: str, ranks: int) -> list[str]:
    return [sys.executable, "-m", "ckptctl", *args, "--json", *(["--workers", str(ranks)] if ranks > 1 else [])]


def _warm(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(16 * MIB):
                    pass


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=1, help="runs per row (the median is reported)")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()

    layer_bytes = args.width * args.width * 4
    model_bytes = args.layers * layer_bytes
    need = 3 * model_bytes + 2 * model_bytes  # checkpoint (model + 2 AdamW moments), two outputs
    root = args.dir or Path(tempfile.mkdtemp(prefix="ckptctl-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if need > min(LIMIT, free - (1 << 30)):
        raise SystemExit(f"needs {need / 2**30:.1f} GiB in {root}: {free / 2**30:.1f} GiB free, limit 6 GiB")
    ckpt = root / "dcp"
    try:
        if not (ckpt / ".metadata").exists():
            subprocess.run(
                [
                    *(sys.executable, str(REPO / "bench" / "convert.py"), "--generate", str(ckpt)),
                    *("--layers", str(args.layers), "--width", str(args.width)),
                ],
                check=True,
                cwd=REPO,
            )
        _warm(ckpt)
        print(
            f"checkpoint: {ckpt} ({model_bytes / MIB:.0f} MiB of model in {args.layers} layers), cores {os.cpu_count()}"
        )
        print(f"load average before: {_load()}")
        rows: list[tuple[str, int, float, float | None, int]] = []
        reference = root / "out-1"
        for ranks in sorted(args.ranks):
            out = reference if ranks == 1 else root / f"out-{ranks}"
            walls, works = [], []
            for _ in range(args.repeats):
                shutil.rmtree(out, ignore_errors=True)
                subprocess.run(["sync"], check=False)
                wall, doc = _run(
                    _ckptctl(
                        *("convert", str(ckpt), str(out), "--max-shard-size", str(layer_bytes), "--mapping", "none"),
                        ranks=ranks,
                    )
                )
                walls.append(wall)
                works.append(float(doc["seconds"]))  # type: ignore[arg-type]
            rows.append(("convert", ranks, statistics.median(walls), statistics.median(works), model_bytes))
            if ranks != 1:
                same = all(
                    filecmp.cmp(reference / name, out / name, shallow=False)
                    for name in os.listdir(reference)
                    if name.endswith(".safetensors")
                )
                if not same:
                    raise SystemExit(f"the {ranks}-rank output differs from the 1-rank output")
            walls = []
            for _ in range(args.repeats):
                wall, doc = _run(_ckptctl("verify", str(out), ranks=ranks))
                if not doc["ok"]:
                    raise SystemExit(f"verify of {out} failed: {doc}")
                walls.append(wall)
            rows.append(("verify", ranks, statistics.median(walls), None, model_bytes))
            if ranks != 1:
                shutil.rmtree(out)
        print(f"load average after: {_load()}")
        print()
        print(
            f"{'command':8} {'ranks':>5} {'wall s':>8} {'work s':>8} {'MiB/s':>8} {'MiB/s/rank':>10} {'wall/1 rank':>11}"
        )
        base = {cmd: wall for cmd, ranks, wall, _, _ in rows if ranks == 1}
        for cmd, ranks, wall, work, nbytes in rows:
            rate = nbytes / (work or wall) / MIB  # convert: its own work time; verify: the whole command
            ratio = f"{wall / base[cmd]:.2f}" if cmd in base else "-"
            shown = f"{work:.2f}" if work is not None else "-"
            print(f"{cmd:8} {ranks:>5} {wall:>8.2f} {shown:>8} {rate:>8.0f} {rate / ranks:>10.0f} {ratio:>11}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
