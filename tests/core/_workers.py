"""Programs the core tests run in processes of their own: `run_worker(<command>, ...)` forks one from the writers'
pre-imported server (`tests.core.util`), `python -m tests.core._workers <command> ...` starts a fresh interpreter
where the test needs one (`run_fresh_worker`, `autosave`: atexit hooks run only as an interpreter ends;
`second-writer`: stdin).

- `roundtrip-save DIR` / `roundtrip-restore DIR`: train a tiny model, save; restore in another process.
- `crash SPEC.json`: save a ~50 MB state in forked children, SIGKILLed over a save or at a commit phase.
- `fsdp(DIR)` (called by the test process, not a command): 2-rank gloo FSDP2 training saved through DCP (also
  asynchronously, with a failing and a killed rank), then restored in 2 fresh ranks.
- `autosave DIR`: a loop that leaves the saving at exit to AutoSaver's atexit hook.
- `interrupt SPEC.json`: saves of a small state in forked children that stop mid-save; SIGKILLed, or left
  running (a live writer) for the test to kill.
- `fresh SPEC.json`: what a restarted job does first, in a process that never saw the run: save, restore.
- `kill-saves SPEC.json`: save loops (sync or async) of a small state in forked children, each SIGKILLed at
  a random moment.
- `second-writer DIR`: another process's manager saving into the same run, step by step as stdin says.

Expected and observed values are written with `torch.save` (test artifacts, read back with weights_only).
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from ckptctl.core import AutoSaver, CheckpointManager, RetentionPolicy
from ckptctl.formats.native import WRITER_NAME


class ResumableSampler:
    """A sampler with resumable position, the way a training loop's data order is kept across restarts."""

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.epoch = 0
        self.position = 0
        self.order = torch.randperm(size, generator=torch.Generator().manual_seed(seed))

    def __iter__(self) -> Any:
        while True:
            if self.position == self.size:
                self.epoch += 1
                self.position = 0
            yield int(self.order[self.position])
            self.position += 1

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "order": self.order, "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position, self.order, self.size = (
            state["epoch"],
            state["position"],
            state["order"],
            state["size"],
        )


