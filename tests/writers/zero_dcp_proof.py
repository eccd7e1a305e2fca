"""The proof of `reshard --to dcp` from a DeepSpeed ZeRO tag (`ckptctl.families.zero_tag.state`), on gloo
CPU ranks.

1. `write_zero_fp32` (a writer of its own, cached apart from the proof): DeepSpeed 0.19 on 2 ranks trains
   `TinyNet` in fp32 with torch's AdamW in two groups (decay and no decay: `reshard_dcp_proof.adamw`, given other
   settings than that proof's optimizer has, so that a resumed optimizer can only have them from the
   checkpoint) and a StepLR, under each of `RUNS` (ZeRO-2; ZeRO-3; ZeRO-3 with a `sub_group_size` that cuts the
   groups into several flat partitions each) for two steps, and saves (`{run}/global_step2`, `latest`, a client
   state). Then a fresh engine of each run loads the save with DeepSpeed's own `load_checkpoint` and rank 0
   records DeepSpeed's own view of the state (`deepspeed-{run}.pt`): the weights
   as `zero_to_fp32`'s `get_fp32_state_dict_from_zero_checkpoint` rebuilds them from the files, each parameter's
   moments as the loaded engine assembles them (`safe_get_full_optimizer_state`), the wrapped optimizer's
   steps and param groups, and the losses of DeepSpeed's next step (before and after it) on the batch of seed 3.
2. `prove_zero_to_dcp`: this process reshards every save folder with the DCP writer (`out-{run}/`), then
   FSDP2 + AdamW on 1 and on 2 ranks load each output by `dcp.load` + `set_state_dict`, gather the full state and
   take the same step (`reshard_dcp_proof._load_worker`, its optimizer built with its own settings:
   `zero-results-{W}.pt`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.writers.dcp_writer import TinyNet
from tests.writers.deepspeed_writer import write_deepspeed_sets
from tests.writers.reshard_dcp_proof import NEXT_STEP_SEED, _load_worker, _spawn, adamw, batch

__all__ = ["RUNS", "WrittenZeroFp32", "ZeroToDcpProof", "prove_zero_to_dcp", "write_zero_fp32"]

#: Each run's name -> its DeepSpeed `zero_optimization` section. A `sub_group_size` of 64 elements per rank cuts
#: the decay group into 2 flat partitions (embed + l1, head + gate) and leaves the no-decay group 1.
RUNS: dict[str, dict[str, int]] = {
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero3-subgroups": {"stage": 3, "sub_group_size": 64},
}
#: The step DeepSpeed saves at.
SAVED_STEP = 2
#: The settings DeepSpeed's AdamW is built with (the FSDP2 side is built with others).
LR = 3e-3
BETAS = (0.85, 0.99)
EPS = 1e-7
DECAY = 0.05
CLIENT_STATE = {"epoch": 1, "consumed_samples": 16}


@dataclass(frozen=True)
class WrittenZeroFp32:
    """DeepSpeed's fp32 ZeRO-2 and ZeRO-3 saves of `TinyNet`, and DeepSpeed's own view of each.

    Attributes:
        root: holds `{run}/` (a save folder: `latest`, `global_step2/`) and `deepspeed-{run}.pt` per run of `RUNS`.
    """

    root: Path

    def save_dir(self, run: str) -> Path:
        return self.root / run

    def tag(self, run: str) -> Path:
        return self.save_dir(run) / f"global_step{SAVED_STEP}"

    def deepspeed_view(self, run: str) -> dict[str, Any]:
        return torch.load(self.root / f"deepspeed-{run}.pt", weights_only=True)  # written by the writer


def _engine(zero: dict[str, int]) -> tuple[Any, list[list[str]]]:
    """A DeepSpeed engine of `TinyNet`, and the names of each of its optimizer's groups."""
    import deepspeed

    torch.manual_seed(0)
    model = TinyNet()
    optimizer = adamw(model)
    for group, decay in zip(optimizer.param_groups, (DECAY, 0.0), strict=True):
        group.update(lr=LR, betas=BETAS, eps=EPS, weight_decay=decay)
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        # A torch optimizer rather than DeepSpeed's FusedAdam, which would compile an op first.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine, names


def _deepspeed_step(engine: Any, seed: int) -> tuple[float, float]:
    """One DeepSpeed step on the batch of `seed` (the same on both ranks): the loss before and after it."""
    inputs = batch(seed)
    loss = engine(inputs).square().mean()
    engine.backward(loss)
    engine.step()
    with torch.no_grad():
        after = engine(inputs).square().mean()
    return float(loss), float(after)


