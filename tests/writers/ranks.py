"""Start a writer's CPU ranks forked from a server that has imported torch once, rather than each from a fresh
interpreter (`torch.multiprocessing.spawn`).

A spawned rank spends 2-4 CPU-seconds importing torch, `torch.distributed` and transformers' models before it
does anything, and the suite starts dozens of ranks; a rank forked by multiprocessing's forkserver starts
with them imported. The server is a clean process of its own (started by this test process on first use,
with this process's `sys.path` and working folder): it imports the `PRELOAD` modules and nothing else, starts
no thread and runs no tensor op, so forking it is safe where forking pytest (threads, open process groups,
OpenMP's pool) is not. What a rank imports beyond `PRELOAD` (DeepSpeed, verl, Megatron) it imports itself, as
under `spawn`, so that what those frameworks read from the environment as they import (DeepSpeed's
`DS_ACCELERATOR`) is what the rank set.

A forked rank has the server's environment, not this process's at the time of the call: `run_ranks` hands
each rank this process's environment and sets it before calling `fn`, as a spawned rank would inherit it.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import multiprocessing.forkserver
import os
import socket
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

__all__ = ["PRELOAD", "free_port", "freeze_imports", "join_gloo", "run_ranks", "torchrun_variables"]

#: What the server imports once (what every rank imports first; most of a fresh rank's start-up).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.multiprocessing",
    # What the writers' models are built from (~1.5 CPU-s of imports beyond torch). transformers reads its
    # settings from the environment as it imports; the server's is the test process's at its start, which
    # tests/conftest.py has set by then and no rank changes (TRANSFORMERS_VERBOSITY, HF_HUB_OFFLINE).
    "transformers.modeling_utils",
    # What `torch.compile` imports when it wraps a function (~1.1 CPU-s): DeepSpeed's ZeRO optimizer check imports
    # its Muon optimizer, which compiles a function as it is defined, in every rank that builds a ZeRO engine (the
    # DeepSpeed writers, proofs and fault loaders); AReaL's tree attention likewise. Importing it starts no thread.
    "torch._inductor.compile_fx",
)


def run_ranks(
    fn: Callable[..., None],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    environment: Mapping[str, str] | None = None,
) -> Any:
    """`fn(rank, *args)` in `nprocs` processes forked from the pre-imported server, joined; raises as
    `torch.multiprocessing.spawn` does (`ProcessRaisedException`, `ProcessExitedException`). With `join=False`
    returns `spawn`'s `ProcessContext` unjoined (its `processes`, their exit codes). The ranks' environment is
    this process's with `environment` added.

    `fn` and `args` travel by pickle, as with `spawn`: `fn` is a module-level function."""
    import torch.multiprocessing as torch_mp

    _preload_once()
    ranks_environment = {**os.environ, **(environment or {})}
    return torch_mp.start_processes(
        _rank, args=(fn, ranks_environment, args), nprocs=nprocs, join=join, start_method="forkserver"
    )


def _rank(rank: int, fn: Callable[..., None], environment: dict[str, str], args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(environment)
    freeze_imports()
    fn(rank, *args)


def freeze_imports() -> None:
    """Leave the objects alive now (the modules imported so far: the server's `PRELOAD`, a framework a rank has
    just imported) out of every later garbage collection (`gc.freeze`).

    Frameworks collect explicitly: DeepSpeed at each engine's set-up and save (16 times in a rank of
    `deepspeed_writer`), AReaL's `FSDPEngine.destroy` twice (once per cell of its fault loader). Each full
    collection walks every tracked object, ~380k once torch, transformers and DeepSpeed are imported (0.25
    CPU-s): half of a DeepSpeed writer rank's CPU, two thirds of AReaL's fault loader's. Modules stay imported
    whatever the collector does, so only the walk is saved; what a rank makes after this is collected as before."""
    gc.freeze()


def _preload_once() -> None:
    """Name `PRELOAD` to multiprocessing's forkserver before it starts (a server already running, started by
    other code, keeps its own list: ranks then import more themselves, nothing else changes), and stop it when
    this process exits."""
    if not _preloaded:
        multiprocessing.set_forkserver_preload(list(PRELOAD))
        atexit.register(_stop_server)
        _preloaded.append(True)


def _stop_server() -> None:
    """Stop the server and wait for it: left running, it would end on its own once this process is gone, but
    unwaited, and the CPU time of the ranks it forked would be missing from this process tree's (`time make
    test` would undercount the suite)."""
    server = multiprocessing.forkserver._forkserver
    stop = getattr(server, "_stop", None)  # CPython's own, for its tests: closes the server's pipe and waits
    if stop is not None and getattr(server, "_forkserver_pid", None) is not None:
        stop()


_preloaded: list[bool] = []


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous at MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_variables(rank: int, world: int, port: int) -> None:
    """Set what torchrun sets for a rank of `world` on this machine (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), for frameworks that read them rather than take a group."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def join_gloo(
    rank: int, world: int, *, rendezvous: str | None = None, port: int | None = None, timeout: timedelta | None = None
) -> None:
    """This rank joins a gloo group of `world` CPU ranks, at the file `rendezvous` or at 127.0.0.1:`port`
    (MASTER_ADDR and MASTER_PORT set, which some frameworks read again), with warnings off and one intra-op
    thread (the suite's ranks share 2 cores); `timeout` is torch's default where not given."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_method = f"file://{rendezvous}" if rendezvous is not None else None
    options = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, **options)