class TinyTransformer(nn.Module):
    """Embedding, one encoder layer (attention, layer norms, dropout), a head with tied weights."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(tokens))))


def build_training_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": ResumableSampler(64, seed)}


def draws() -> dict[str, Any]:
    """The next values of every generator a training step might use."""
    return {"python": [random.random() for _ in range(3)], "numpy": np.random.rand(3).tolist(), "torch": torch.rand(3)}


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": state["model"].state_dict(),
        "optimizer": state["optimizer"].state_dict(),
        "scheduler": state["scheduler"].state_dict(),
        "sampler": state["sampler"].state_dict(),
        "trainer": state.get("trainer"),
    }


def roundtrip_save(root: str) -> None:
    state = build_training_state(seed=1)
    state["trainer"] = {"tokens_seen": 12345, "best_loss": float("inf"), "tags": ("a", "b")}
    random.seed(11)
    np.random.seed(12)
    batches = iter(state["sampler"])
    for _ in range(5):
        tokens = torch.tensor([[next(batches) % 32 for _ in range(8)] for _ in range(4)])
        loss = state["model"](tokens).logsumexp(-1).mean() + random.random() + float(np.random.rand())
        loss.backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state["scheduler"].step()
    CheckpointManager(root).save(5, state, metrics={"loss": loss.detach()})
    torch.save({"state": snapshot(state), "draws": draws()}, os.path.join(root, "expected.pt"))


def roundtrip_restore(root: str) -> None:
    state = build_training_state(seed=2)  # different weights, order and generator states
    state["trainer"] = None
    random.seed(99)
    step = CheckpointManager(root).restore(state)
    assert step == 5, step
    torch.save({"state": snapshot(state), "draws": draws()}, os.path.join(root, "observed.pt"))


def big_state() -> dict[str, Any]:
    """About 50 MB: 4 linear layers of 1024x1024 fp32 plus AdamW moments (enough that a save takes long
    enough to be killed in the middle of its writes)."""
    # built on the meta device and materialised uninitialised: `fill` sets every value anyway
    model = nn.Sequential(*[nn.Linear(1024, 1024, device="meta") for _ in range(4)]).to_empty(device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"model": model, "optimizer": optimizer, "counter": {"step": 0}}


def fill(state: dict[str, Any], value: float) -> None:
    """Make every tensor of the state equal `value`, so a restored checkpoint shows which save it is."""
    with torch.no_grad():
        for p in state["model"].parameters():
            p.fill_(value)
        for per_param in state["optimizer"].state.values():
            per_param["exp_avg"].fill_(value)
            per_param["exp_avg_sq"].fill_(value)
    state["counter"]["step"] = value


def _hang(point: str) -> None:
    print(f"at {point}", flush=True)
    time.sleep(600)
    os._exit(3)  # never killed (the test run died): end here rather than go on with the save


def _install_hang(point: str) -> None:
    """Stop (until killed) at one moment of the commit protocol of the next save."""
    import builtins
    import shutil

    import ckptctl.core.manager as manager_module

    if point == "manifest":  # data files written and fsynced, manifest not yet
        real_open = builtins.open

        def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if str(file).endswith("ckptctl-manifest.json") and "w" in mode:
                _hang(point)
            return real_open(file, mode, *args, **kwargs)

        builtins.open = open_
    elif point == "rename":  # manifest written, folder not yet renamed into place
        real_rename = os.rename

        def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if ".staging-" in str(src):
                _hang(point)
            real_rename(src, dst, *args, **kwargs)

        os.rename = rename
    elif point == "pointer":  # renamed, `latest` not yet replaced (its temporary file is written)
        real_replace = os.replace

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if str(dst).endswith("latest"):
                _hang(point)
            real_replace(src, dst, *args, **kwargs)

        os.replace = replace
    elif point == "retention":  # the doomed folder is in the trash and half deleted
        real_rmtree = shutil.rmtree

        def rmtree(path: Any, *args: Any, dir_fd: int | None = None, **kwargs: Any) -> None:
            if dir_fd is not None:  # the trash's entries are deleted below its descriptor (io.trash)
                os.unlink(os.path.join(path, "model.safetensors"), dir_fd=dir_fd)
                _hang(point)
            real_rmtree(path, *args, dir_fd=dir_fd, **kwargs)

        shutil.rmtree = rmtree  # type: ignore[assignment]
    elif point == "mkdir":  # the staging folder was just made: its writer's record is not written yet
        real_write_atomic = manager_module.io.write_bytes_atomic

        def write_atomic(url: str, data: bytes) -> None:
            if url.endswith(WRITER_NAME):
                _hang(point)
            real_write_atomic(url, data)

        manager_module.io.write_bytes_atomic = write_atomic  # type: ignore[assignment]
    elif point == "record":  # the writer's record is written under its temporary name, not renamed yet
        real_replace = os.replace

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if str(dst).endswith(WRITER_NAME):
                _hang(point)
            real_replace(src, dst, *args, **kwargs)

        os.replace = replace
    elif point == "unrecorded":  # committing: the writer's record is removed, the manifest not written yet
        import ckptctl.io.commit as commit_module  # the commit protocol (`Publish.finish`) writes the marker

        def write_marker(*args: Any, **kwargs: Any) -> None:
            _hang(point)

        commit_module.write_marker = write_marker  # type: ignore[assignment]
    elif point == "write":  # mid-write: the staging folder and the first entry's files are there, not the rest
        real_write_tree = manager_module.write_tree
        calls = []

        def write_tree(*args: Any, **kwargs: Any) -> Any:
            if calls:
                _hang(point)
            calls.append(args[1])
            return real_write_tree(*args, **kwargs)

        manager_module.write_tree = write_tree  # type: ignore[assignment]
    elif point == "commit":  # everything written, a rollback's superseded marks too; not committed yet
        from ckptctl.core.storage import LocalRun

        def commit(*args: Any, **kwargs: Any) -> Any:
            _hang(point)

        LocalRun.commit = commit  # type: ignore[method-assign]
    elif point == "exchanged":  # re-saving a step: just after the atomic swap of the old and new folders
        real_exchange = manager_module.io.exchange

        def exchange(a: str, b: str) -> bool:
            swapped = real_exchange(a, b)
            _hang(point)
            return swapped

        manager_module.io.exchange = exchange  # type: ignore[assignment]
    else:
        raise SystemExit(f"unknown point {point}")


def crash_scenario(root: str, mode: str, state: dict[str, Any]) -> None:
    """`loop`: save steps 1, 2, 3, ... until killed. Other modes: save step 1 (and 2), then hang at `mode`."""
    manager = CheckpointManager(root, policy=RetentionPolicy(keep_last=1) if mode == "retention" else None)
    fill(state, 1)
    started = time.perf_counter()
    manager.save(1, state)
    print(f"committed 1 {time.perf_counter() - started:.4f}", flush=True)
    if mode == "loop":
        step = 2
        while True:
            fill(state, step)
            print(f"begin {step}", flush=True)
            manager.save(step, state)
            step += 1
    if mode == "exchanged":
        fill(state, 2)
        manager.save(2, state)
        _install_hang(mode)
        fill(state, 2.5)  # a different content for the same step
        manager.save(2, state)
    else:
        _install_hang(mode)
        fill(state, 2)
        manager.save(2, state)
    manager.close()  # as a training loop ends: waits for the deletions of retention
    print("finished", flush=True)


def _kill_when_due(pid: int, out: Any, mode: str, fraction: float) -> list[str]:
    lines: list[str] = []
    save_seconds = 0.0
    for line in out:
        lines.append(line.strip())
        if line.startswith("committed 1 "):
            save_seconds = float(line.split()[2])
        if mode == "loop" and line.startswith("begin 2"):
            time.sleep(fraction * save_seconds)
            break
        if line.startswith(f"at {mode}"):
            break
    else:
        raise SystemExit(f"the scenario ended before its kill point: {lines}")
    os.kill(pid, signal.SIGKILL)
    return lines


def crash(spec_path: str) -> None:
    """Run each crash case of a JSON spec (`[[root, mode, fraction], ...]`) in a forked child and SIGKILL it.

    The state is built once here and inherited by every child, so that a case costs a save, not a torch
    import. This process itself never saves (no hashing threads exist when it forks).
    """
    with open(spec_path) as f:
        cases = json.load(f)
    state = big_state()
    for root, mode, fraction in cases:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its stdout is the pipe
            os.close(read_end)
            os.dup2(write_end, 1)
            try:
                crash_scenario(root, mode, state)
            finally:
                os._exit(1)  # never reached when killed as planned
        os.close(write_end)
        with os.fdopen(read_end) as out:
            lines = _kill_when_due(pid, out, mode, fraction)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        print(json.dumps({"root": root, "killed": killed, "lines": lines}), flush=True)


def small_state(value: float) -> dict[str, Any]:
    """A linear layer, SGD with momentum and a counter, every number equal to `value` (which save it is)."""
    model = nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
            optimizer.state[p]["momentum_buffer"].fill_(value)
    return {"model": model, "optimizer": optimizer, "counter": {"step": value}}


def interrupt(spec_path: str) -> None:
    """Run each save of a JSON spec (`[[root, step, point, kill, restore_step], ...]`) in a forked child that
    stops at `point` (`_install_hang`), after restoring `restore_step` first when it is not null (a
    rollback); SIGKILL it when `kill`, else leave it running. Prints one JSON line per save: root, pid,
    killed.

    This process never saves or restores: the children fork from a process without ckptctl's threads.
    """
    with open(spec_path) as f:
        cases = json.load(f)
    # An optimizer's first step imports torch's compiler (~1 s of CPU): once here, inherited by every child, rather
    # than once in each. Building a state starts none of ckptctl's threads.
    small_state(0.0)
    for root, step, point, kill, restore_step in cases:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            # Both streams into the pipe: a child left running must not hold this worker's output open.
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            try:
                manager = CheckpointManager(root)
                state = small_state(0.0)
                if restore_step is not None:
                    manager.restore(state, step=restore_step)
                _install_hang(point)
                manager.save(step, small_state(float(step) + 0.5))
            finally:
                os._exit(1)  # never reached: the child stops at `point`
        os.close(write_end)
        with os.fdopen(read_end) as out:
            lines: list[str] = []
            for line in out:
                lines.append(line.strip())
                if line.startswith(f"at {point}"):
                    break
            else:
                raise SystemExit(f"the save of step {step} ended before {point}: {lines}")
        killed = False
        if kill:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        print(json.dumps({"root": root, "step": step, "pid": pid, "killed": killed}), flush=True)


#: How many save loops `kill_saves` runs at once (their fsyncs overlap: the wall time of the test shrinks).
_KILL_GROUP = 10


def kill_saves(spec_path: str) -> None:
    """SIGKILL saves, sync or async, at random moments and at named ones. For each `[root, async_save,
    point]` of a JSON spec (`{"seed": N, "runs": [...]}`) a forked child commits steps 1 and 2, waits for
    the word to go on, and then

    - `point` null: saves 3, 4, ... without end (an async manager's next `save` waits for the previous one,
      so it is always saving) and is killed after a random delay of up to twice the duration of its second
      save, so that the kills land at every moment of a save;
    - else: saves step 3 (`exchanged`: step 2 again), stops at `point` (`_install_hang`) and is killed.

    Prints one JSON line per run: root, pid, killed.

    The state is built once here (building an optimizer's state imports torch's compiler: seconds) and
    inherited by every child. This process never saves: the children fork from a process without
    ckptctl's threads.
    """
    with open(spec_path) as f:
        spec = json.load(f)
    chance = random.Random(spec["seed"])
    state = small_state(1.0)
    gc.freeze()  # the children's garbage collections leave the inherited objects' pages shared
    runs = spec["runs"]
    for first in range(0, len(runs), _KILL_GROUP):
        children = [_save_loop(*run, state) for run in runs[first : first + _KILL_GROUP]]
        seconds = {}
        for root, _, _, out, _ in children:
            line = out.readline()
            if not line.startswith("ready "):
                raise SystemExit(f"the saves in {root} did not start: {line!r}")
            seconds[root] = float(line.split()[1])
        due = []
        for root, pid, point, out, go in children:
            os.write(go, b"x")
            os.close(go)
            delay = 0.0 if point else chance.uniform(0, 2 * seconds[root])
            due.append((time.monotonic() + delay, root, pid, point, out))
        for when, root, pid, point, out in sorted(due):
            if point and not (line := out.readline()).startswith(f"at {point}"):
                raise SystemExit(f"the save in {root} did not stop at {point}: {line!r}")
            time.sleep(max(0.0, when - time.monotonic()))
            os.kill(pid, signal.SIGKILL)
            out.close()
            _, status = os.waitpid(pid, 0)
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            print(json.dumps({"root": root, "pid": pid, "killed": killed}), flush=True)


def _save_loop(
    root: str, async_save: bool, point: str | None, state: dict[str, Any]
) -> tuple[str, int, str | None, Any, int]:
    """Fork a child that saves `state` into `root` as `kill_saves` says: its pid, its stdout and the pipe
    that tells it to go on after its first two saves."""
    read_end, write_end = os.pipe()
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        os.close(go_write)
        os.dup2(write_end, 1)
        try:
            manager = CheckpointManager(root, async_save=async_save)
            manager.save(1, state)
            started = time.perf_counter()  # the first save paid for lazy imports: time the second
            manager.save(2, state)
            manager.wait()
            print(f"ready {time.perf_counter() - started:.6f}", flush=True)
            os.read(go_read, 1)
            if point:
                _install_hang(point)
                manager.save(2 if point == "exchanged" else 3, state)
                manager.wait()
            for step in range(3, 1_000_000):
                state["counter"]["step"] = float(step)
                manager.save(step, state)
        finally:
            os._exit(1)  # never reached: killed mid-save
    os.close(write_end)
    os.close(go_read)
    return root, pid, point, os.fdopen(read_end), go_write


def fresh(spec_path: str) -> None:
    """Actions of a JSON spec in this fresh process, in order: `["save", root, step]` saves a `small_state`
    of the step's value and closes the manager; `["restore", root]` restores the newest valid checkpoint.
    Prints one JSON line per action (the restored step and the value it holds)."""
    with open(spec_path) as f:
        actions = json.load(f)
    for action, root, *args in actions:
        manager = CheckpointManager(root)
        if action == "save":
            manager.save(args[0], small_state(float(args[0])))
            manager.close()
            print(json.dumps({"saved": args[0]}), flush=True)
        else:
            state = small_state(-1.0)
            step = manager.restore(state)
            value = {float(state["model"].weight.flatten()[0]), float(state["counter"]["step"])}
            print(json.dumps({"restored": step, "values": sorted(value)}), flush=True)


def _fsdp_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _fsdp_state(seed: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model = _fsdp_model(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": ResumableSampler(16, seed)}


def _full_state(state: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(state["model"], options=options),
        "optimizer": get_optimizer_state_dict(state["model"], state["optimizer"], options=options),
        "scheduler": state["scheduler"].state_dict(),
        "sampler": state["sampler"].state_dict(),
    }


def _init_group(rank: int, world: int, root: str, name: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # the suite's ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(root, name)}", rank=rank, world_size=world)


def _leave_group() -> None:
    import torch.distributed as dist

    # No rank tears the group down while another still talks to it (gloo aborts the process then).
    dist.barrier()
    dist.destroy_process_group()


def _fsdp_save_rank(rank: int, world: int, root: str) -> None:

    _init_group(rank, world, root, "store-save")
    state = _fsdp_state(seed=0)
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)
    batches = iter(state["sampler"])
    for _ in range(3):
        x = torch.randn(4, 8) + next(batches)
        state["model"](x).pow(2).mean().backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state["scheduler"].step()
    CheckpointManager(os.path.join(root, "run")).save(3, state, metrics={"loss": 0.25})
    full = _full_state(state)
    after = draws()
    if rank == 0:
        torch.save(full, os.path.join(root, "expected.pt"))
    torch.save(after, os.path.join(root, f"draws-save-{rank}.pt"))
    _async_saves(rank, root, state)  # ends with rank 1 SIGKILLed: no barrier, no teardown
    os._exit(0)


def _train_step(state: dict[str, Any]) -> None:
    x = torch.randn(4, 8)
    state["model"](x).pow(2).mean().backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()
    state["scheduler"].step()


def _async_saves(rank: int, root: str, state: dict[str, Any]) -> None:
    """Async saves of the state `_fsdp_save_rank` saved at step 3 into `async/`; rank 0 reports in
    `async.json`.

    1. step 3: every rank's background write waits until the loop has trained one more step (its
       collectives on the default group meanwhile); the checkpoint must still hold the state at `save`.
    2. step 4: rank 1's background write fails (ENOSPC); the next `save` raises it on both ranks.
    3. step 6: rank 1 is SIGKILLed while it writes; rank 0's `wait` raises, nothing is committed.
    """
    import threading

    import ckptctl.core.distributed as dist_
    from ckptctl.errors import CkptctlError
    from ckptctl.formats import state_tree

    report: dict[str, Any] = {}
    manager = CheckpointManager(os.path.join(root, "async"), async_save=True)
    opened = threading.Event()
    real_save_dcp = dist_.save_dcp

    def gated(*args: Any, **kwargs: Any) -> Any:
        assert opened.wait(timeout=120), "the loop never let the background write go on"
        return real_save_dcp(*args, **kwargs)

    dist_.save_dcp = gated  # type: ignore[assignment]
    manager.save(3, state, metrics={"loss": 0.25})
    report["committed_while_writing"] = manager.all_steps()
    _train_step(state)  # FSDP all-gathers on the default group while the save's thread waits
    opened.set()
    manager.wait()
    dist_.save_dcp = real_save_dcp  # type: ignore[assignment]
    report["committed"] = manager.all_steps()

    real_write = state_tree.write_files

    def no_space(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    if rank == 1:
        state_tree.write_files = no_space  # type: ignore[assignment]
    manager.save(4, state)  # returns: the failure happens in the background
    try:
        manager.save(6, state)
        report["next_save"] = "returned"
    except CkptctlError as exc:
        report["next_save"] = f"{type(exc).__name__}: {exc}"
    state_tree.write_files = real_write  # type: ignore[assignment]
    report["after_failure"] = sorted(os.listdir(os.path.join(root, "async")))
    torch.save(report, os.path.join(root, f"async-report-{rank}.pt"))

    def killed(*args: Any, **kwargs: Any) -> Any:
        with open(os.path.join(root, "rank-1-killed"), "w") as f:
            f.write("killed mid-write\n")
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == 1:
        state_tree.write_files = killed  # type: ignore[assignment]
    manager.save(6, state)
    try:
        manager.wait()
        report["wait_after_kill"] = "returned"
    except CkptctlError as exc:
        report["wait_after_kill"] = f"{type(exc).__name__}: {exc}"
    torch.save(report, os.path.join(root, f"async-report-{rank}.pt"))


def _fsdp_restore_rank(rank: int, world: int, root: str) -> None:

    _init_group(rank, world, root, "store-restore")
    for run in ("run", "single"):
        state = _fsdp_state(seed=7)  # other weights, no optimizer state yet
        step = CheckpointManager(os.path.join(root, run)).restore(state)
        assert step == 3, step
        full = _full_state(state)
        after = draws()
        if rank == 0:
            torch.save(full, os.path.join(root, f"restored-{run}.pt"))
        torch.save(after, os.path.join(root, f"draws-restore-{run}-{rank}.pt"))
    _leave_group()


def fsdp_one_rank(rank: int, root: str) -> None:
    """A gloo group of ONE rank training an FSDP2 model (DTensor parameters, as on one GPU): a sync save at
    step 1 and an async one at step 2 into `root/run`, restored into fresh states (each step's full state,
    as saved and as restored, in `saved-N.pt`/`restored-N.pt`); then `root/single`, a single-process save,
    restored into a fresh FSDP2 state (`restored-single.pt`)."""
    from tests.writers.ranks import join_gloo

    join_gloo(rank, 1, rendezvous=os.path.join(root, "store"))
    run = os.path.join(root, "run")
    state = _fsdp_state(seed=0)
    for step, manager in ((1, CheckpointManager(run)), (2, CheckpointManager(run, async_save=True))):
        _train_step(state)
        manager.save(step, state)
        manager.wait()
        torch.save(_full_state(state), os.path.join(root, f"saved-{step}.pt"))
    for step in (1, 2):
        fresh = _fsdp_state(seed=7)  # other weights, no optimizer state yet
        assert CheckpointManager(run).restore(fresh, step=step) == step
        torch.save(_full_state(fresh), os.path.join(root, f"restored-{step}.pt"))
    fresh = _fsdp_state(seed=7)  # its sampler keeps its state (the save holds none)
    CheckpointManager(os.path.join(root, "single")).restore(fresh)
    torch.save(_full_state(fresh), os.path.join(root, "restored-single.pt"))
    _leave_group()


def fsdp(root: str) -> None:
    """Save with 2 ranks; in a single process restore it and save it again as a single-process checkpoint
    (run `single`); then restore both runs in 2 fresh ranks. Every process is forked from the writers'
    pre-imported server (`tests.writers.ranks`): this function runs in the test process."""
    from tests.writers.ranks import run_ranks

    context = run_ranks(_fsdp_save_rank, (2, root), 2, join=False)
    for process in context.processes:  # not `join()`: it stops rank 0 as soon as rank 1 is SIGKILLed
        process.join()
    codes = [p.exitcode for p in context.processes]
    if codes != [0, -signal.SIGKILL] or not os.path.exists(os.path.join(root, "rank-1-killed")):
        sign = next((c for c in codes if c and c < 0), None)
        # "terminated with signal" lets the fixture build once more (gloo aborts, see tests/core/conftest)
        raise RuntimeError(f"save ranks ended with {codes}" + (f" (terminated with signal {-sign})" if sign else ""))
    run_ranks(_single_process_resave, (root,), 1)
    run_ranks(_fsdp_restore_rank, (2, root), 2)


def _single_process_resave(rank: int, root: str) -> None:
    """Restore the 2-rank run in one process (no process group) and save it again as run `single`."""
    torch.set_num_threads(1)
    model = _fsdp_model(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": ResumableSampler(16, 5)}
    CheckpointManager(os.path.join(root, "run")).restore(state)
    CheckpointManager(os.path.join(root, "single")).save(3, state)


def autosave(root: str, ending: str) -> None:
    """Saves every 4 steps and leaves the last step (6) to AutoSaver's atexit hook; `raise` ends the
    program with an uncaught exception instead, after which nothing more may be saved."""
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("typer", "rich", "click"))), flush=True)
    counter = torch.zeros(1)
    state = {"counter": counter}
    saver = AutoSaver(CheckpointManager(root, async_save=True), state, every_steps=4)
    for step in range(7):
        counter += 1
        saver.step(step)
    if ending == "raise":
        raise RuntimeError("the loop crashed after step 6")


def second_writer(root: str) -> None:
    """A second manager (retention keep_last 3) saving into `root` what stdin says, one line at a time:
    `save N` saves step N (every number of it N); `hold N` saves step N but stops once its manifest is written,
    before the rename that commits it, says `at rename` and waits for the next line. Prints `saved N` after
    each save."""
    import builtins

    manager = CheckpointManager(root, policy=RetentionPolicy(keep_last=3))
    real_rename = os.rename
    held: list[bool] = [False]

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if held[0] and ".staging-" in str(src):
            held[0] = False
            print("at rename", flush=True)
            builtins.input()  # the other writer commits its newer step meanwhile
        real_rename(src, dst, *args, **kwargs)

    os.rename = rename
    for line in sys.stdin:
        command, step = line.split()
        held[0] = command == "hold"
        manager.save(int(step), small_state(float(step)))
        print(f"saved {step}", flush=True)
    manager.close()


COMMANDS: dict[str, Callable[..., None]] = {
    "roundtrip-save": roundtrip_save,
    "roundtrip-restore": roundtrip_restore,
    "crash": crash,
    "autosave": autosave,
    "interrupt": interrupt,
    "fresh": fresh,
    "kill-saves": kill_saves,
    "second-writer": second_writer,
}


def run_command(rank: int, args: list[str], stdout: str, stderr: str) -> None:
    """`COMMANDS[args[0]](*args[1:])` in a process forked by `tests.writers.ranks.run_ranks`
    (`tests.core.util.run_worker`), what it prints going to the files `stdout` and `stderr`."""
    os.setsid()  # a process group with what it forks, for `run_worker` to end at once on a failure
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 does for a fresh interpreter: workers run side by side
    sys.stdout.flush()
    sys.stderr.flush()
    with open(stdout, "w") as out, open(stderr, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    try:
        COMMANDS[args[0]](*args[1:])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    COMMANDS[sys.argv[1]](*sys.argv[2:])
