"""Run folders of OpenRLHF, open-instruct, AReaL and ROLL, built from real pieces arranged as each framework
arranges them (LAYOUTS.md, checked against the frameworks' source).

The pieces are written by the real writers: DeepSpeed ZeRO tags by DeepSpeed (the session's
`deepspeed_runs`), FSDP2 DCP folders by `torch.distributed.checkpoint` on 2 spawned CPU ranks, model
folders by transformers' `save_pretrained`, `.pt` files by `torch.save`, `.pkl` files by `pickle`. What
the frameworks add themselves is written here the way their code writes it:

- OpenRLHF (`openrlhf/utils/deepspeed/deepspeed.py`, `trainer/ppo_trainer.py`): `_actor/` and `_critic/`
  DeepSpeed save folders; PPO's client state (`episode`, `global_step`, `total_consumed_prompts`,
  `data_loader_state_dict`) in the actor's model states and none in the critic's; `metric.json`
  (`{"metric_key", "metric_value"}`, null before the first evaluation) written after each save; a
  `best_global_stepN` tag saved after the regular one at the same step, which `latest` then names; a
  `global_stepN_hf` export beside them.
- open-instruct (`grpo_fast.py`): client state `training_step`, `episode`, `num_total_tokens`,
  `rng_states`, `rank`, `ref_policy_saved`; `ref_policy/pytorch_model.bin` (a `torch.save` of the reference
  policy's state dict) beside the tags; `driver_state.pt` (rank 0's data state, PR #1647) in each tag; tag
  numbers count optimizer steps (two per training step here); HF snapshots `step_N/` with
  `.checkpoint_complete` under `{exp}__{seed}__{time}_checkpoints/` in `--output_dir`: `setup_runtime_variables`
  sets `args.output_dir = {output_dir}/{exp_name}__{seed}__{int(time.time())}`, `maybe_save_checkpoint` saves
  into `f"{args.output_dir}_checkpoints"/step_{training_step}`, and `PolicyTrainerRayProcess.save_model`
  writes `save_pretrained` (config and weights), the tokenizer, then touches `.checkpoint_complete`
  (allenai/open-instruct `open_instruct/grpo_fast.py`). Nothing ties them to `--checkpoint_state_dir`.
- AReaL (`areal/utils/saver.py`, `recover.py`, `engine/fsdp_engine.py`): per step the Saver's HF export
  `default/epoch{E}epochstep{S}globalstep{G}/`, then the recover dump: `dcp.save({"dcp": {"model", "optim"}})`
  into `default/recover_checkpoint/` and `critic/recover_checkpoint/`, overwritten in place each step, then
  `recover_info/` (`step_info.json` and the other info files with `json.dump(indent=4)`, and
  `dataloader_info.pkl`, the all-gathered data loader states, one per rank, with a sampler generator state
  tensor each) plus the empty `recover_info/recover_checkpoint/` AReaL's recover check creates.
- ROLL (`roll/pipeline/base_pipeline.py`, `distributed/strategy/fsdp2_strategy.py`, `utils/worker_state.py`):
  `{output_dir}/{YYYYmmdd-HHMMSS}/checkpoint-N/` with the FSDP2 strategy's `save_pretrained` weights and
  `dcp/` (`{**model.state_dict(), "optimizer": optimizer, "scheduler": scheduler, "rng_state": ...}`),
  `critic/` the same at the last step, and the pipeline's `pipeline/worker_state_pipeline.json`
  (`json.dumps(asdict(state), indent=2, sort_keys=True)`) and `pipeline/rng_state_pipeline.pth`. The
  Megatron variants (no Megatron here) are arranged by hand from real DCP and `torch.save` pieces with
  mcore_adapter's names (`mca_config.json`, `latest_checkpointed_iteration.txt`, `iter_0000001/`).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.ranks import join_gloo, run_ranks

__all__ = [
    "AREAL_EXPERIMENT",
    "ROLL_LAUNCH",
    "WrittenFsdpRuns",
    "arrange_open_instruct",
    "arrange_openrlhf",
    "arrange_roll_megatron",
    "write_fsdp_runs",
]

WORLD_SIZE = 2
#: Training steps of the FSDP2 writer; AReaL numbers them 0.., ROLL saves checkpoint-1..
FSDP_STEPS = 2
AREAL_USER = "tester"
AREAL_EXPERIMENT = "gsm8k-grpo"
AREAL_TRIAL = "trial0"
ROLL_LAUNCH = "20250101-120000"


# --------------------------------------------------------------------------------------------------
# FSDP2 on 2 CPU ranks: AReaL's trial and ROLL's launch folder, saved as the frameworks save them.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WrittenFsdpRuns:
    """What the FSDP2 writer produced.

    Attributes:
        areal_root: AReaL's `fileroot` (holding `checkpoints/{user}/{experiment}/{trial}/`).
        roll_output: ROLL's `checkpoint_config.output_dir` (holding one timestamp folder).
        model_parameters: elements of the tiny Llama's parameters.
        world_size: ranks.
    """

    areal_root: Path
    roll_output: Path
    model_parameters: int
    world_size: int = WORLD_SIZE

    @property
    def areal_trial(self) -> Path:
        return self.areal_root / "checkpoints" / AREAL_USER / AREAL_EXPERIMENT / AREAL_TRIAL

    @property
    def roll_launch(self) -> Path:
        return self.roll_output / ROLL_LAUNCH


def _freq_state(step: int) -> dict[str, Any]:
    """What AReaL's `EpochStepTimeFreqCtl.state_dict()` holds (frequency counters; `frequence_seconds` sic)."""
    return {
        "epoch": {"freq": None, "steps": 0},
        "step": {"freq": 1, "steps": step + 1},
        "time": {"frequence_seconds": None, "start_time": 1_700_000_000.0, "steps": 0},
    }


