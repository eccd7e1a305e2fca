"""Saves and restores of `CheckpointManager` against the peers users pick and against the floors, in one run.

State: a stack of fp32 linear layers plus AdamW state (exp_avg, exp_avg_sq), `--gb` GB in all, on
`--device` (cpu or cuda), in one process and on `--ranks` gloo ranks sharded by FSDP2. Every round runs
every method once, in turn (interleaved: the machine's drift hits all alike); medians of `--rounds` rounds
after a warm-up round (which allocates every method's staging buffers) are quoted, and on ranks the
slowest rank's time of each round (the job waits for it).

Floors (what no save can beat):
- copy: the state's tensors copied into preallocated host buffers, pinned on a GPU (the device-to-host
  copy an async save must block for); on CPU a memcpy of the state (`np.copyto`, one thread);
- write: those buffers' bytes written to one file per rank and fsynced (what a sync save must take);
- read: that file read back into the buffers and copied into the tensors (what a restore must take).

Saves: `torch.save`+fsync (one process), `dcp.save`, `dcp.async_save` with its default staging and with
`DefaultStager(StagingOptions(...))` (pinned buffers on a GPU: the "6x faster async checkpointing" setup;
on CPU pinning needs an accelerator, so it is the stager's reused, asynchronously filled buffers),
ByteCheckpoint `bcp.save(..., fast_saving=True)` on ranks when `bytecheckpoint` is installed, and
`CheckpointManager` sync and async. Async methods report the time the loop is blocked (until the state
may change again: the call, plus the staging future where staging is asynchronous) and the time to
commit. Restores: `torch.load`+`load_state_dict` (one process), `dcp.load`+`set_state_dict`,
`CheckpointManager.restore`; the state is zeroed before each (not timed) and compared bit for bit with
the saved values after it.

Each row gives ours or the peer's median, x floor and x the best peer of its kind; `RATIO` lines feed
`bench/summary.py`. Targets (issue 26): async blocked <= 1.5x the copy floor on CPU (<= 1.2x the D2H
floor on a GPU), sync save <= 1.0x torch.save+fsync, restore <= 0.5x the torch.load path.

Targets for 2 FSDP2 ranks on CPU (issue 36): sync save <= 1.0x `dcp.save` + fsync, restore <= 1.0x `dcp.load` +
`set_state_dict`, async blocked <= 1.2x the copy floor.

`--device cuda`: the state on the GPU; the copy floor is then the D2H copy into pinned buffers. On one GPU the
one-process part runs in a process group of one, so that ByteCheckpoint (as "ddp") runs beside
`dcp.async_save` with pinned staging and ours; the FSDP2 part runs one rank per GPU, so it needs as many
GPUs as `--ranks`. Without CUDA it prints why it is skipped and exits 0.

Usage: python bench/save_peers.py [--gb 0.5] [--rounds 5] [--ranks 2] [--device cpu|cuda] [--only single|ranks]
[--dir PATH] (`--ranks 0` or 1 skips the multi-rank part; the default folder is next to the repo, on the disk a
run's checkpoints would use.)
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
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("BYTECHECKPOINT_LOGGING_LEVEL", "WARNING")  # it logs every phase of every save at INFO

from ckptctl.core import CheckpointManager

WIDTH = 2048
#: Method name -> its kind, for "x best peer": peers of the same kind are compared.
SAVE, ASYNC, RESTORE, FLOOR = "save", "async", "restore", "floor"
OURS = {"CheckpointManager.save (sync)", "CheckpointManager.save (async)", "CheckpointManager.restore"}
DCP_SAVE, DCP_LOAD = "dcp.save + fsync", "dcp.load + set_state_dict"


def build(gigabytes: float, device: str, world: int) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """The model and its AdamW, moments materialised; FSDP2-sharded over the default group when `world` > 1."""
    layer_bytes = WIDTH * (WIDTH + 1) * 4 * 3  # weight + bias, times params/exp_avg/exp_avg_sq
    layers = max(1, round(gigabytes * 1e9 / layer_bytes))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(device)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def local_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the state this rank holds (FSDP2's local shards), in a fixed order."""
    out = [p for p in model.parameters()]
    for p in model.parameters():
        out.extend(t for t in optimizer.state[p].values() if isinstance(t, torch.Tensor) and t.dim())
    return [t.to_local() if hasattr(t, "to_local") else t for t in out]


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str) -> None:
    """fsync every file of a folder and the folder: what the DCP writers leave to the page cache."""
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            fsync_file(os.path.join(dirpath, name))
        fsync_file(dirpath)


