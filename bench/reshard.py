"""reshard ZeRO -> DeepSpeed universal against DeepSpeed's own `ds_to_universal.py` and against `cp -r`; and
ZeRO -> DCP (`--to dcp`), then that DCP folder -> DCP, against `cp -r` and the streaming bound.

Writes, with real DeepSpeed on 2 CPU ranks (gloo, bf16, a torch AdamW, one training step), a save folder
per ZeRO stage (default 2 and 3) of a Llama built from a local config (`bench/convert_zero.py`'s writer;
default here: hidden 768, 6 layers, vocab 32000: ~100M parameters, each with an fp32 master and two fp32
moments in the partitions). Then, each in a fresh process, on a warm page cache, per stage:

  (r) `ckptctl reshard SAVE_DIR OUT --to deepspeed-universal` (streams every tensor from the partitions' raw
      bytes into torch.save archives written by hand, through a buffer of a few MiB, without importing torch
      or numpy; writes the digests file too),
  (r2) the same with `--threads 2` (two threads reading and writing parameters; for information),
  (u) `ds_to_universal.py --input_folder TAG --output_folder OUT/TAG --inject_missing_state` (DeepSpeed 0.19,
      run in-process after DeepSpeed is imported, with `--num_extract_workers 1 --num_merge_workers 1` so
      that its whole work is in the process measured: its worker pools would hold their memory in
      children `wait4` does not count; it loads each optim file whole and writes every fragment to a
      temporary folder before merging),
  (c) `cp -r TAG OUT`: the floor (the same bytes read and written once, in one process),
  (d) `ckptctl reshard SAVE_DIR OUT --to dcp` (the state as `get_state_dict` gives it, written by torch's own
      DCP writer a tensor at a time, each read from the partitions when its write item comes up),
  (d2) `ckptctl reshard OUT(d) OUT --to dcp` (DCP -> DCP),
  (i) `import torch, ckptctl.cli.app` alone: what (d) and (d2) hold before any work.

Reported for each: wall time of the whole process, the work time as the process measured it (ckptctl's JSON
`seconds`; ds_to_universal's `main` after imports; cp: its wall), and peak RSS (`os.wait4`, that child only).
Ratios (r)/(u), (r)/(c), (d)/(c). The peak RSS of (d) and (d2) is set against issue 24's bound for a
streaming reshard: the largest parameter's full optimizer row (fp32 param + exp_avg + exp_avg_sq, read from
(d)'s `.metadata` after every measurement) + 300 MiB. Afterwards the outputs of (r) and (u) are compared
tensor by tensor (every `zero/<param>/*.pt`; `optimizer_state.pt` apart from ZeRO-3's rank-0 flat partitions,
which ckptctl leaves out).

Run it with bytecode caching on, as `bench/summary.py` runs its children (`PYTHONDONTWRITEBYTECODE` unset,
`PYTHONPYCACHEPREFIX` set, `python -m compileall ckptctl` first): an installed ckptctl has its `.pyc` files, as
torch and DeepSpeed in the virtualenv have theirs.

Usage: python bench/reshard.py [--stages 2,3] [--layers 6] [--hidden 768] [--vocab 32000] [--dir DIR] [--keep]
                               [--reuse] [--targets universal,dcp]
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


#: Issue 24's allowance beyond the largest optimizer row for a streaming `reshard`.
ROW_ALLOWANCE = 300 * MIB
IMPORTS = "import json, torch, ckptctl.cli.app; print(json.dumps({'seconds': 0}))"


def reshard_argv(source: Path, out: Path, target: str) -> list[str]:
    return [sys.executable, "-m", "ckptctl", "reshard", str(source), str(out), "--to", target, "-q", "--json"]


def largest_row(dcp_folder: Path) -> tuple[str, int]:
    """The parameter of a `get_state_dict` DCP folder whose tensors (the parameter and its optimizer state)
    hold the most bytes, and those bytes."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(dcp_folder)).read_metadata()
    paths = metadata.planner_data or {}
    rows: dict[str, int] = {}
    for key, meta in metadata.state_dict_metadata.items():
        path = paths.get(key, ())
        size = getattr(meta, "size", None)
        if size is None or len(path) < 2:
            continue
        name = path[1] if path[0] == "model" else path[2] if path[:2] == ("optim", "state") else None
        if name is not None:
            rows[name] = rows.get(name, 0) + size.numel() * torch.empty((), dtype=meta.properties.dtype).element_size()
    name = max(rows, key=lambda n: rows[n])
    return name, rows[name]


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


