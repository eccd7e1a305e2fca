"""convert DCP→HF against torch's own ways of doing it, measured side by side in one run.

Writes a 2-rank FSDP2 DCP checkpoint (gloo, CPU) of a few big Linear layers plus AdamW state (exp_avg,
exp_avg_sq): with the defaults 1 GiB of fp32 weights and 2 GiB of optimizer state. Then, each in a fresh
process, on a warm page cache (every source file is read once before the first measurement):

  (a) `ckptctl convert CKPT OUT --to hf --mapping none` (a stack of Linear layers has no transformers config:
      its names are written as stored; streams raw bytes; fsyncs and re-reads its output to verify it),
  (a') the same with `--dtype bf16` (cast block by block while streaming): after the table, (a) and (a')
      run alternately `--cast-repeats` more times and the medians give the cast's cost (target <= 1.2x
      the plain conversion, peak RSS < 200 MiB); its output equals torch's `.to(torch.bfloat16)` of (a)'s,
  (b) `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` to a .pt, `torch.load` of it, and
      `safetensors.torch.save_file` of the model entries,
  (c) the model-only load torch offers: `_load_state_dict` with `_EmptyStateDictLoadPlanner(keys={"model"})`
      (what `dcp_to_torch_save` uses, restricted to `model.*`; `dcp.load` fills a copy of an empty dict, so
      it cannot be used here) followed by `safetensors.torch.save_file`.

Outputs of earlier runs are deleted first and `sync` runs before each measurement, so that no run
waits behind another's writeback. Reported for each: wall time of the whole process (interpreter start and imports included), the time of
the work itself as the process measured it, and peak RSS from `os.wait4` (that child only; the
checkpoint is written by another process so that this one stays small, since a child's `ru_maxrss`
starts from its parent's at fork). Ratios: our
peak RSS against the largest tensor + 300 MiB (DESIGN §5) and against (c); our time against (c) and (b).
The outputs of (a) and (c) are compared tensor by tensor.

Usage: python bench/convert.py [--layers 4] [--width 8192] [--dir DIR] [--keep] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_zero import MIB, REPO, Measured, measure  # a sibling script: one way to measure a process


def _writer(rank: int, world_size: int, rendezvous: str, path: str, layers: int, width: int) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        with torch.device("meta"):
            model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_(generator=generator)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def build_checkpoint(path: Path, layers: int, width: int) -> None:
    """Write the checkpoint from a separate process: `ru_maxrss` survives exec, so a child forked from a
    parent that imported torch would report at least the parent's peak; the measuring parent stays small."""
    subprocess.run(
        [sys.executable, __file__, "--generate", str(path), "--layers", str(layers), "--width", str(width)],
        check=True,
        cwd=REPO,
    )


def _generate(path: Path, layers: int, width: int) -> None:
    import torch.multiprocessing as mp

    rendezvous = path.parent / ".rendezvous"
    mp.spawn(_writer, args=(2, str(rendezvous), str(path), layers, width), nprocs=2)
    rendezvous.unlink(missing_ok=True)


