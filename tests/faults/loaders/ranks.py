"""A loader process whose framework loads on several gloo CPU ranks (the world size the checkpoint was saved on).

`run_ranks(module, world, spec)` starts `world` ranks (forked from the writers' pre-imported server,
`tests.writers.ranks`); each calls `module.join(rank, world, port)` (it joins the
process group as the framework's workers do, and imports what it needs), then judges the cells with
`module.load` (`tests.faults.loaders.common.judge`) against its own load of the reference copy: each rank
compares the state it holds (its shards). A cell's verdict is the first rank's that is not `ok`, preferring one
that names the damage over a peer's closed connection.

A damaged file can fail the load on one rank while its peers go on into a collective that rank never enters
(ByteCheckpoint's closing barrier after a rank's missing extra state). After each cell the ranks tell each other
their verdicts through a store of their own (a `TCPStore` beside the group's); when one failed they all join a
new group before the next cell (then `module.regroup()`, where the framework keeps groups of its own). A rank
whose load failed and whose peers do not answer within `GRACE` meets them in barriers (`_verdicts`): verl's and
ByteCheckpoint's loads end with one; it watches the store while it waits in each. When a barrier fails (they
wait in another collective, and the group's timeout ends it), or the peers answer while it waits in one, it
records the cell and exits, and the ranks are started again from the next cell.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.faults.loaders.common import judge, load_capturing, without_path
from tests.writers.ranks import free_port
from tests.writers.ranks import run_ranks as fork_ranks

__all__ = ["GRACE", "TIMEOUT", "run_ranks"]

TIMEOUT = timedelta(seconds=120)
#: How long a rank whose load failed waits for its peers' verdicts before it meets them in a barrier: a peer's
#: load that goes on without it says its verdict well within this, one blocked in a barrier never does (a peer
#: slower than this costs a restart of the ranks, not a verdict: `_verdicts`).
GRACE = timedelta(seconds=1)
#: How long that barrier may stay unmet while the peers say nothing: they wait in another collective, which only
#: the group's `TIMEOUT` (minutes) would end. The rank ends the spawn instead; its closed connections end the
#: peers' collective at once (their verdict names the closed connection, which `_merge` passes over for this
#: rank's, the one that names the damage), and the ranks start again from the next cell.
STUCK = timedelta(seconds=10)
#: How often a rank whose load failed looks for its peers' verdicts.
_POLL = timedelta(seconds=0.02)
_PEER_GONE = ("Connection closed", "pair closure", "Connection reset")
_ABANDONED = 3
_MAX_BARRIERS = 8


def _rank(rank: int, module_name: str, world: int, ports: tuple[int, int], spec_path: str, start: int) -> None:
    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where a rank is
    module = importlib.import_module(module_name)
    store = dist.TCPStore("127.0.0.1", ports[1], world, is_master=rank == 0, timeout=TIMEOUT * 2)
    module.join(rank, world, ports[0])
    spec = json.loads(Path(spec_path).read_text())
    options = spec["options"]
    mine = Path(f"{spec['out']}.rank{rank}")
    reference, said = load_capturing(module.load, spec["reference"], options)
    known = {without_path(m, spec["reference"]) for m in said}
    for i, cell in enumerate(spec["cells"][start:], start):
        # A rank stuck past this ends the run, with every thread's stack on stderr, rather than the suite.
        faulthandler.dump_traceback_later(TIMEOUT.total_seconds() * 2, exit=True)
        verdict = judge(module.load, cell["path"], options, reference, known)
        with mine.open("a") as f:
            f.write(json.dumps({"id": cell["id"], "verdict": verdict}) + "\n")
        store.set(f"cell{i}/rank{rank}", verdict)
        verdicts = _verdicts(store, i, world, failed=verdict.startswith("failed"))
        if verdicts is None:
            Path(f"{spec['out']}.abandoned").write_text(str(i))
            os._exit(_ABANDONED)  # closes this rank's connections: the spawn ends, and starts again after i
        if any(v.startswith("failed") for v in verdicts):
            if dist.is_initialized():
                dist.destroy_process_group()
            prefixed = dist.PrefixStore(f"group{i}", store)
            dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world, timeout=TIMEOUT)
            if hasattr(module, "regroup"):
                module.regroup()
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()
    store.set(f"done/rank{rank}", "1")
    if rank == 0:  # the store's server: it stays until every rank has said it is done with it
        for r in range(world):
            store.get(f"done/rank{r}")


def _verdicts(store: Any, i: int, world: int, failed: bool) -> list[str] | None:
    """Every rank's verdict on cell `i`; None when this rank's load failed and its peers are stuck in a
    collective it left (a barrier unmet for `STUCK`), or got on without a barrier it had started.

    Such a rank meets its peers in barriers while they do not answer within `GRACE`: verl's
    `FSDPCheckpointManager.load_checkpoint` and ByteCheckpoint's `FSDP2Checkpointer.load` end with one (verl's
    once per role loaded). It watches the store while it waits in each: a barrier left unmet when the peers
    answer would leave the ranks' next groups out of step (seen: both ranks of the next cell stuck in other
    collectives), so the rank ends the spawn as after a failed barrier. A barrier the group's timeout ends
    means they wait in another collective."""
    import torch.distributed as dist

    keys = [f"cell{i}/rank{r}" for r in range(world)]
    if not failed:
        return [store.get(key).decode() for key in keys]
    for _ in range(_MAX_BARRIERS):
        if _answered(store, keys, GRACE):
            return [store.get(key).decode() for key in keys]
        barrier = dist.barrier(async_op=True)
        stuck = time.monotonic() + STUCK.total_seconds()
        while not barrier.is_completed():
            if store.check(keys) or time.monotonic() > stuck:
                return None
            time.sleep(_POLL.total_seconds())
        try:
            barrier.wait()
        except RuntimeError:
            return None
    return None


def _answered(store: Any, keys: list[str], within: timedelta) -> bool:
    """Whether the store holds every key within `within`."""
    deadline = time.monotonic() + within.total_seconds()
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL.total_seconds())
    return True


def _merge(spec: dict[str, Any], world: int) -> dict[str, str]:
    said: dict[str, list[str]] = {}
    for rank in range(world):
        lines = Path(f"{spec['out']}.rank{rank}").read_text().splitlines()
        for record in map(json.loads, lines):
            said.setdefault(record["id"], []).append(record["verdict"])
    verdicts = {"reference": "ok"}
    for cell in spec["cells"]:
        bad = [v for v in said[cell["id"]] if v != "ok"]
        named = [v for v in bad if not any(s in v for s in _PEER_GONE)]
        verdicts[cell["id"]] = (named or bad or ["ok"])[0]
    return verdicts


def run_ranks(module_name: str, world: int, spec_path: str, environment: Mapping[str, str] | None = None) -> None:
    """`world` ranks of the loader `module_name` on the spec at `spec_path` (see the module's doc), with
    `environment` added to this process's; the merged verdicts written to the spec's `out`."""
    import torch.multiprocessing as mp

    spec = json.loads(Path(spec_path).read_text())
    abandoned = Path(f"{spec['out']}.abandoned")
    start = 0
    while True:
        ports = (free_port(), free_port())
        try:
            fork_ranks(_rank, (module_name, world, ports, spec_path, start), world, environment=environment)
            break
        except (mp.ProcessExitedException, mp.ProcessRaisedException):  # a peer may fail on the closed store
            if not abandoned.exists():
                raise
            start = int(abandoned.read_text()) + 1
            abandoned.unlink()
    Path(spec["out"]).write_text(json.dumps(_merge(spec, world), indent=1))