class Methods:
    """Every method of one process (one rank), each a callable of a round returning (blocked, commit)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, work: str, device: str, world: int, grouped: bool
    ):
        """`grouped`: a process group is initialised (always on ranks; on one GPU a group of one, which
        ByteCheckpoint needs); `world` > 1: the state is FSDP2-sharded over it."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.model, self.optimizer, self.work, self.device, self.world = model, optimizer, work, device, world
        self.rank = dist.get_rank() if grouped else 0
        self.dcp = dcp
        self.no_dist = not grouped
        self.tensors = local_tensors(model, optimizer)
        self.reference = [t.detach().to("cpu", copy=True) for t in self.tensors]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        cuda = device == "cuda"
        # The floors' buffers: preallocated once, pinned on a GPU (the DMA target an async save needs).
        self.buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in self.tensors]
        # Pinned staging needs an accelerator; shared memory is for the process-based executor only.
        options = StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
        )
        self.stager = DefaultStager(options)
        self.sync_manager = CheckpointManager(os.path.join(work, "ours-sync"))
        self.async_manager = CheckpointManager(os.path.join(work, "ours-async"), async_save=True)
        self.bcp = None
        if grouped:  # ByteCheckpoint saves through the default group: FSDP2 shards, or a plain model as "ddp"
            try:
                import bytecheckpoint

                self.bcp = bytecheckpoint
            except Exception as exc:  # not installed, or broken against this torch: skipped, and said
                if self.rank == 0:
                    print(f"ByteCheckpoint skipped: {type(exc).__name__}: {exc}")
        self.saves: dict[str, tuple[str, Callable[[int], tuple[float, float]]]] = {
            "floor: copy into preallocated host buffers": (FLOOR, self.floor_copy),
            "floor: write those bytes + fsync": (FLOOR, self.floor_write),
            "dcp.save + fsync": (SAVE, self.dcp_save),
            "dcp.async_save (default staging)": (ASYNC, self.dcp_async_default),
            f"dcp.async_save (DefaultStager{', pinned' if cuda else ''})": (ASYNC, self.dcp_async_stager),
            "CheckpointManager.save (sync)": (SAVE, self.ours_sync),
            "CheckpointManager.save (async)": (ASYNC, self.ours_async),
        }
        if world <= 1:
            self.saves["torch.save + fsync"] = (SAVE, self.torch_save)
        if self.bcp is not None:
            self.saves["ByteCheckpoint (fast_saving)"] = (ASYNC, self.bcp_save)
        self.restores: dict[str, tuple[str, Callable[[], float]]] = {
            "floor: read the bytes back into the tensors": (FLOOR, self.floor_read),
            "dcp.load + set_state_dict": (RESTORE, self.dcp_load),
            "CheckpointManager.restore": (RESTORE, self.ours_restore),
        }
        if world <= 1:
            self.restores["torch.load + load_state_dict"] = (RESTORE, self.torch_load)

    # ------------------------------------------------------------------ helpers

    def path(self, name: str, i: int) -> str:
        return os.path.join(self.work, f"{name}-{i}")

    def sync_device(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def remove(self, path: str) -> None:
        self.barrier()  # every rank has written before rank 0 deletes
        if self.rank == 0 and os.path.exists(path):
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)

    def dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def ours_state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer}

    # ------------------------------------------------------------------ saves

    def floor_copy(self, i: int) -> tuple[float, float]:
        start = time.perf_counter()
        for buffer, tensor in zip(self.buffers, self.tensors, strict=True):
            if tensor.is_cuda:
                buffer.copy_(tensor, non_blocking=True)  # DMA into the pinned buffer
            else:  # a plain memcpy on this thread (`Tensor.copy_` splits it over torch's threads)
                np.copyto(buffer.numpy(), tensor.detach().numpy())
        self.sync_device()
        seconds = time.perf_counter() - start
        return seconds, seconds

    def floor_write(self, i: int | str) -> tuple[float, float]:
        # A new file each round, as every save writes: rewriting one in place would truncate it first,
        # which some file systems (ext4's auto_da_alloc) turn into a flush.
        path = os.path.join(self.work, f"floor-{self.rank}-{i}")
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for buffer in self.buffers:
                f.write(buffer.reshape(-1).view(torch.uint8).numpy().data)
            os.fsync(f.fileno())
        seconds = time.perf_counter() - start
        if i != "restore":  # that one floor_read reads back
            os.unlink(path)
        return seconds, seconds

    def torch_save(self, i: int) -> tuple[float, float]:
        path = self.path("torch", i)
        start = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - start
        self.remove(path)
        return seconds, seconds

    def dcp_save(self, i: int) -> tuple[float, float]:
        path = self.path("dcp", i)
        start = time.perf_counter()
        self.dcp.save(self.dcp_state(), checkpoint_id=path, no_dist=self.no_dist)
        fsync_tree(path)  # DCP leaves its files to the page cache; every other method fsyncs
        seconds = time.perf_counter() - start
        self.remove(path)
        return seconds, seconds

    def dcp_async_default(self, i: int) -> tuple[float, float]:
        path = self.path("dcp-async", i)
        start = time.perf_counter()
        future = self.dcp.async_save(self.dcp_state(), checkpoint_id=path, no_dist=self.no_dist)
        blocked = time.perf_counter() - start
        future.result()  # type: ignore[union-attr]
        fsync_tree(path)
        commit = time.perf_counter() - start
        self.remove(path)
        return blocked, commit

    def dcp_async_stager(self, i: int) -> tuple[float, float]:
        path = self.path("dcp-async-staged", i)
        start = time.perf_counter()
        response = self.dcp.async_save(
            self.dcp_state(), checkpoint_id=path, no_dist=self.no_dist, async_stager=self.stager
        )
        staging = getattr(response, "staging_completion", None)
        if staging is not None:  # the loop may change the state only once staging is done
            staging.result()
        blocked = time.perf_counter() - start
        upload = getattr(response, "upload_completion", response)
        upload.result()
        fsync_tree(path)
        commit = time.perf_counter() - start
        self.remove(path)
        return blocked, commit

    def bcp_save(self, i: int) -> tuple[float, float]:
        root = os.path.join(self.work, "bcp")
        state = {"model": self.model, "optimizer": self.optimizer, "extra_state": {"round": i}}
        start = time.perf_counter()
        framework = "fsdp2" if self.world > 1 else "ddp"
        self.bcp.save(root, state, framework=framework, fast_saving=True, global_steps=i)  # type: ignore[union-attr]
        blocked = time.perf_counter() - start
        tracker = Path(root, "latest_checkpointed_iteration.txt")  # rank 0 writes it once all ranks wrote
        if self.rank == 0:
            while not (tracker.exists() and tracker.read_text().strip() == str(i)):
                time.sleep(0.002)
        self.barrier()
        commit = time.perf_counter() - start
        self.remove(root)
        return blocked, commit

    def ours_sync(self, i: int) -> tuple[float, float]:
        start = time.perf_counter()
        self.sync_manager.save(i, self.ours_state())
        seconds = time.perf_counter() - start
        self.remove(self.sync_manager.step_dir(i))
        return seconds, seconds

    def ours_async(self, i: int) -> tuple[float, float]:
        start = time.perf_counter()
        self.async_manager.save(i, self.ours_state())
        blocked = time.perf_counter() - start
        self.async_manager.wait()
        commit = time.perf_counter() - start
        self.remove(self.async_manager.step_dir(i))
        return blocked, commit

    # ------------------------------------------------------------------ restores (from one save each)

    def prepare_restores(self) -> None:
        if "torch.load + load_state_dict" in self.restores:
            with open(self.path("torch", "restore"), "wb") as f:
                torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, f)
        self.dcp.save(self.dcp_state(), checkpoint_id=self.path("dcp", "restore"), no_dist=self.no_dist)
        self.sync_manager.save(10**6, self.ours_state())
        self.floor_copy(0)
        self.floor_write("restore")
        self.barrier()

    def zero(self) -> None:
        # Live tensors: `Optimizer.load_state_dict` replaces its state's tensors rather than copying into them.
        self.tensors = local_tensors(self.model, self.optimizer)
        with torch.no_grad():
            for t in self.tensors:
                t.zero_()
        self.sync_device()

    def exact(self) -> bool:
        self.sync_device()
        self.tensors = local_tensors(self.model, self.optimizer)
        return all(torch.equal(t.detach().cpu(), r) for t, r in zip(self.tensors, self.reference, strict=True))

    def floor_read(self) -> float:
        start = time.perf_counter()
        with open(os.path.join(self.work, f"floor-{self.rank}-restore"), "rb", buffering=0) as f:
            for buffer in self.buffers:
                f.readinto(buffer.reshape(-1).view(torch.uint8).numpy().data)
        with torch.no_grad():
            for tensor, buffer in zip(self.tensors, self.buffers, strict=True):
                tensor.copy_(buffer, non_blocking=True)
        self.sync_device()
        return time.perf_counter() - start

    def torch_load(self) -> float:
        start = time.perf_counter()
        loaded = torch.load(self.path("torch", "restore"), weights_only=True, map_location=self.device)
        self.model.load_state_dict(loaded["model"])
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.sync_device()
        return time.perf_counter() - start

    def dcp_load(self) -> float:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        start = time.perf_counter()
        state = self.dcp_state()
        self.dcp.load(state, checkpoint_id=self.path("dcp", "restore"), no_dist=self.no_dist)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.sync_device()
        return time.perf_counter() - start

    def ours_restore(self) -> float:
        start = time.perf_counter()
        self.sync_manager.restore(self.ours_state())
        self.sync_device()
        return time.perf_counter() - start

    # ------------------------------------------------------------------ one run

    def run(self, rounds: int) -> dict[str, Any]:
        """Every method of every round in turn; per method, per round, the slowest rank's figures."""
        saves: dict[str, list[tuple[float, float]]] = {name: [] for name in self.saves}
        for i in range(rounds + 1):  # round 0 warms up: allocations, first writes, staging buffers
            for name, (_kind, method) in self.saves.items():
                self.barrier()
                timing = self.slowest(method(i + 1))
                if i:
                    saves[name].append(timing)
        self.prepare_restores()
        restores: dict[str, list[float]] = {name: [] for name in self.restores}
        exact: dict[str, bool] = dict.fromkeys(self.restores, True)
        for i in range(rounds + 1):
            for name, (_kind, method) in self.restores.items():
                self.zero()
                self.barrier()
                seconds = self.slowest((method(), 0.0))[0]
                ok = self.exact()
                exact[name] = exact[name] and all(self.gather(ok))
                if i:
                    restores[name].append(seconds)
        self.async_manager.close()
        self.stager.close()
        return {
            "saves": saves,
            "restores": restores,
            "exact": exact,
            "kinds": {n: k for n, (k, _) in {**self.saves, **self.restores}.items()},
            "nbytes": sum(self.gather(self.nbytes)),
        }

    def gather(self, value: Any) -> list[Any]:
        if self.world <= 1:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def slowest(self, timing: tuple[float, float]) -> tuple[float, float]:
        everyone = self.gather(timing)
        return max(t[0] for t in everyone), max(t[1] for t in everyone)


