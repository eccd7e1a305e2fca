"""verify with digests against `sha256sum` on the same files (target: >= 8x faster), in one run.

Builds a sharded Hugging Face style checkpoint of random tensors (default 1 GiB in 4 shards), records
digests once with `ckptctl verify --write-manifest`, warms the page cache, then times, best of N:
- `sha256sum` over the shard files (the tool people reach for),
- `ckptctl.ops.verification.verify_checkpoint` (structure + every digest, parallel blake3),
- the `ckptctl verify` command end to end (process start included),
and reports how many bytes a structural verify (no digests) reads.

Usage: python bench/verify_throughput.py [--gib 1] [--shards 4] [--repeat 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build_checkpoint(folder: Path, gib: float, shards: int) -> int:
    import torch

    from ckptctl.formats.safetensors import write_file

    folder.mkdir(parents=True, exist_ok=True)
    per_shard = int(gib * (1 << 30)) // shards
    weight_map = {}
    total = 0
    generator = torch.Generator().manual_seed(0)
    for i in range(1, shards + 1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for j in range(8):
            elements = per_shard // 8 // 4
            tensors[f"layers.{i}.{j}.weight"] = torch.randn(elements, generator=generator)
            weight_map[f"layers.{i}.{j}.weight"] = name
        total += write_file(str(folder / name), tensors).size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps({"model_type": "bench"}))
    return total


def best_of(repeat: int, fn: object) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to build the checkpoint (default: a temp dir)")
    args = parser.parse_args()

    from ckptctl.ops.verification import VerifyOptions, verify_checkpoint

    root = args.dir or Path(tempfile.mkdtemp(prefix="ckptctl-bench-"))
    folder = root / "ckpt"
    try:
        total = build_checkpoint(folder, args.gib, args.shards)
        verify_checkpoint(str(folder), VerifyOptions(write_manifest=True))
        shard_files = sorted(str(p) for p in folder.glob("*.safetensors"))
        subprocess.run(["cat", *shard_files], stdout=subprocess.DEVNULL, check=True)  # warm the page cache

        sha = best_of(
            args.repeat, lambda: subprocess.run(["sha256sum", *shard_files], stdout=subprocess.DEVNULL, check=True)
        )

        def library_verify() -> None:
            result = verify_checkpoint(str(folder))
            assert result.ok and result.digests_checked >= args.shards, result

        ours = best_of(args.repeat, library_verify)
        cli = [sys.executable, "-m", "ckptctl", "verify", str(folder), "--json"]
        ours_cli = best_of(args.repeat, lambda: subprocess.run(cli, stdout=subprocess.DEVNULL, check=True))

        os.remove(folder / "ckptctl-digests.json")
        structural = verify_checkpoint(str(folder))
        structural_bytes = structural.bytes_read
        assert structural.ok

        gib = total / (1 << 30)
        print(
            f"checkpoint: {gib:.2f} GiB in {args.shards} shards, {os.cpu_count()} cores, page cache warm, best of {args.repeat}"
        )
        print(f"{'tool':<38}{'seconds':>9}{'GiB/s':>9}{'vs sha256sum':>14}")
        for label, seconds in (
            ("sha256sum (coreutils)", sha),
            ("ckptctl verify (library call)", ours),
            ("ckptctl verify (command, incl. start)", ours_cli),
        ):
            print(f"{label:<38}{seconds:>9.3f}{gib / seconds:>9.2f}{sha / seconds:>13.1f}x")
        print(
            f"structural verify read {structural_bytes} bytes = {100 * structural_bytes / total:.4f}% of the checkpoint"
        )
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
