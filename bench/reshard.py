"""reshard ZeRO -> DeepSpeed universal against DeepSpeed's own `ds_to_universal.py` and against `cp -r`.

Writes, with real DeepSpeed on 2 CPU ranks (gloo, bf16, a torch AdamW, one training step), a save folder
per ZeRO stage (default 2 and 3) of a Llama built from a local config (`bench/convert_zero.py`'s writer;
default here: hidden 768, 6 layers, vocab 32000: ~100M parameters, each with an fp32 master and two fp32
moments in the partitions). Then, each in a fresh process, on a warm page cache, per stage:

  (r) `ckptctl reshard SAVE_DIR OUT --to deepspeed-universal` (streams every tensor from the partitions' raw
      bytes into torch.save archives written by hand, through a buffer of a few MiB, without importing torch
      or numpy; writes the digests file too),
  (r2) the same with `--workers 2` (two threads reading and writing parameters; for information),
  (u) `ds_to_universal.py --input_folder TAG --output_folder OUT/TAG --inject_missing_state` (DeepSpeed 0.19,
      run in-process after DeepSpeed is imported, with `--num_extract_workers 1 --num_merge_workers 1` so
      that its whole work is in the process measured: its worker pools would hold their memory in
      children `wait4` does not count; it loads each optim file whole and writes every fragment to a
      temporary folder before merging),
  (c) `cp -r TAG OUT`: the floor (the same bytes read and written once, in one process).

Reported for each: wall time of the whole process, the work time as the process measured it (ckptctl's JSON
`seconds`; ds_to_universal's `main` after imports; cp: its wall), and peak RSS (`os.wait4`, that child only).
Ratios (r)/(u) and (r)/(c). Afterwards the outputs of (r) and (u) are compared tensor by tensor (every
`zero/<param>/*.pt`; `optimizer_state.pt` apart from ZeRO-3's rank-0 flat partitions, which ckptctl leaves out).

Run it with bytecode caching on, as `bench/summary.py` runs its children (`PYTHONDONTWRITEBYTECODE` unset,
`PYTHONPYCACHEPREFIX` set, `python -m compileall ckptctl` first): an installed ckptctl has its `.pyc` files, as
torch and DeepSpeed in the virtualenv have theirs.

Usage: python bench/reshard.py [--stages 2,3] [--layers 6] [--hidden 768] [--vocab 32000] [--dir DIR] [--keep]
                               [--reuse]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_zero import (  # a sibling script
    MIB,
    REPO,
    Measured,
    add_checkpoint_options,
    ensure_checkpoints,
    measure,
    warm_tag,
)

#: ds_to_universal's `main`, after DeepSpeed and torch were imported (so that "work" is the conversion).
DS_TO_UNIVERSAL = """
import contextlib, json, sys, time, warnings
warnings.simplefilter("ignore")
import deepspeed, torch
from deepspeed.checkpoint.ds_to_universal import main, parse_arguments
tag, out = sys.argv[1:3]
sys.argv = ["ds_to_universal", "--input_folder", tag, "--output_folder", out, "--inject_missing_state",
            "--num_extract_workers", "1", "--num_merge_workers", "1"]
start = time.perf_counter()
with contextlib.redirect_stdout(sys.stderr):
    main(parse_arguments())
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def measure_cp(source: Path, out: Path) -> Measured:
    """`cp -r` in a process of its own: wall time (its work) and its peak RSS."""
    start = time.perf_counter()
    proc = subprocess.Popen(["cp", "-r", str(source), str(out)])
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit("cp -r failed")
    return Measured("cp -r TAG", wall, wall, usage.ru_maxrss * 1024)


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return repr(a) == repr(b)


def same_universal(ours: Path, theirs: Path, stage: int) -> tuple[bool, int]:
    """Whether two universal checkpoints hold the same files and, in each, the same values; and how many files."""
    import torch

    files = sorted(p.relative_to(theirs) for p in (theirs / "zero").rglob("*.pt"))
    if files != sorted(p.relative_to(ours) for p in (ours / "zero").rglob("*.pt")):
        return False, len(files)
    for rel in files:
        a = torch.load(theirs / rel, weights_only=False)  # files this bench wrote
        b = torch.load(ours / rel, weights_only=False)
        if stage == 3 and rel.name == "optimizer_state.pt":
            a.pop("fp32_flat_groups")
            a["optimizer_state_dict"]["state"] = {
                g: {"step": s["step"]} for g, s in a["optimizer_state_dict"]["state"].items()
            }
        if not _same(a, b):
            print(f"differs: {rel}")
            return False, len(files)
    return True, len(files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_options(parser, stages="2,3", hidden=768)
    args = parser.parse_args()
    stages = tuple(int(s) for s in args.stages.split(","))
    root = args.dir or Path(tempfile.mkdtemp(prefix="ckptctl-bench-reshard-", dir=REPO.parent))
    root.mkdir(parents=True, exist_ok=True)
    ok = True
    try:
        ensure_checkpoints(root, stages, args)
        python = sys.executable
        table = []
        for stage in stages:
            save_dir = root / f"zero{stage}"
            tag, files, total = warm_tag(save_dir)
            outs = {key: root / f"out-zero{stage}-{key}" for key in ("r", "r2", "u", "c")}
            for out in outs.values():
                shutil.rmtree(out, ignore_errors=True)
            os.sync()
            r = measure(
                "ckptctl reshard --to deepspeed-universal",
                [
                    python,
                    "-m",
                    "ckptctl",
                    "reshard",
                    str(save_dir),
                    str(outs["r"]),
                    "--to",
                    "deepspeed-universal",
                    "-q",
                    "--json",
                ],
            )
            os.sync()
            r2 = measure(
                "ckptctl reshard ... --workers 2",
                [
                    python,
                    "-m",
                    "ckptctl",
                    "reshard",
                    str(save_dir),
                    str(outs["r2"]),
                    "--to",
                    "deepspeed-universal",
                    "-q",
                    "--json",
                    "--workers",
                    "2",
                ],
            )
            os.sync()
            outs["u"].mkdir()
            u = measure(
                "ds_to_universal.py --inject_missing_state",
                [python, "-c", DS_TO_UNIVERSAL, str(tag), str(outs["u"] / tag.name)],
            )
            os.sync()
            c = measure_cp(tag, outs["c"])
            print(f"\nZeRO-{stage}: {tag.name}, {total / 2**20:.0f} MiB in {len(files)} files")
            print(f"{'':5}{'method':44}{'wall s':>9}{'work s':>9}{'peak RSS':>12}")
            for key, m in (("r", r), ("r2", r2), ("u", u), ("c", c)):
                print(f"({key}){' ' * (4 - len(key))}{m.label:44}{m.wall:9.2f}{m.work:9.2f}{m.peak_rss / MIB:9.0f} MiB")
            print(
                f"(r)/(u): wall {r.wall / u.wall:.2f}, work {r.work / u.work:.2f}, peak RSS {r.peak_rss / u.peak_rss:.2f}"
                f";  (r2)/(u): wall {r2.wall / u.wall:.2f}, work {r2.work / u.work:.2f}"
                f";  (r)/(c): wall {r.wall / c.wall:.2f}, peak RSS {r.peak_rss / c.peak_rss:.2f}"
            )
            table.append((stage, tag, outs))
        for stage, tag, outs in table:
            identical, count = same_universal(outs["r"] / tag.name, outs["u"] / tag.name, stage)
            ok = ok and identical
            print(f"ZeRO-{stage}: (r) and (u) hold the same values in {count} files: {identical}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