def report(title: str, result: dict[str, Any], rounds: int, device: str) -> None:
    """The table of one part, and its RATIO lines."""
    kinds = result["kinds"]
    med: dict[str, tuple[float, float]] = {}
    for name, runs in result["saves"].items():
        med[name] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
    for name, runs in result["restores"].items():
        med[name] = (statistics.median(runs), statistics.median(runs))
    copy_floor = med["floor: copy into preallocated host buffers"][0]
    # Targets: DESIGN.md section 5 (a D2H copy into pinned buffers on a GPU), issue 36 for 2 ranks on CPU.
    sharded = "torch.save + fsync" not in med
    async_target = (
        "<= 1.2x D2H floor (GPU)" if device == "cuda" else "<= 1.2x copy" if sharded else "<= 1.5x copy (CPU)"
    )
    write_floor = med["floor: write those bytes + fsync"][0]
    read_floor = med["floor: read the bytes back into the tensors"][0]

    def best_peer(kind: str, which: int) -> tuple[str, float]:
        peers = [(n, med[n][which]) for n, k in kinds.items() if k == kind and n not in OURS]
        return min(peers, key=lambda p: p[1]) if peers else ("", float("nan"))

    print(f"\n{title}: {result['nbytes'] / 1e9:.2f} GB of state; medians of {rounds} interleaved rounds")
    print(f"{'method':<48}{'blocked s':>10}{'x floor':>9}{'x best':>8}{'commit s':>10}{'x floor':>9}{'x best':>8}")
    lines = []
    for name, (blocked, commit) in med.items():
        kind = kinds[name]
        if kind == FLOOR:
            print(f"{name:<48}{blocked:>10.3f}{'':>17}{commit:>10.3f}")
            continue
        if kind == RESTORE:
            peer, peer_s = best_peer(RESTORE, 0)
            exact = "exact" if result["exact"][name] else "NOT EXACT"
            print(f"{name:<48}{'':>27}{commit:>10.3f}{commit / read_floor:>9.2f}{commit / peer_s:>8.2f}  {exact}")
            if name in OURS:
                target = "-"
                if "torch.load + load_state_dict" in med:  # the target's reference, whether or not the best
                    peer, peer_s, target = "torch.load + load_state_dict", med[peer][1], "<= 0.5x torch.load"
                else:  # ranks (issue 36)
                    peer, peer_s, target = "dcp.load + set_state_dict", med[DCP_LOAD][1], "<= 1.0x dcp.load"
                lines.append((f"{title}: restore", commit, "read floor", read_floor, peer, peer_s, target))
            continue
        # Blocked against the copy floor and the best peer's blocked; commit against the write floor and
        # the best peer's time to durable bytes (a sync save's blocked is its commit).
        peer_b, peer_b_s = best_peer(ASYNC, 0) if kind == ASYNC else best_peer(SAVE, 0)
        peer_c, peer_c_s = min(
            (best_peer(SAVE, 1), best_peer(ASYNC, 1)) if kind == ASYNC else (best_peer(SAVE, 1),), key=lambda p: p[1]
        )
        row = f"{name:<48}"
        if kind == ASYNC:
            row += f"{blocked:>10.3f}{blocked / copy_floor:>9.2f}{blocked / peer_b_s:>8.2f}"
        else:
            row += f"{'':>27}"
        print(row + f"{commit:>10.3f}{commit / write_floor:>9.2f}{commit / peer_c_s:>8.2f}")
        if name == "CheckpointManager.save (async)":
            lines.append(
                (
                    f"{title}: async save blocked",
                    blocked,
                    "copy floor",
                    copy_floor,
                    peer_b,
                    peer_b_s,
                    async_target,
                )
            )
            lines.append(
                (f"{title}: async save to commit", commit, "write floor", write_floor, peer_c, peer_c_s, "none")
            )
        elif name == "CheckpointManager.save (sync)":
            # the target's reference, whether or not the best: torch.save in one process, dcp.save on ranks
            if "torch.save + fsync" in med:
                peer_c, peer_c_s, target = (
                    "torch.save + fsync",
                    med["torch.save + fsync"][1],
                    "<= 1.0x torch.save+fsync",
                )
            else:
                peer_c, peer_c_s, target = DCP_SAVE, med[DCP_SAVE][1], "<= 1.0x dcp.save+fsync"
            lines.append((f"{title}: sync save", commit, "write floor", write_floor, peer_c, peer_c_s, target))
    print("x floor: blocked / the copy floor, commit / the write floor, a restore / the read floor; x best: / the")
    print("best peer of the same kind (async: blocked against async peers, commit against every peer's durable save)")
    for what, ours, floor_name, floor_s, peer, peer_s, target in lines:
        line = {"bench": "save", "what": what, "ours_s": ours, "floor": floor_name, "floor_s": floor_s}
        print("RATIO " + json.dumps(line | {"peer": peer, "peer_s": peer_s, "target": target}))
    if "torch.save + fsync" in med:
        ratio = med["CheckpointManager.save (sync)"][1] / med["torch.save + fsync"][1]
        print(f"sync save / torch.save+fsync: {ratio:.2f}x (target <= 1.0x)")
    if "torch.load + load_state_dict" in med:
        ratio = med["CheckpointManager.restore"][1] / med["torch.load + load_state_dict"][1]
        print(f"restore / torch.load path: {ratio:.2f}x (target <= 0.5x)")
    if sharded:
        ratio = med["CheckpointManager.save (sync)"][1] / med[DCP_SAVE][1]
        print(f"sync save / dcp.save+fsync: {ratio:.2f}x (target <= 1.0x)")
        ratio = med["CheckpointManager.restore"][1] / med[DCP_LOAD][1]
        print(f"restore / dcp.load+set_state_dict: {ratio:.2f}x (target <= 1.0x)")
    ratio = med["CheckpointManager.save (async)"][0] / copy_floor
    print(f"async blocked / {'D2H' if device == 'cuda' else 'copy'} floor: {ratio:.2f}x (target {async_target})")