def _deepspeed_view(engine: Any, save_dir: Path, group_names: list[list[str]]) -> dict[str, Any]:
    """The loaded engine's state as DeepSpeed assembles it (collectives: every rank calls it)."""
    import contextlib
    import io

    from deepspeed.utils import safe_get_full_optimizer_state
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # ZeRO 1-2 links each parameter to its fragment of the optimizer state on its first step; link it now, as
    # that step would, to read the state as loaded.
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()
    moments = {
        name: {key: safe_get_full_optimizer_state(param, key).detach().clone() for key in ("exp_avg", "exp_avg_sq")}
        for name, param in engine.module.named_parameters()
    }
    wrapped = engine.optimizer.optimizer  # the torch AdamW whose parameters are DeepSpeed's flat partitions
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
        weights = get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    return {
        "weights": {name: tensor.detach().clone() for name, tensor in weights.items()},
        "moments": moments,
        "steps": [state["step"].clone() for state in wrapped.state.values()],
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in wrapped.param_groups],
        "group_names": group_names,
    }


def _deepspeed_rank(rank: int, root: str) -> None:
    """One of DeepSpeed's 2 ranks (`write_deepspeed_sets` set up the process group): train, save, load, record."""
    import deepspeed

    for run, zero in RUNS.items():
        save_dir = Path(root) / run
        engine, _ = _engine(zero)
        for seed in range(1, SAVED_STEP + 1):
            _deepspeed_step(engine, seed)
        engine.save_checkpoint(str(save_dir), client_state=CLIENT_STATE)
        deepspeed.comm.barrier()
        loaded, group_names = _engine(zero)
        loaded.load_checkpoint(str(save_dir))
        view = _deepspeed_view(loaded, save_dir, group_names)
        view["losses"] = _deepspeed_step(loaded, NEXT_STEP_SEED)
        if rank == 0:
            torch.save(view, Path(root) / f"deepspeed-{run}.pt")
        deepspeed.comm.barrier()


def write_zero_fp32(root: Path) -> WrittenZeroFp32:
    """The saves and DeepSpeed's views (the module docstring, 1.), by 2 spawned ranks (tens of seconds)."""
    write_deepspeed_sets({}, then=[(_deepspeed_rank, (str(root),))])
    return WrittenZeroFp32(root)


@dataclass(frozen=True)
class ZeroToDcpProof:
    root: Path
    written: dict[str, dict[str, Any]]

    def results(self, world_size: int) -> dict[str, Any]:
        """Run -> the full model and optimizer state FSDP2 loaded on `world_size` ranks, and its step's losses."""
        return torch.load(self.root / f"zero-results-{world_size}.pt", weights_only=True)  # written by the proof


#: The outputs FSDP2 loads (as `reshard_dcp_proof.CASES`): one per run, named by the run.
_CASES = tuple((run, f"out-{run}", "dcp") for run in RUNS)


def prove_zero_to_dcp(root: Path, source: WrittenZeroFp32) -> ZeroToDcpProof:
    """Reshard each save folder of `source` into `root/out-{run}`, then resume it (the module docstring, 2.)."""
    from ckptctl.contract.capabilities import TRAINING_STATE_SOURCE, ReshardRequest

    # Imported by name (the registry names it relatively, `state:SOURCE`), so that the writer cache's key follows it.
    from ckptctl.families.zero_tag.state import zero_tag_state
    from ckptctl.frameworks.dcp.reshard import WRITER
    from ckptctl.layouts import capability, open_checkpoint

    written: dict[str, dict[str, Any]] = {}
    for run in RUNS:
        checkpoint = open_checkpoint(str(source.save_dir(run)))
        assert capability(checkpoint.layout, TRAINING_STATE_SOURCE) is zero_tag_state
        assert WRITER.refusal(checkpoint, None) is None
        out = root / f"out-{run}"
        os.makedirs(out)
        state = WRITER.write(ReshardRequest(checkpoint, str(out), None), lambda _n: None)
        written[run] = {
            "layout": checkpoint.layout,
            "files": state.files,
            "tensors": state.tensors,
            "not_carried": [(n.what, n.why) for n in state.not_carried],
        }
    for world_size in (1, 2):
        _spawn(_load_worker, root, world_size, _CASES, "zero-results")
    return ZeroToDcpProof(root, written)
