"""`ckptctl slim`: bytes freed and wall time per framework, against `cp -r` of what is kept, in one run.

Runs:
  - native: a run written here by `CheckpointManager` (a stack of fp32 Linear layers trained with AdamW and a
    scheduler; `--width`/`--layers` set its size, 3 saves by default): the target is >= 60% of each
    non-newest checkpoint freed (an fp32 AdamW checkpoint is about 3x its model);
  - dcp: the same model and optimizer saved by torch's `dcp.save` (`{"model", "optim"}` of `get_state_dict`),
    whose slim rewrites the model items into new data files and a new `.metadata`;
  - the test suite's real runs, when its writer cache holds them (`--suite-cache`, default the cache
    `tests/writer_cache.py` uses): the HF Trainer's `output_dir`, DeepSpeed ZeRO-2 and ZeRO-3 save folders,
    OpenRLHF's save folder, verl's run folder, accelerate's plain project folder, the demo's FSDP2 DCP run, torchtitan's checkpoint
    folder and Megatron's `--save` folder. They are tiny (KiBs): their times say little; their
    fractions say what each framework's slim drops.

Each run is copied first (`cp -r`), then `ckptctl slim RUN -y --grace 0 --json` runs in a fresh process
(wall time includes the interpreter start). The peer is `cp -r` of the files the slimmed checkpoints keep
(their marker lists them) into a fresh folder, followed by `sync`: what keeping the model by hand costs at
least. `list s` is a `ckptctl list RUN --json` process on the same run: the floor of any ckptctl process that
scans it (interpreter start, imports, the scan), which slim's time includes. Reported: bytes of the slimmed checkpoints before and after, the fraction freed, slim's wall time, the
copy's, and their ratio.

Usage: python bench/slim.py [--layers 8] [--width 2048] [--saves 3] [--suite-cache DIR] [--dir DIR]
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

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def write_native(root: Path, layers: int, width: int, saves: int) -> Path:
    import torch

    from ckptctl import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    manager = CheckpointManager(root)
    for step in range(1, saves + 1):
        model(torch.randn(4, width)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        manager.save(step * 100, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    return root


def write_dcp(root: Path, layers: int, width: int, saves: int) -> Path:
    """The same model and optimizer as `write_native`, saved by torch's `dcp.save` of `get_state_dict`'s
    `{"model", "optim"}` (as FSDP2 loops save), one `step-N/` per save, in one process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(1, saves + 1):
        model(torch.randn(4, width)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / f"step-{step * 100}"), no_dist=True)
    return root


def suite_runs(cache: Path) -> dict[str, Path]:
    """The suite's cached real runs by framework (those found)."""
    patterns = {
        "hf_trainer": "trainer-*/out/out",
        "deepspeed zero2": "deepspeed-*/out/suite/zero2",
        "deepspeed zero3": "deepspeed-*/out/suite/zero3",
        "openrlhf": "deepspeed-*/out/openrlhf-ppo/ckpt/checkpoints_ppo_ray",
        "verl": "verl-*/out/run",
        "accelerate": "accelerate-*/out/plain",
        "dcp fsdp2": "demo-*/out/demo/dcp",
        "torchtitan": "torchtitan-*/out/outputs/checkpoint",
        "megatron": "megatron-*/out/save",
    }
    found = {}
    for name, pattern in patterns.items():
        hits = sorted(cache.glob(pattern))
        if hits:
            found[name] = hits[0]
    return found


def tree_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def measure(name: str, source: Path, work: Path) -> dict[str, object]:
    run = work / name.replace(" ", "-")
    subprocess.run(["cp", "-r", str(source), str(run)], check=True)
    subprocess.run(["sync"], check=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "ckptctl", "slim", str(run), "--grace", "0", "--json"]
    plan = json.loads(subprocess.run([*args, "--dry-run"], env=env, capture_output=True).stdout)
    before = {item["url"]: item["size_bytes"] for item in plan["slim"]}
    started = time.perf_counter()
    done = subprocess.run([*args, "-y"], env=env, capture_output=True, text=True)
    subprocess.run(["sync"], check=True)
    slim_s = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{name}: slim failed ({done.returncode}): {done.stderr}")
    report = json.loads(done.stdout)
    after = {url: tree_bytes(Path(url)) for url in before}
    kept = work / f"{run.name}-kept"
    started = time.perf_counter()
    for url in before:
        marker = json.loads((Path(url) / ".ckptctl-slim.json").read_text())
        target = kept / os.path.relpath(url, run)
        target.mkdir(parents=True)
        files = [str(Path(url) / rel) for rel in marker["kept_files"]]
        subprocess.run(
            ["cp", "-r", "--parents", *[os.path.relpath(f, url) for f in files], str(target)], cwd=url, check=True
        )
    subprocess.run(["sync"], check=True)
    copy_s = time.perf_counter() - started
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ckptctl", "list", str(run), "--json"], env=env, capture_output=True)
    list_s = time.perf_counter() - started
    total_before, total_after = sum(before.values()), sum(after.values())
    return {
        "framework": name,
        "slimmed": len(report["slim"]),
        "before": total_before,
        "after": total_after,
        "freed": report["freed_bytes"],
        "fraction": report["freed_bytes"] / total_before if total_before else 0.0,
        "slim_s": slim_s,
        "list_s": list_s,
        "copy_s": copy_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--saves", type=int, default=3)
    default_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ckptctl-tests"
    parser.add_argument("--suite-cache", type=Path, default=Path(os.environ.get("CKPTCTL_TEST_CACHE") or default_cache))
    parser.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one)")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    work = Path(tempfile.mkdtemp(prefix="bench-slim-", dir=args.dir))
    try:
        runs = {"native": write_native(work / "native-source", args.layers, args.width, args.saves)}
        runs["dcp"] = write_dcp(work / "dcp-source", args.layers, args.width, args.saves)
        runs |= suite_runs(args.suite_cache)
        rows = [measure(name, source, work) for name, source in runs.items()]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"{'framework':<16} {'slimmed':>7} {'before':>10} {'after':>10} {'freed':>7} {'slim s':>8} "
        f"{'list s':>7} {'cp -r kept s':>12} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['framework']:<16} {r['slimmed']:>7} {r['before'] / MIB:>8.2f}Mi {r['after'] / MIB:>8.2f}Mi "
            f"{r['fraction']:>6.1%} {r['slim_s']:>8.2f} {r['list_s']:>7.2f} {r['copy_s']:>12.2f} "
            f"{r['slim_s'] / max(r['copy_s'], 1e-9):>6.2f}"
        )
    for row in rows[:2]:
        verdict = "met" if row["fraction"] >= 0.6 else "NOT met"
        print(
            f"target >= 60% of an fp32 AdamW checkpoint freed ({row['framework']}): {row['fraction']:.1%} ({verdict})"
        )


if __name__ == "__main__":
    main()