def single_process(args: argparse.Namespace, work: str) -> None:
    if args.device == "cuda":  # in a process group of one, so that ByteCheckpoint runs beside the others
        import torch.multiprocessing as mp

        mp.spawn(_rank, args=(1, work, args.gb, args.rounds, args.device), nprocs=1)
        result = json.loads(Path(work, "results.json").read_text())
        report("one process on cuda (a process group of one)", result, args.rounds, args.device)
        return
    model, optimizer = build(args.gb, args.device, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = Methods(model, optimizer, work, args.device, 1, grouped=False).run(args.rounds)
    report(f"one process on {args.device}", result, args.rounds, args.device)


def _rank(rank: int, world: int, work: str, gigabytes: float, rounds: int, device: str) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    # On GPUs FSDP2's collectives need NCCL; DCP's and this bench's object collectives run on either.
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{work}/store", rank=rank, world_size=world)
    try:
        model, optimizer = build(gigabytes, device, world)
        result = Methods(model, optimizer, work, device, world, grouped=True).run(rounds)
        if rank == 0:
            Path(work, "results.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def ranks_of(args: argparse.Namespace) -> int:
    """How many ranks the FSDP2 part runs (0: skipped): `--ranks`, and on GPUs one rank per GPU."""
    ranks = args.ranks if args.device == "cpu" else min(args.ranks, torch.cuda.device_count())
    return ranks if ranks > 1 else 0


def multi_rank(args: argparse.Namespace, work: str) -> None:
    import torch.multiprocessing as mp

    world = ranks_of(args)
    mp.spawn(_rank, args=(world, work, args.gb, args.rounds, args.device), nprocs=world)
    result = json.loads(Path(work, "results.json").read_text())
    backend = "nccl" if args.device == "cuda" else "gloo"
    report(f"{world} FSDP2 ranks ({backend}) on {args.device}", result, args.rounds, args.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=0.5, help="size of the state in GB (all ranks together)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians shown)")
    parser.add_argument(
        "--ranks", type=int, default=2, help="ranks of the process-group part (0 skips it; on CPU 1 does too)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives")
    parser.add_argument("--only", choices=("single", "ranks"), help="run one part only")
    parser.add_argument("--dir", default=str(Path(__file__).resolve().parent.parent / "bench-out"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        why = f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None else "no GPU is visible"
        print(f"bench/save_peers.py --device cuda: skipped, CUDA is not available ({why}); run it on a GPU machine")
        return
    os.makedirs(args.dir, exist_ok=True)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, device {args.device}")
    if args.device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
        if args.ranks > 1 and ranks_of(args) == 0 and args.only != "single":
            print(f"the {args.ranks}-rank FSDP2 part needs a GPU per rank: skipped on this single GPU")
    parts = ((single_process, args.only != "ranks"), (multi_rank, args.only != "single" and ranks_of(args) > 0))
    for part, enabled in parts:
        if not enabled:
            continue
        work = tempfile.mkdtemp(prefix="save-peers-", dir=args.dir)
        try:
            part(args, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