def _dataloader_state(rank: int, step: int) -> dict[str, Any]:
    """A `StatefulDataLoader`-style state: counters and the random sampler's generator state tensor."""
    return {
        "_num_yielded": step + 1,
        "_sampler_iter_yielded": step + 1,
        "_index_sampler_state": {"generator": torch.Generator().manual_seed(100 + rank).get_state(), "yielded": 2},
        "_iterator_finished": False,
    }


def _areal_save(rank: int, trial: Path, step: int, model: Any, optimizer: Any, full: dict[str, Any]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.writers.models import tiny_llama

    if rank == 0:  # Saver.save: the HF export (0-based counters, one epoch here)
        tiny_llama().save_pretrained(
            trial / "default" / f"epoch0epochstep{step}globalstep{step}", state_dict=dict(full)
        )
    dist.barrier()
    for name in ("default", "critic"):  # RecoverHandler.dump: the engines first ...
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save(
            {"dcp": {"model": model_sd, "optim": optim_sd}}, checkpoint_id=str(trial / name / "recover_checkpoint")
        )
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, _dataloader_state(rank, step))
    if rank != 0:
        return
    info = trial / "recover_info"  # ... then RecoverInfo.dump, file by file
    info.mkdir(parents=True, exist_ok=True)
    documents = {
        "step_info.json": {"epoch": 0, "epoch_step": step, "global_step": step, "steps_per_epoch": 8},
        "saver_info.json": _freq_state(step),
        "evaluator_info.json": _freq_state(step),
        "stats_logger_info.json": {"last_commit_step": step},
        "checkpoint_info.json": _freq_state(step),
    }
    for name, document in documents.items():
        (info / name).write_text(json.dumps(document, indent=4))
    with open(info / "dataloader_info.pkl", "wb") as f:
        pickle.dump(states, f)
    (info / "recover_checkpoint").mkdir(exist_ok=True)  # check_if_auto_recover's makedirs


def _roll_worker_state(step: int) -> dict[str, Any]:
    history = [
        {"system/step": s, "critic/score/mean": round(0.1 * s, 3), "actor/pg_loss": round(1.0 / s, 3)}
        for s in range(1, step + 1)
    ]
    return {
        "kv": {"scheduler_state_math": {"consumed_prompts": 4 * step, "epoch": 0}},
        "log_history": history,
        "step": step,
    }


def _roll_save(
    rank: int, launch: Path, step: int, model: Any, optimizer: Any, scheduler: Any, full: dict[str, Any], critic: bool
) -> None:
    import numpy as np
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tests.writers.models import tiny_llama

    checkpoint = launch / f"checkpoint-{step}"
    for role in [checkpoint] + ([checkpoint / "critic"] if critic else []):
        if rank == 0:
            tiny_llama().save_pretrained(role, state_dict=dict(full), safe_serialization=True)
        state = {
            **model.state_dict(),
            "optimizer": optimizer,
            "scheduler": scheduler,
            "rng_state": {"cpu": torch.get_rng_state()},
        }
        dcp.save(state, checkpoint_id=str(role / "dcp"))
    dist.barrier()
    if rank == 0:
        pipeline = checkpoint / "pipeline"
        pipeline.mkdir(parents=True, exist_ok=True)
        text = json.dumps(_roll_worker_state(step), indent=2, sort_keys=True) + "\n"
        (pipeline / "worker_state_pipeline.json").write_text(text)
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
        torch.save(rng, pipeline / "rng_state_pipeline.pth")


