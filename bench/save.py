"""Save speed of `CheckpointManager` against `torch.save`, measured in the same run on the same disk.

State: a stack of fp32 linear layers plus AdamW state (exp_avg, exp_avg_sq), about 1 GB in all.

- sync: `CheckpointManager.save` (safetensors + JSON, blake3 while writing, fsync of every file and folder,
  manifest, rename, pointer) against `torch.save` of the model and optimizer state dicts into one file
  followed by `fsync` of that file: both pay for getting the bytes onto the disk.
- async: how long `save()` blocks the loop (the copy into CPU staging buffers) against a sync save; the
  first async save also allocates the buffers, later ones reuse them, so both are shown. Target: ≤ 0.25×.

Usage: python bench/save.py [--gb 1.0] [--rounds 3] [--dir PATH]  (the default folder is next to the repo,
on the same disk as a training run's checkpoints would be).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckptctl.core import CheckpointManager

WIDTH = 2048


def build_state(gigabytes: float) -> tuple[dict[str, object], int]:
    """A model + AdamW (with its moments materialised) whose tensors total about `gigabytes`."""
    layer_bytes = WIDTH * (WIDTH + 1) * 4 * 3  # weight + bias, times params/exp_avg/exp_avg_sq
    layers = max(1, round(gigabytes * 1e9 / layer_bytes))
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    return {"model": model, "optimizer": optimizer}, total


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="size of the state in GB")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per method (median shown)")
    parser.add_argument("--dir", default=str(Path(__file__).resolve().parent.parent / "bench-out"))
    args = parser.parse_args()

    torch.manual_seed(0)
    state, nbytes = build_state(args.gb)
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="save-bench-", dir=args.dir)
    print(f"state: {nbytes / 1e9:.2f} GB of fp32 tensors; writing into {work}; torch {torch.__version__}")

    def torch_save(i: int) -> float:
        path = os.path.join(work, f"torch-{i}.pt")

        def run() -> None:
            with open(path, "wb") as f:
                torch.save({k: v.state_dict() for k, v in state.items()}, f)  # type: ignore[attr-defined]
                f.flush()
                os.fsync(f.fileno())

        seconds = timed(run)
        os.unlink(path)
        return seconds

    sync_manager = CheckpointManager(os.path.join(work, "sync"))
    async_manager = CheckpointManager(os.path.join(work, "async"), async_save=True)

    def sync_save(i: int) -> float:
        seconds = timed(lambda: sync_manager.save(i, state))
        shutil.rmtree(sync_manager.step_dir(i))
        return seconds

    def async_save(i: int) -> tuple[float, float]:
        start = time.perf_counter()
        async_manager.save(i, state)
        blocked = time.perf_counter() - start
        async_manager.wait()
        total = time.perf_counter() - start
        shutil.rmtree(async_manager.step_dir(i))
        return blocked, total

    first_blocked, first_total = async_save(0)  # allocates the staging buffers
    torch_save(0), sync_save(0)  # warm-up: the first large writes of a process are slower on some machines
    results: dict[str, list[float]] = {"torch": [], "sync": [], "async_blocked": [], "async_total": []}
    for i in range(1, args.rounds + 1):  # interleaved, so that disk and cache drift hit every method alike
        results["torch"].append(torch_save(i))
        results["sync"].append(sync_save(i))
        blocked, total = async_save(i)
        results["async_blocked"].append(blocked)
        results["async_total"].append(total)
    shutil.rmtree(work)

    med = {k: statistics.median(v) for k, v in results.items()}
    best = {k: min(v) for k, v in results.items()}
    mb = nbytes / 1e6

    def row(label: str, key: str, against: str) -> None:
        seconds, ratio = med[key], med[key] / med[against]
        print(f"{label:<36} {seconds:7.3f} s {best[key]:7.3f} s {mb / seconds:8.0f} MB/s {ratio:6.2f}x of {against}")

    print(f"\nmedian and best of {args.rounds} rounds after a warm-up round (fsync included everywhere)")
    print(f"{'':<36} {'median':>9} {'best':>9} {'MB/s':>13} {'ratio (medians)':>17}")
    row("torch.save + fsync", "torch", "torch")
    row("CheckpointManager.save (sync)", "sync", "torch")
    row("async: save() blocks the loop", "async_blocked", "sync")
    row("async: save() + wait() (to commit)", "async_total", "sync")
    print(
        f"{'async: first save() (allocates)':<36} {first_blocked:7.3f} s blocked, {first_total:.3f} s to commit "
        f"({first_blocked / med['sync']:.2f}x of sync)"
    )
    ratio = med["async_blocked"] / med["sync"]
    print(f"\nasync blocking target <= 0.25x of a sync save: {'met' if ratio <= 0.25 else 'NOT met'} ({ratio:.3f}x)")


if __name__ == "__main__":
    main()
