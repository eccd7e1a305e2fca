"""`list` over a run of 1,000 checkpoints and `inspect` of a 100,000-tensor DCP checkpoint (targets: < 1 s each).

Two runs are listed: 1,000 native checkpoints, and a DeepSpeed save folder of 1,000 tags (one real ZeRO-2 tag
written by DeepSpeed in a subprocess, then hard-linked under 1,000 tag names). The DeepSpeed one goes through
the layouts that must look around a `global_stepN` folder before `deepspeed` may take it (OpenRLHF,
open-instruct), so it also shows what that costs.

Peers measured in the same run:
- list: `du -sb` over the same run folder (what people run to see what a run holds), and a plain
  `os.walk` + `os.stat` of every file (the floor for anything that reports sizes);
- inspect: torch's own `FileSystemReader.read_metadata()` (plain `pickle.load`, no validation, no index).
Also reports the bytes each command read against the checkpoint size.

Usage: python bench/list_inspect.py [--checkpoints 1000] [--tensors 100000] [--repeat 3] [--no-deepspeed]
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
from collections.abc import Callable
from pathlib import Path


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def build_native_run(root: Path, count: int) -> None:
    """One real `CheckpointManager` save, then `count` copies of it under their own steps (hard links)."""
    import torch

    from ckptctl.core import CheckpointManager
    from ckptctl.formats.manifest import MANIFEST_NAME

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    CheckpointManager(str(root / "seed")).save(1, {"model": model, "optimizer": optimizer})
    seed = root / "seed" / "step-1"
    run = root / "run"
    run.mkdir()
    for step in range(1, count + 1):
        target = run / f"step-{step * 100}"
        shutil.copytree(seed, target, copy_function=os.link)
        manifest = json.loads((seed / MANIFEST_NAME).read_text())
        manifest["step"] = step * 100
        (target / MANIFEST_NAME).unlink()
        (target / MANIFEST_NAME).write_text(json.dumps(manifest))
    (run / "latest").write_text(f"step-{count * 100}\n")


def write_deepspeed_tag(save_dir: Path) -> None:
    """One real ZeRO-2 save (bf16, one CPU rank) by DeepSpeed itself; run in a subprocess (it sets up a
    process group)."""
    import importlib
    import logging
    import warnings

    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(29500 + os.getpid() % 1000),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
    )
    warnings.filterwarnings("ignore")
    import deepspeed
    import torch
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no JIT-compiled op
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    engine.save_checkpoint(str(save_dir), tag="global_step1")


def build_deepspeed_run(root: Path, count: int) -> Path:
    """A DeepSpeed save folder with `count` tags: one real tag, hard-linked under `global_step{100 i}`."""
    seed = root / "deepspeed-seed"
    subprocess.run([sys.executable, __file__, "--write-deepspeed-tag", str(seed)], check=True, capture_output=True)
    run = root / "deepspeed"
    run.mkdir()
    for name in ("zero_to_fp32.py",):
        if (seed / name).exists():
            shutil.copy2(seed / name, run / name)
    for step in range(1, count + 1):
        shutil.copytree(seed / "global_step1", run / f"global_step{step * 100}", copy_function=os.link)
    (run / "latest").write_text(f"global_step{count * 100}")
    return run


def build_dcp(folder: Path, tensors: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    state = {f"model.layers.{i // 10}.p{i % 10}": torch.zeros(2) for i in range(tensors)}
    dcp.save(state, checkpoint_id=str(folder))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=int, default=1000)
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed run (needs deepspeed)")
    parser.add_argument("--write-deepspeed-tag", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_deepspeed_tag:
        write_deepspeed_tag(Path(args.write_deepspeed_tag))
        return 0

    from torch.distributed.checkpoint import FileSystemReader

    from ckptctl import io
    from ckptctl.ops.inspection import inspect_checkpoint
    from ckptctl.ops.listing import list_run

    root = Path(tempfile.mkdtemp(prefix="ckptctl-bench-"))
    try:
        build_native_run(root, args.checkpoints)
        build_dcp(root / "dcp", args.tensors)
        run = str(root / "run")
        run_bytes = sum(p.stat().st_size for p in (root / "run").rglob("*") if p.is_file())
        dcp_bytes = sum(p.stat().st_size for p in (root / "dcp").iterdir())

        def walk_stat() -> None:
            for folder, _dirs, files in os.walk(run):
                for name in files:
                    os.stat(os.path.join(folder, name))

        list_run(run)  # warm the page cache and the imports
        with io.counting() as read:
            report = list_run(run)
        list_read = read.bytes_read
        assert len(report.checkpoints) == args.checkpoints
        ours_list = best_of(args.repeat, lambda: list_run(run))
        du = best_of(args.repeat, lambda: subprocess.run(["du", "-sb", run], stdout=subprocess.DEVNULL, check=True))
        walk = best_of(args.repeat, walk_stat)
        ds_line = ""
        if not args.no_deepspeed:
            ds_run = str(build_deepspeed_run(root, args.checkpoints))
            ds_report = list_run(ds_run)
            assert len(ds_report.checkpoints) == args.checkpoints
            assert {r.layout for r in ds_report.checkpoints} == {"deepspeed"}
            ds_list = best_of(args.repeat, lambda: list_run(ds_run))
            ds_du = best_of(
                args.repeat, lambda: subprocess.run(["du", "-sb", ds_run], stdout=subprocess.DEVNULL, check=True)
            )
            ds_line = (
                f"list: {args.checkpoints} DeepSpeed tags in one save folder\n"
                f"  ckptctl list (library)      {ds_list:7.3f} s   target < 1 s\n"
                f"  du -sb                      {ds_du:7.3f} s   ckptctl/du = {ds_list / ds_du:.2f}x"
            )

        inspected = inspect_checkpoint(str(root / "dcp"))  # the first call: the metadata cache is cold
        inspect_read = inspected.bytes_read
        assert inspected.totals.tensors == args.tensors
        from ckptctl.formats import dcp_folder_metadata

        def cold_inspect() -> None:
            dcp_folder_metadata._cache.clear()  # measure the parse, not the in-process cache
            inspect_checkpoint(str(root / "dcp"))

        ours_inspect = best_of(args.repeat, cold_inspect)
        torch_metadata = best_of(args.repeat, lambda: FileSystemReader(str(root / "dcp")).read_metadata())

        print(f"{os.cpu_count()} cores, page cache warm, best of {args.repeat}")
        print(f"list: {args.checkpoints} native checkpoints ({run_bytes / 2**20:.0f} MiB)")
        print(f"  ckptctl list (library)      {ours_list:7.3f} s   target < 1 s")
        print(f"  du -sb                      {du:7.3f} s   ckptctl/du = {ours_list / du:.2f}x")
        print(f"  os.walk + stat (floor)      {walk:7.3f} s   ckptctl/floor = {ours_list / walk:.2f}x")
        print(f"  bytes read by list          {list_read} = {100 * list_read / run_bytes:.3f}% of the run")
        if ds_line:
            print(ds_line)
        print(f"inspect: DCP with {args.tensors} tensors ({dcp_bytes / 2**20:.0f} MiB)")
        print(f"  ckptctl inspect (library)   {ours_inspect:7.3f} s   target < 1 s")
        print(
            f"  torch read_metadata         {torch_metadata:7.3f} s   ckptctl/torch = {ours_inspect / torch_metadata:.2f}x"
        )
        print(f"  bytes read by inspect       {inspect_read} = {100 * inspect_read / dcp_bytes:.2f}% of the checkpoint")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
