"""`ckptctl demo`: a tiny real training run with the core, so every command has real checkpoints to work on.

Not in `ckptctl.ops`: it writes sample runs of several frameworks (by their folder names), while ops never
name a framework.

Writes, under DIR:
- `native/`: single-process run saved by `CheckpointManager` every 10 steps (safetensors + JSON);
- `distributed/`: a 2-rank gloo run with FSDP2 `fully_shard`, saved by `CheckpointManager` (sharded DCP);
- `dcp/`: the same 2-rank run saved with plain `torch.distributed.checkpoint.save` (a foreign layout);
- `hf/`: the final model exported as a Hugging Face style folder (model.safetensors + config.json);
- `.ckptctl-demo`: the marker that lets a later `demo --force` replace the folder, and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptctl import io
from ckptctl.errors import CkptctlError

SAVE_EVERY = 10
HIDDEN = 64
VOCAB = 256
MARKER = ".ckptctl-demo"


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What the demo wrote."""

    root: str
    runs: tuple[str, ...]
    steps: int

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": 1, "root": self.root, "runs": list(self.runs), "steps": self.steps}


def _model() -> Any:
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        """Embedding, two residual MLP blocks and an output head: enough structure to be realistic."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.blocks = nn.ModuleList(
                nn.Sequential(
                    nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN)
                )
                for _ in range(2)
            )
            self.norm = nn.LayerNorm(HIDDEN)
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for block in self.blocks:
                x = x + block(x)
            logits: torch.Tensor = self.head(self.norm(x))
            return logits

    return TinyLM()


def _train_steps(model: Any, optimizer: Any, scheduler: Any, first: int, last: int, on_step: Any) -> None:
    import torch

    for step in range(first, last + 1):
        tokens = torch.randint(0, VOCAB, (8, 16))
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        on_step(step, float(loss.detach()))


def run_demo(
    root: str,
    *,
    steps: int = 30,
    distributed: bool = True,
    force: bool = False,
    on_stage: Callable[[str], None] | None = None,
) -> DemoResult:
    """Train the tiny model and write the demo runs under `root`.

    Args:
        root: a local folder, absent or empty (or one an earlier demo wrote, with `force`).
        steps: training steps; a checkpoint every `SAVE_EVERY`.
        distributed: also run the 2-rank part (`distributed/` and `dcp/`).
        force: replace a folder an earlier demo wrote.
        on_stage: told what the demo is doing, once the folder is accepted (the run takes tens of seconds).
    """
    if not io.is_local(root):  # the demo trains with torch.distributed on this machine, into its disk
        raise CkptctlError("the demo writes to a local folder", "pass a local path")
    root = io.local_path(root)
    _prepare(root, force=force)
    say = on_stage or (lambda _: None)
    say(f"training a tiny model for {steps} steps into {root}/native (a checkpoint every {SAVE_EVERY})")

    import torch

    from ckptctl.core import CheckpointManager, RetentionPolicy

    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    manager = CheckpointManager(os.path.join(root, "native"), policy=RetentionPolicy(keep_last=3))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}

    def save(step: int, loss: float) -> None:
        if step % SAVE_EVERY == 0:
            manager.save(step, state, metrics={"loss": loss})
            say(f"saved native/step-{step} (loss {loss:.3f})")

    _train_steps(model, optimizer, scheduler, 1, steps, save)
    manager.wait()
    runs = ["native"]
    _export_hf(os.path.join(root, "hf"), model)
    say("exported the model to hf/")
    runs.append("hf")
    if distributed:
        say(f"training on 2 ranks (gloo, FSDP2) for {steps} steps into distributed/ and dcp/ (starting 2 processes)")
        _spawn_distributed(root, steps, say)
        say("saved distributed/ and dcp/")
        runs += ["distributed", "dcp"]
    return DemoResult(root, tuple(runs), steps)


def _spawn_distributed(root: str, steps: int, say: Callable[[str], None]) -> None:
    """Run the 2-rank part, once more if a rank was killed by a signal.

    gloo on a loaded CPU machine occasionally aborts a rank while the process group starts or shuts down
    ("terminate called without an active exception", SIGABRT), after or before any real work. A fresh
    process group on a new port is what a user would do by hand; a rank that fails with a Python error is
    a real failure and is not retried.
    """
    import shutil

    import torch

    for attempt in (1, 2):
        try:
            torch.multiprocessing.spawn(_distributed_worker, args=(2, _free_port(), root, steps), nprocs=2, join=True)
            return
        except torch.multiprocessing.ProcessExitedException as exc:
            if attempt == 2 or exc.signal_name is None:
                raise
            say(f"a rank was killed by {exc.signal_name} (gloo start-up or teardown); running the 2-rank part again")
            for name in ("distributed", "dcp"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _prepare(root: str, *, force: bool) -> None:
    """Create `root` with its marker; with `force`, first delete a folder an earlier demo wrote.

    `--force` deletes a whole folder, so it only ever deletes one that carries the demo's marker, and never
    the root, the home folder, the working folder or one of its parents, whatever they hold.
    """
    if os.path.lexists(root) and not os.path.isdir(root):
        raise CkptctlError(f"{root} exists and is not a folder", "choose another folder")
    if os.path.isdir(root) and os.listdir(root):
        if not force:
            raise CkptctlError(
                f"{root} is not empty", "pass --force to replace an earlier demo, or choose another folder"
            )
        io.refuse_to_replace_precious(root, "choose a new folder for the demo")
        if os.path.islink(root) or not os.path.isfile(os.path.join(root, MARKER)):
            raise CkptctlError(
                f"refusing to replace {root}: it is not a folder an earlier `ckptctl demo` wrote (no {MARKER} in it)",
                "choose another folder, or delete this one yourself if you are sure",
            )
        shutil.rmtree(root)
    os.makedirs(root, exist_ok=True)
    # Written first, so that a demo interrupted half-way can still be replaced with --force.
    with open(os.path.join(root, MARKER), "w") as f:
        f.write("written by `ckptctl demo`; `ckptctl demo --force` may delete this folder\n")


def _export_hf(folder: str, model: Any) -> None:
    from ckptctl.formats.safetensors import write_file

    os.makedirs(folder, exist_ok=True)
    tensors = {name: t.detach() for name, t in model.state_dict().items()}
    write_file(os.path.join(folder, "model.safetensors"), tensors, {"format": "pt"})
    config = {"model_type": "ckptctl-tiny-lm", "hidden_size": HIDDEN, "vocab_size": VOCAB, "num_hidden_layers": 2}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _distributed_worker(rank: int, world_size: int, port: int, root: str, steps: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from ckptctl.core import CheckpointManager

    # The residual blocks return views; harmless here (no in-place ops on them), so keep the demo quiet.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = _model()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
        manager = CheckpointManager(os.path.join(root, "distributed"))
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}

        def save(step: int, loss: float) -> None:
            if step % SAVE_EVERY:
                return
            manager.save(step, state, metrics={"loss": loss})
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, "dcp", f"step-{step}"))

        _train_steps(model, optimizer, scheduler, 1, steps, save)
        manager.wait()
        # Without a last barrier, gloo teardown sometimes aborts a rank that exits first.
        dist.barrier()
    finally:
        dist.destroy_process_group()