def _fsdp_worker(rank: int, rendezvous: str, areal_trial: str, roll_launch: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.writers.models import tiny_llama

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    join_gloo(rank, WORLD_SIZE, rendezvous=rendezvous)
    try:
        model = tiny_llama()
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        generator = torch.Generator().manual_seed(10 + rank)
        for step in range(FSDP_STEPS):
            ids = torch.randint(0, 128, (2, 16), generator=generator)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            _areal_save(rank, Path(areal_trial), step, model, optimizer, full)
            _roll_save(rank, Path(roll_launch), step + 1, model, optimizer, scheduler, full, step + 1 == FSDP_STEPS)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def write_fsdp_runs(root: Path) -> WrittenFsdpRuns:
    """Train the tiny Llama with FSDP2 on 2 spawned CPU ranks and save it as AReaL and ROLL do, every step.

    Takes several seconds (each rank imports torch and transformers); use it from a session fixture.
    """
    from tests.writers.models import tiny_llama

    written = WrittenFsdpRuns(root / "areal", root / "roll", sum(p.numel() for p in tiny_llama().parameters()))
    written.areal_trial.mkdir(parents=True)
    written.roll_launch.mkdir(parents=True)
    rendezvous = root / ".rendezvous"
    run_ranks(_fsdp_worker, (str(rendezvous), str(written.areal_trial), str(written.roll_launch)), WORLD_SIZE)
    rendezvous.unlink(missing_ok=True)
    return written


# --------------------------------------------------------------------------------------------------
# DeepSpeed-based frameworks: real ZeRO tags with the client state each framework passes.
# --------------------------------------------------------------------------------------------------


def _copy_tag(written: WrittenDeepSpeed, tag: str, target: Path, client_state: dict[str, Any] | None) -> None:
    """Copy a DeepSpeed tag folder; replace the client state in every model-states file (DeepSpeed saves
    `client_state` as top-level keys of each one) with what the framework passes to `save_checkpoint`."""
    # The keys the DeepSpeed writer passed, rather than ckptctl's list of DeepSpeed's own keys: importing
    # ckptctl here would put all of it in the writer cache's key of every run arranged here (each ckptctl
    # change would rebuild them).
    shutil.copytree(written.save_dir / tag, target)
    if client_state is None:
        return
    for path in sorted(target.glob("*model_states.pt")):
        states = torch.load(path, map_location="cpu", weights_only=False)
        states = {k: v for k, v in states.items() if k not in written.client_state}
        states.update(client_state)
        torch.save(states, path)


def _save_dir_files(source: WrittenDeepSpeed, target: Path) -> None:
    """The files DeepSpeed writes beside the tags (zero_to_fp32.py and friends)."""
    target.mkdir(parents=True, exist_ok=True)
    for path in source.save_dir.iterdir():
        if path.is_file() and path.name != "latest":
            shutil.copy2(path, target / path.name)


def _ppo_client_state(step: int) -> dict[str, Any]:
    return {
        "episode": 0,
        "global_step": step,
        "total_consumed_prompts": 8 * step,
        "data_loader_state_dict": {"epoch": 0, "consumed_samples": 8 * step},
    }


def _write_metric(tag_dir: Path, key: str | None, value: float | None) -> None:
    """What `DeepspeedStrategy._write_ckpt_metric` writes after the save."""
    (tag_dir / "metric.json").write_text(
        json.dumps({"metric_key": key, "metric_value": value}, indent=2, sort_keys=True)
    )


def arrange_openrlhf(ckpt_path: Path, actor: WrittenDeepSpeed, critic: WrittenDeepSpeed, hf_model: Path) -> Path:
    """OpenRLHF PPO's `--ckpt.path` after saves at global steps 2 and 4 (step 4 also the best so far)."""
    tags = [(int(tag.removeprefix("global_step")), tag) for tag in actor.tags]
    for role, source in (("_actor", actor), ("_critic", critic)):
        save_dir = ckpt_path / role
        _save_dir_files(source, save_dir)
        for step, tag in tags:
            client = _ppo_client_state(step) if role == "_actor" else {}  # the critic saves no client state
            _copy_tag(source, tag, save_dir / tag, client)
            (save_dir / "latest").write_text(tag)
            evaluated = step == tags[-1][0]  # no evaluation before the last step: metric_value null
            _write_metric(save_dir / tag, "eval_gsm8k_pass1" if evaluated else None, 0.5 if evaluated else None)
        best_step, best_tag = tags[-1]
        best = f"best_{best_tag}"
        client = {**_ppo_client_state(best_step), "best_eval_metric_key": "eval_gsm8k_pass1"}
        _copy_tag(source, best_tag, save_dir / best, client if role == "_actor" else {})
        (save_dir / "latest").write_text(best)
        _write_metric(save_dir / best, "eval_gsm8k_pass1", 0.5)
    shutil.copytree(hf_model, ckpt_path / f"{tags[-1][1]}_hf")
    return ckpt_path


def arrange_open_instruct(state_dir: Path, output_dir: Path, source: WrittenDeepSpeed, hf_model: Path) -> Path:
    """open-instruct's `--checkpoint_state_dir` after training steps 1 and 2 (tags global_step2 and 4: two
    optimizer steps per training step), with the reference policy, and its HF snapshots in `output_dir`."""
    import numpy as np

    from tests.writers.models import tiny_llama

    _save_dir_files(source, state_dir)
    for tag in source.tags:
        training_step = int(tag.removeprefix("global_step")) // 2
        client = {
            "training_step": training_step,
            "episode": 16 * training_step,
            "num_total_tokens": 512 * training_step,
            "rng_states": {
                "torch_cpu_rng_state": torch.get_rng_state(),
                "numpy_rng_state": np.random.get_state(),
                "python_rng_state": random.getstate(),
            },
            "rank": 0,
            "ref_policy_saved": True,
        }
        _copy_tag(source, tag, state_dir / tag, client)
        driver = {
            "dataloader_state": {"epoch": 0, "index": 16 * training_step},
            "data_prep_actor_state": {"step": training_step},
        }
        torch.save(driver, state_dir / tag / "driver_state.pt")
        (state_dir / "latest").write_text(tag)
    (state_dir / "ref_policy").mkdir()
    torch.save(tiny_llama().state_dict(), state_dir / "ref_policy" / "pytorch_model.bin")
    snapshots = output_dir / "grpo_tiny__1__1700000000_checkpoints"
    for step in (1, 2):
        shutil.copytree(hf_model, snapshots / f"step_{step}")
    (snapshots / "step_1" / ".checkpoint_complete").write_text("")
    return state_dir


def arrange_roll_megatron(checkpoint: Path, step: int, legacy: bool = False) -> Path:
    """A ROLL `checkpoint-N` of the Megatron strategy (mcore_adapter's names), from real pieces: DCP folders
    written by `dcp.save` for Megatron's dist-ckpt `dist_model/`/`dist_optimizer/` (or, `legacy`, one
    `model_optim_rng.pt` per tensor-parallel rank), `torch.save` for the scheduler and per-rank RNG files."""
    import numpy as np
    import torch.distributed.checkpoint as dcp

    from tests.writers.models import tiny_llama

    model = tiny_llama()
    tp = 2 if legacy else 1
    checkpoint.mkdir(parents=True)
    config = {
        "hidden_size": 32,
        "num_layers": 2,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": 1,
        "expert_model_parallel_size": 1,
    }
    (checkpoint / "mca_config.json").write_text(json.dumps(config, indent=2))
    (checkpoint / "latest_checkpointed_iteration.txt").write_text("1")
    iteration = checkpoint / "iter_0000001"
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in non-distributed mode"
        if legacy:
            for rank in range(tp):
                folder = iteration / f"mp_rank_{rank:02d}"
                folder.mkdir(parents=True)
                torch.save({"model": state, "iteration": 1, "checkpoint_version": 3.0}, folder / "model_optim_rng.pt")
                torch.save({"state": {}, "param_groups": [{"lr": 1e-6, "params": []}]}, folder / "optimizer.pt")
        else:
            for folder, content in (
                ("dist_model", state),
                ("dist_optimizer", {f"optimizer.state.{k}.exp_avg": torch.zeros_like(v) for k, v in state.items()}),
            ):
                dcp.save(content, checkpoint_id=str(iteration / folder))
                marker = {
                    "sharded_backend": "torch_dist",
                    "sharded_backend_version": 1,
                    "common_backend": "torch",
                    "common_backend_version": 1,
                }
                (iteration / folder / "metadata.json").write_text(json.dumps(marker))
                torch.save({"iteration": 1}, iteration / folder / "common.pt")
    torch.save({"last_epoch": step, "_step_count": step + 1}, checkpoint / "scheduler.pt")
    (checkpoint / "rng_state").mkdir()
    for rank in range(2):
        torch.save(
            {"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state()},
            checkpoint / "rng_state" / f"rng_state_{rank}.pth",
        )
    pipeline = checkpoint / "pipeline"
    pipeline.mkdir()
    (pipeline / "worker_state_pipeline.json").write_text(
        json.dumps(_roll_worker_state(step), indent=2, sort_keys=True) + "\n"
    )
    # `BasePipeline.do_checkpoint` saves the driver's RNG beside its state whatever the strategy.
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    torch.save(rng, pipeline / "rng_state_pipeline.pth")
    return checkpoint
