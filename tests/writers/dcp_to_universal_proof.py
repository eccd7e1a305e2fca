"""The proof of `reshard --to deepspeed-universal` from a torch DCP training state
(`ckptctl.frameworks.deepspeed.universal_from_state`), on gloo CPU ranks: an FSDP2 run moved onto DeepSpeed.

The source is `tests.writers.reshard_dcp_proof`'s (2 ranks, FSDP2 + AdamW with decay/no-decay groups, saved by
`dcp.save` of `get_state_dict` in `dcp/` and by ckptctl's `CheckpointManager` in `native/step-2`), whose
results hold the full state FSDP2 resumes from each and the losses of its next step.

1. This process reshards both (`ckptctl.ops.reshard`, `--to deepspeed-universal`): `uni-dcp/`, `uni-native/`.
2. On 1 and on 2 gloo ranks, DeepSpeed 0.19.8 engines (the same `TinyNet`, unsharded; torch AdamW with the same
   groups as the client optimizer; fp32, as the source trained; `"load_universal": true`) load each output under
   ZeRO-1 and ZeRO-2, gather every parameter's fp32 master and moments (`safe_get_full_fp32_param`,
   `safe_get_full_optimizer_state`), the groups' steps and settings and `global_steps`, and take one step on the
   batch the FSDP2 resumes took (each rank the same batch, as there): `ds-results-{W}.pt`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptctl.frameworks.deepspeed import universal_from_state
from tests.writers.dcp_writer import TinyNet
from tests.writers.deepspeed_ranks import join_deepspeed_ranks
from tests.writers.deepspeed_writer import _free_port
from tests.writers.ranks import run_ranks
from tests.writers.reshard_dcp_proof import NEXT_STEP_SEED, adamw, batch

__all__ = ["SOURCES", "STAGES", "DcpToUniversalProof", "prove_dcp_to_universal"]

#: Each resharded source: (the output folder, the source folder in the DCP proof's root).
SOURCES = (("uni-dcp", "dcp"), ("uni-native", "native/step-2"))
STAGES = (1, 2)


@dataclass(frozen=True)
class DcpToUniversalProof:
    """The outputs (`root/uni-dcp`, `root/uni-native`), what the reshard reported per source (`files`,
    `not_carried` as (what, why) pairs, `resume_hint`), and DeepSpeed's loads."""

    root: Path
    written: dict[str, Any]

    def results(self, world_size: int) -> dict[tuple[str, int], Any]:
        """(output folder, ZeRO stage) -> what the engines on `world_size` ranks loaded and the losses of their step."""
        return torch.load(self.root / f"ds-results-{world_size}.pt", weights_only=True)  # written by the proof


def _load_and_step(folder: str, stage: int, world: int) -> dict[str, Any]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    torch.manual_seed(1)  # other initial weights than the source's: what is loaded must replace them all
    model = TinyNet()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
        "checkpoint": {"load_universal": True},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model), config=config)
    path, _ = engine.load_checkpoint(folder)
    assert path is not None, f"nothing loaded from {folder}"
    state: dict[str, Any] = {}
    for name, param in engine.module.named_parameters():
        state[name] = {
            "fp32": safe_get_full_fp32_param(param).clone(),
            **{key: safe_get_full_optimizer_state(param, key).clone() for key in ("exp_avg", "exp_avg_sq")},
        }
    inner = engine.optimizer.optimizer  # the client AdamW, stepping ZeRO's flat fp32 partitions
    groups = [
        {
            "settings": {k: v for k, v in group.items() if k != "params"},
            "step": inner.state[group["params"][0]]["step"].clone(),
        }
        for group in inner.param_groups
    ]
    ids = batch(NEXT_STEP_SEED)
    loss = engine(ids).square().mean()
    engine.backward(loss)
    engine.step()
    with torch.no_grad():
        after = engine(ids).square().mean()
    return {
        "state": state,
        "groups": groups,
        "global_steps": engine.global_steps,
        "losses": (float(loss), float(after)),
    }


def _rank(rank: int, world: int, port: int, root: str) -> None:
    join_deepspeed_ranks(rank, world, port)
    import deepspeed  # after joining, which picks DeepSpeed's CPU accelerator

    results = {(out, stage): _load_and_step(f"{root}/{out}", stage, world) for out, _ in SOURCES for stage in STAGES}
    if rank == 0:
        torch.save(results, f"{root}/ds-results-{world}.pt")
    deepspeed.comm.barrier()


def prove_dcp_to_universal(root: Path, source_root: Path) -> DcpToUniversalProof:
    """Reshard the DCP proof's sources in `source_root` into `root` and load them with DeepSpeed (the module)."""
    from ckptctl.ops.reshard import ReshardOptions, reshard

    assert universal_from_state.DS_VERSION == "0.19.8"  # named so that the writer cache's key covers the writer
    written: dict[str, Any] = {}
    for out, source in SOURCES:
        result = reshard(str(source_root / source), str(root / out), ReshardOptions(to="deepspeed-universal"))
        written[source] = {
            "files": result.files,
            "not_carried": [(n.what, n.why) for n in result.not_carried],
            "resume_hint": result.resume_hint,
        }
    for world in (1, 2):
        run_ranks(_rank, (world, _free_port(), str(root)), world)
    return DcpToUniversalProof(root, written)