TORCH_SAVE_THEN_SAFETENSORS = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
ckpt, out = sys.argv[1], sys.argv[2]
start = time.perf_counter()
dcp_to_torch_save(ckpt, out + "/all.pt")
state = torch.load(out + "/all.pt", weights_only=True)
save_file({k: v.contiguous() for k, v in state["model"].items()}, out + "/model.safetensors", metadata={"format": "pt"})
print(json.dumps({"seconds": time.perf_counter() - start}))
"""

MODEL_ONLY_LOAD_THEN_SAFETENSORS = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
ckpt, out = sys.argv[1], sys.argv[2]
start = time.perf_counter()
state = {}
_load_state_dict(state, storage_reader=FileSystemReader(ckpt), planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
save_file({k: v.contiguous() for k, v in state["model"].items()}, out + "/model.safetensors", metadata={"format": "pt"})
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def same_tensors(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        if sorted(fa.keys()) != sorted(fb.keys()):
            return False
        return all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in fa.keys())  # noqa: SIM118


def same_after_cast(plain: Path, cast: Path) -> bool:
    """`cast` holds torch's bf16 cast of every tensor of `plain` (NaNs compare as NaNs)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(plain), "pt") as fa, safe_open(str(cast), "pt") as fb:
        if sorted(fa.keys()) != sorted(fb.keys()):
            return False
        return all(
            torch.equal(fa.get_tensor(k).to(torch.bfloat16), fb.get_tensor(k))
            for k in fa.keys()  # noqa: SIM118
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="Linear layers (default 4)")
    parser.add_argument("--width", type=int, default=8192, help="each layer is width x width fp32 (default 8192)")
    parser.add_argument("--dir", type=Path, default=None, help="work folder (default: a temp dir beside the repo)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    parser.add_argument("--reuse", action="store_true", help="reuse a checkpoint a --keep run left in --dir")
    parser.add_argument(
        "--cast-repeats", type=int, default=4, help="extra alternating runs of (a) and (a') (default 4)"
    )
    parser.add_argument("--generate", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--gb", type=float, default=None, help="model size in GB: sets --width for --layers tensors (bench/summary.py)"
    )
    args = parser.parse_args()
    if args.gb is not None:  # width x width fp32 per layer, a multiple of 64
        args.width = max(64, round((args.gb * 1e9 / 4 / args.layers) ** 0.5 / 64) * 64)
    if args.generate is not None:
        _generate(args.generate, args.layers, args.width)
        return 0

    root = args.dir or Path(tempfile.mkdtemp(prefix="ckptctl-bench-convert-", dir=REPO.parent))
    root.mkdir(parents=True, exist_ok=True)
    ckpt = root / "step-1"
    try:
        started = time.perf_counter()
        if not (args.reuse and (ckpt / ".metadata").exists()):
            shutil.rmtree(ckpt, ignore_errors=True)
            build_checkpoint(ckpt, args.layers, args.width)
        files = sorted(ckpt.iterdir())
        total = sum(f.stat().st_size for f in files)
        largest = args.width * args.width * 4
        model_bytes = largest * args.layers
        print(
            f"checkpoint: {total / 2**30:.2f} GiB in {len(files)} files (2 ranks, FSDP2), model {model_bytes / 2**30:.2f} "
            f"GiB fp32 in {args.layers} tensors of {largest / MIB:.0f} MiB; written in {time.perf_counter() - started:.0f} s"
        )
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
        print("page cache: warmed (every source file read once before the first measurement)")

        python = sys.executable
        runs = {
            "a": (
                "ckptctl convert --to hf",
                # A stack of Linear layers is no transformers model: its names are written as stored.
                lambda out: [
                    *(python, "-m", "ckptctl", "convert", str(ckpt), str(out)),
                    *("--mapping", "none", "--json", "-q"),
                ],
            ),
            "a'": (
                "ckptctl convert --to hf --dtype bf16",
                lambda out: [
                    python,
                    "-m",
                    "ckptctl",
                    "convert",
                    str(ckpt),
                    str(out),
                    "--mapping",
                    "none",
                    "--json",
                    "-q",
                    "--dtype",
                    "bf16",
                ],
            ),
            "c": (
                "model-only DCP load + save_file",
                lambda out: [python, "-c", MODEL_ONLY_LOAD_THEN_SAFETENSORS, str(ckpt), str(out)],
            ),
            "b": (
                "dcp_to_torch_save + torch.load + save_file",
                lambda out: [python, "-c", TORCH_SAVE_THEN_SAFETENSORS, str(ckpt), str(out)],
            ),
        }
        results: dict[str, Measured] = {}
        for out in root.glob("out-*"):
            shutil.rmtree(out)
        for key, (label, argv) in runs.items():
            out = root / f"out-{key.replace(chr(39), '-bf16')}"
            if not key.startswith("a"):
                out.mkdir()
            os.sync()  # no run waits behind another's dirty pages
            results[key] = measure(label, argv(out))
        # Before this process loads any tensor: a child's ru_maxrss starts from its parent's.
        plain_walls, cast_walls, cast_rss = [results["a"].wall], [results["a'"].wall], [results["a'"].peak_rss]
        for _ in range(args.cast_repeats):
            for key, walls in (("a", plain_walls), ("a'", cast_walls)):
                out = root / f"out-{key.replace(chr(39), '-bf16')}"
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                m = measure(runs[key][0], runs[key][1](out))
                walls.append(m.wall)
                if key == "a'":
                    cast_rss.append(m.peak_rss)
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        cast_identical = same_after_cast(
            root / "out-a" / "model.safetensors", root / "out-a-bf16" / "model.safetensors"
        )
        identical = same_tensors(root / "out-a" / "model.safetensors", root / "out-c" / "model.safetensors")

        print(f"\n{'':4}{'method':46}{'wall s':>9}{'work s':>9}{'peak RSS':>12}")
        for key, m in results.items():
            print(f"({key}){' ' * (3 - len(key))}{m.label:46}{m.wall:9.2f}{m.work:9.2f}{m.peak_rss / MIB:9.0f} MiB")
        a, b, c = results["a"], results["b"], results["c"]
        budget = largest + 300 * MIB
        print(
            f"\noutputs of (a) and (c) identical: {identical}; this process's peak RSS while measuring: {own / MIB:.0f} MiB"
        )
        print(
            f"peak RSS (a) / (largest tensor + 300 MiB = {budget / MIB:.0f} MiB): {a.peak_rss / budget:.2f}  (target <= 1)"
        )
        print(f"peak RSS (a) / (c):  {a.peak_rss / c.peak_rss:.2f}")
        cast_ratio = statistics.median(cast_walls) / statistics.median(plain_walls)
        print(
            f"cast (a') / plain (a), median of {len(cast_walls)} each: {cast_ratio:.2f}  (target <= 1.2); "
            f"peak RSS of (a'): {max(cast_rss) / MIB:.0f} MiB (target < 200); equals torch's cast of (a): {cast_identical}"
        )
        print(f"wall (a) / (c):      {a.wall / c.wall:.2f}  (work only: {a.work / c.work:.2f}; target <= 1, aim 0.25)")
        print(f"wall (a) / (b):      {a.wall / b.wall:.2f}  (work only: {a.work / b.work:.2f})")
        line = {"bench": "convert", "what": "convert --to hf", "ours_s": a.wall, "floor": "DCP load+save_file"}
        line |= {"floor_s": c.wall, "peer": "dcp_to_torch_save+save_file", "peer_s": b.wall, "target": "<= 1x floor"}
        print("RATIO " + json.dumps(line | {"ours_rss": a.peak_rss}))
        return 0 if identical and cast_identical else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
