"""Save speed of `CheckpointManager` against `torch.save`, measured in the same run on the same disk.

State: a stack of fp32 linear layers plus AdamW state (exp_avg, exp_avg_sq), about 1 GB in all.

- sync: `CheckpointManager.save` (safetensors + JSON, blake3 while writing, fsync of every file and folder,
  manifest, rename, pointer) against `torch.save` of the model and optimizer state dicts into one file
  followed by `fsync` of that file: both pay for getting the bytes onto the disk.
- async: how long `save()` blocks the loop (the copy into host staging buffers) against a sync save; the
  first async save also allocates the buffers, later ones reuse them, so both are shown. Target: ≤ 0.25×.
- `--device cuda`: the single-process state lives on the GPU; an async save copies it into pinned host
  buffers (DMA) and a sync save moves it to the host as it encodes.
- 2 ranks (`--ranks 2`): the same state sharded by FSDP2 over gloo ranks on this host (DCP underneath), on
  `--device`; the blocked time of a round is the slowest rank's (the job waits for it), sync and async
  measured in the same spawn, interleaved.

Usage: python bench/save.py [--gb 1.0] [--rounds 5] [--ranks 2] [--device cpu] [--dir PATH]  (the default folder is next
to the repo, on the same disk as a training run's checkpoints would be; `--ranks 0` skips the multi-rank
part).
"""

from __future__ import annotations

import argparse
import json
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


def build_state(gigabytes: float, optimize: bool = True, device: str = "cpu") -> tuple[dict[str, object], int]:
    """A model + AdamW (with its moments materialised, unless not `optimize`) whose tensors total about
    `gigabytes`, on `device`."""
    layer_bytes = WIDTH * (WIDTH + 1) * 4 * 3  # weight + bias, times params/exp_avg/exp_avg_sq
    layers = max(1, round(gigabytes * 1e9 / layer_bytes))
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if optimize:
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
    parser.add_argument("--rounds", type=int, default=5, help="measurements per method (median shown)")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks of the multi-rank part (0: skip it)")
    parser.add_argument(
        "--device", default="cpu", help="where the single-process state lives (cuda: saves copy device->pinned host)"
    )
    parser.add_argument("--dir", default=str(Path(__file__).resolve().parent.parent / "bench-out"))
    args = parser.parse_args()
    single_process(args)  # returns its state's memory before the ranks build theirs
    if args.ranks > 1:
        multi_rank(args)


def single_process(args: argparse.Namespace) -> None:

    torch.manual_seed(0)
    state, nbytes = build_state(args.gb, device=args.device)
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="save-bench-", dir=args.dir)
    print(
        f"state: {nbytes / 1e9:.2f} GB of fp32 tensors on {args.device}; writing into {work}; torch {torch.__version__}"
    )

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


def multi_rank(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="save-bench-ranks-", dir=args.dir)
    try:
        mp.spawn(_rank, args=(args.ranks, work, args.gb, args.rounds, args.device), nprocs=args.ranks)
        results = json.loads(Path(work, "results.json").read_text())
    finally:
        shutil.rmtree(work)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(
        f"\n{args.ranks} gloo ranks, FSDP2 (DCP) on {args.device}, the same state; median of {args.rounds} rounds, "
        "slowest rank"
    )
    print(f"{'':<36} {'median':>9} {'best':>9} {'ratio (medians)':>17}")
    for label, key in (
        ("sync: save()", "sync"),
        ("async: save() blocks the loop", "async_blocked"),
        ("async: save() + wait() (to commit)", "async_total"),
    ):
        print(f"{label:<36} {med[key]:7.3f} s {min(results[key]):7.3f} s {med[key] / med['sync']:6.2f}x of sync")
    ratio = med["async_blocked"] / med["sync"]
    print(
        f"\n{args.ranks}-rank async blocking target <= 0.25x of a sync save: {'met' if ratio <= 0.25 else 'NOT met'} ({ratio:.3f}x)"
    )


def _rank(rank: int, world: int, work: str, gigabytes: float, rounds: int, device: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=rank, world_size=world)
    torch.manual_seed(0)
    state, _ = build_state(gigabytes, optimize=False, device=device)
    model = state["model"]
    assert isinstance(model, nn.Sequential)
    # Named, not FSDP's default (the accelerator when there is one): --device says where the shards live;
    # with one GPU every rank shares it (gloo carries CUDA tensors through the host).
    mesh = init_device_mesh(device, (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # materialises the moments (sharded like the parameters)
    optimizer.zero_grad(set_to_none=True)
    state = {"model": model, "optimizer": optimizer}
    managers = {
        "sync": CheckpointManager(os.path.join(work, "sync")),
        "async": CheckpointManager(os.path.join(work, "async"), async_save=True),
    }

    def save(kind: str, i: int) -> tuple[float, float]:
        manager = managers[kind]
        dist.barrier()
        start = time.perf_counter()
        manager.save(i, state)
        blocked = time.perf_counter() - start
        manager.wait()
        total = time.perf_counter() - start
        dist.barrier()
        if rank == 0:
            shutil.rmtree(manager.step_dir(i))
        # the job goes on when its slowest rank does
        return max(dist_all(blocked)), max(dist_all(total))

    def dist_all(value: float) -> list[float]:
        out: list[float] = [0.0] * world
        dist.all_gather_object(out, value)
        return out

    save("async", 0), save("sync", 0)  # warm-up: allocates the staging buffers, first writes
    results: dict[str, list[float]] = {"sync": [], "async_blocked": [], "async_total": []}
    for i in range(1, rounds + 1):
        results["sync"].append(save("sync", i)[0])
        blocked, total = save("async", i)
        results["async_blocked"].append(blocked)
        results["async_total"].append(total)
    if rank == 0:
        Path(work, "results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