def measure_to_dcp(save_dir: Path, tag: Path, total: int, outs: dict[str, Path]) -> tuple[Measured, Measured]:
    """(d), (d2), (i) and `cp -r` of the tag and of (d)'s output, printed as a table; (d) and (d2) returned."""
    os.sync()
    d = measure("ckptctl reshard --to dcp", reshard_argv(save_dir, outs["d"], "dcp"))
    os.sync()
    d2 = measure("ckptctl reshard DCP --to dcp", reshard_argv(outs["d"], outs["d2"], "dcp"))
    imports = measure("import torch, ckptctl.cli.app", [sys.executable, "-c", IMPORTS])
    os.sync()
    c = measure_cp(tag, outs["c"])
    shutil.rmtree(outs["c"])
    os.sync()
    cd = measure_cp(outs["d"], outs["cd"])
    dcp_bytes = sum(f.stat().st_size for f in outs["d"].iterdir())
    print(f"\n{tag.name} ({total / 2**20:.0f} MiB) --to dcp: {dcp_bytes / 2**20:.0f} MiB of DCP files")
    print(f"{'':5}{'method':44}{'wall s':>9}{'work s':>9}{'peak RSS':>12}")
    for key, m in (("d", d), ("d2", d2), ("i", imports), ("c", c), ("cd", cd)):
        label = "cp -r DCP(d)" if key == "cd" else m.label
        print(f"({key}){' ' * (4 - len(key))}{label:44}{m.wall:9.2f}{m.work:9.2f}{m.peak_rss / MIB:9.0f} MiB")
    print(f"(d)/(c): wall {d.wall / c.wall:.2f};  (d2)/(cd): wall {d2.wall / cd.wall:.2f}")
    return d, d2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_options(parser, stages="2,3", hidden=768)
    parser.add_argument(
        "--targets", default="universal,dcp", help="what to reshard to: universal, dcp or both (default both)"
    )
    args = parser.parse_args()
    targets = set(args.targets.split(","))
    stages = tuple(int(s) for s in args.stages.split(","))
    root = args.dir or Path(tempfile.mkdtemp(prefix="ckptctl-bench-reshard-", dir=REPO.parent))
    root.mkdir(parents=True, exist_ok=True)
    ok = True
    try:
        ensure_checkpoints(root, stages, args)
        python = sys.executable
        table = []
        to_dcp = []
        for stage in stages:
            save_dir = root / f"zero{stage}"
            tag, files, total = warm_tag(save_dir)
            outs = {key: root / f"out-zero{stage}-{key}" for key in ("r", "r2", "u", "c", "d", "d2", "cd")}
            for out in outs.values():
                shutil.rmtree(out, ignore_errors=True)
            if "dcp" in targets:
                to_dcp.append((stage, outs["d"], measure_to_dcp(save_dir, tag, total, outs)))
            if "universal" not in targets:
                continue
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
                "ckptctl reshard ... --threads 2",
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
                    "--threads",
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
        for stage, dcp_out, (d, d2) in to_dcp:
            name, row = largest_row(dcp_out)
            bound = row + ROW_ALLOWANCE
            within = d.peak_rss <= bound and d2.peak_rss <= bound
            ok = ok and within
            print(
                f"ZeRO-{stage} --to dcp: peak RSS (d) {d.peak_rss / MIB:.0f} MiB, (d2) {d2.peak_rss / MIB:.0f} MiB; "
                f"largest row {name} {row / MIB:.0f} MiB + 300 MiB = {bound / MIB:.0f} MiB: "
                f"{'within' if within else 'OVER'}"
            )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
