"""A loader process whose framework loads on several gloo CPU ranks (the world size the checkpoint was saved on).

`run_ranks(module, world)` spawns `world` ranks; each calls `module.join(rank, world, port)` (it joins the
process group as the framework's workers do, and imports what it needs), then judges every cell with
`module.load` (`tests.faults.loaders.common.judge`) against its own load of the reference copy: each rank
compares the state it holds (its shards). A cell's verdict is the first rank's that is not `ok` (one that
names the damage rather than a peer's closed connection).

A damaged file fails the load on one rank while its peers may be waiting for it in a collective, and the
ranks would then meet in the wrong collectives from there on. So a rank whose load raised closes its process
group at once (its peers' collectives fail on the closed connection rather than waiting out the timeout), the
ranks tell each other through a store of their own (a `TCPStore` beside the group's) whether any failed, and
if one did they all join a new group before the next cell (then `module.regroup()`, where the framework keeps
groups of its own). The verdicts go to rank 0 through that store too.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import socket
import sys
from datetime import timedelta
from pathlib import Path

from tests.faults.loaders.common import judge, load_capturing, without_path

__all__ = ["TIMEOUT", "run_ranks"]

TIMEOUT = timedelta(seconds=60)
_PEER_GONE = ("Connection closed", "pair closure", "Connection reset")


def _rank(rank: int, module_name: str, world: int, ports: tuple[int, int], spec_path: str) -> None:
    import torch.distributed as dist

    module = importlib.import_module(module_name)
    store = dist.TCPStore("127.0.0.1", ports[1], world, is_master=rank == 0, timeout=TIMEOUT * 3)
    module.join(rank, world, ports[0])
    try:
        spec = json.loads(Path(spec_path).read_text())
        options = spec["options"]
        reference, said = load_capturing(module.load, spec["reference"], options)
        known = {without_path(m, spec["reference"]) for m in said}
        for i, cell in enumerate(spec["cells"]):
            # A rank stuck past this (a collective its peers never entered) ends the run, with every thread's
            # stack on stderr, rather than the suite.
            faulthandler.dump_traceback_later(TIMEOUT.total_seconds() * 2, exit=True)
            print(f"rank {rank}: {cell['id']}", file=sys.stderr, flush=True)
            verdict = judge(module.load, cell["path"], options, reference, known)
            if verdict.startswith("failed") and dist.is_initialized():
                dist.destroy_process_group()
            store.set(f"cell{i}/rank{rank}", verdict)
            verdicts = [store.get(f"cell{i}/rank{r}").decode() for r in range(world)]
            if any(v.startswith("failed") for v in verdicts):
                if dist.is_initialized():
                    dist.destroy_process_group()
                prefixed = dist.PrefixStore(f"group{i}", store)
                dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world, timeout=TIMEOUT)
                if hasattr(module, "regroup"):
                    module.regroup()
            if rank == 0:
                named = [v for v in verdicts if v != "ok" and not any(s in v for s in _PEER_GONE)]
                cell["verdict"] = (named or [v for v in verdicts if v != "ok"] or ["ok"])[0]
        faulthandler.cancel_dump_traceback_later()
        if rank == 0:
            out = {"reference": "ok", **{c["id"]: c["verdict"] for c in spec["cells"]}}
            Path(spec["out"]).write_text(json.dumps(out, indent=1))
        store.set(f"done/rank{rank}", "1")
        for r in range(world):
            store.get(f"done/rank{r}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(module_name: str, world: int) -> None:
    """The loader process's main (`python -m MODULE SPEC.json`): `world` spawned ranks (see the module's doc)."""
    import torch.multiprocessing as mp

    ports = (_free_port(), _free_port())
    mp.spawn(_rank, args=(module_name, world, ports, sys.argv[1]), nprocs=world, join=True)
