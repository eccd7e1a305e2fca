"""DeepSpeed engines loading their own tags, and the frameworks that resume through them, on 2 gloo CPU ranks
(`DS_ACCELERATOR=cpu`): one pair of ranks (forked by `tests.writers.ranks`) for every DeepSpeed-based
checkpoint of the matrix, one engine per job.

- `deepspeed-zero2` / `deepspeed-zero3`: the suite's `global_step4` (`tests.writers.deepspeed_writer`), loaded
  with `engine.load_checkpoint(save_dir, tag)` (deepspeed/runtime/engine.py: DeepSpeedEngine.load_checkpoint)
  into an engine configured as the writer's.
- `deepspeed-universal`: `ds_to_universal`'s `global_step4_universal` of the ZeRO-2 run, loaded with
  `"checkpoint": {"load_universal": true}` (`load_checkpoint` then reads `zero/<param>/*.pt`).
- `openrlhf`: the PPO actor's `_actor/global_step3`, loaded as `PolicyModelActor.init_model_from_pretrained`
  does (openrlhf/trainer/ray/ppo_actor.py): `DeepspeedStrategy.load_ckpt(actor.model, {ckpt.path}/_actor)`
  (openrlhf/utils/deepspeed/deepspeed.py: `model.load_checkpoint(load_dir, tag=None, ...)`, the tag its
  `latest` names), with OpenRLHF's own strategy, `Actor` and `prepare` built as `tests.writers.openrlhf_writer`
  builds them; the client states it returns are what `PPOTrainer` resumes its counters and data loader from.
- `open-instruct`: its `--checkpoint_state_dir` tag `global_step4` (`tests.writers.rl_runs.arrange_open_instruct`:
  the ZeRO-2 run's tags with open-instruct's client state), loaded as open-instruct's own resume does (it does
  not install here; allenai/open-instruct @ e6c3044a, open_instruct/grpo_fast.py:
  `PolicyTrainerRayProcess.from_pretrained`): `self.model.load_checkpoint(checkpoint_state_dir,
  load_module_strict=True, load_optimizer_states=True, load_lr_scheduler_states=True, load_module_only=False)`
  (the tag `latest` names), `ValueError` when it returns no path, then `states["training_step"]` and the torch,
  numpy and python generators from `states["rng_states"]`; and the tag's `driver_state.pt` (open-instruct
  PR #1647, which moved the data loader's and the data-prep actor's state there), read with `torch.load`.

Before each cell every engine first loads an older tag of the same run (`prior`: another model, other
moments, another step and client state), so that whatever the cell's load skips shows as different from the
reference load. Each rank compares what it holds itself (module weights, ZeRO-3's own partitions, the
optimizer's partitioned state, the scheduler, the engine's counters, the returned client state); the verdicts
of both ranks are merged (the first not `ok`).

A damaged per-rank file (ZeRO-3's model and optimizer states) fails one rank's load while the other goes on into
DeepSpeed's collectives and would wait for it: before each load both ranks run DeepSpeed's own first reads of
the load (`_read_first`: the same files, the same code) and share the outcome; where a rank failed there, that
is the load's verdict and neither rank goes on.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.faults.cells import cells, make_copies, run_loader
from tests.faults.loaders.common import judge, load_capturing, without_path
from tests.writers.ranks import free_port

#: What a rank keeps between the cells of a job: the engine and what the job's load needs.
_job: dict[str, Any] = {}


def _plain(value: Any, depth: int = 0) -> Any:
    """Objects inside an optimizer's state dict (DeepSpeed's loss scaler, enums) as comparable values."""
    import enum

    import torch

    if isinstance(value, torch.Tensor | int | float | str | bool | type(None)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    if hasattr(value, "__dict__") and depth < 6:
        return {"__class__": type(value).__name__, **_plain(vars(value), depth + 1)}
    return type(value).__name__


def _engine_state(engine: Any) -> dict[str, Any]:
    """What this rank's engine holds: the module's weights (ZeRO-3: this rank's partitions), the optimizer's
    state dict, the scheduler's, and the engine's counters."""
    if engine.zero_optimization_partition_weights():
        module = {name: p.ds_tensor for name, p in engine.module.named_parameters()}
    else:
        module = engine.module.state_dict()
    return {
        "module": module,
        "optimizer": _plain(engine.optimizer.state_dict()),
        "scheduler": _plain(engine.lr_scheduler.state_dict()),
        "counters": [engine.global_steps, engine.global_samples, engine.skipped_steps],
    }


def _engine(stage: int, universal: bool) -> Any:
    """An engine configured as `tests.writers.deepspeed_writer` trains (the tiny Llama, AdamW, StepLR, bf16)."""
    import deepspeed
    import torch

    from tests.writers.deepspeed_writer import FROZEN_UNDER_ZERO3
    from tests.writers.models import tiny_llama

    torch.manual_seed(1234)
    model = tiny_llama()
    if stage == 3:
        model.get_parameter(FROZEN_UNDER_ZERO3).requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
        "checkpoint": {"load_universal": universal},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def _openrlhf_engine(pretrain: str, rank: int) -> tuple[Any, Any]:
    """OpenRLHF's strategy and its prepared actor engine, as `tests.writers.openrlhf_writer.train_rank` builds
    them (ZeRO-2, bf16, its AdamW and `cosine_with_min_lr` scheduler)."""
    import importlib

    from tests.writers import openrlhf_writer as w

    w._install_stand_ins()
    strategy_module = importlib.import_module("openrlhf.utils.deepspeed.deepspeed")
    w._cpu_only(strategy_module)
    from openrlhf.models import Actor

    strategy = strategy_module.DeepspeedStrategy(
        seed=42, max_norm=1.0, micro_train_batch_size=2, train_batch_size=4, zero_stage=2, args=w._args(rank)
    )
    train_config = strategy.get_ds_train_config

    def torch_adam(optim_dict: dict[str, Any] | None = None, *, max_norm: float | None = None) -> dict[str, Any]:
        config: dict[str, Any] = train_config(optim_dict, max_norm=max_norm)
        if "optimizer" in config:
            config["optimizer"]["params"]["torch_adam"] = True
        return config

    strategy.get_ds_train_config = torch_adam
    strategy.setup_distributed()
    actor = Actor(pretrain, attn_implementation="eager", param_dtype="bf16", ds_config=strategy.get_ds_train_config())
    actor, _, _ = strategy.prepare((actor, w._train_config()))
    return strategy, actor.model


def _read_first(engine: Any, load_dir: str, tag: str) -> str | None:
    """DeepSpeed's own first reads of a load, each rank its files (`DeepSpeedEngine._load_checkpoint`'s opening
    lines, then `_load_zero_checkpoint`'s `_get_all_zero_checkpoints`, or for a universal checkpoint the ZeRO-1/2
    optimizer's `load_hp_checkpoint_state_from_checkpoint_dir`): None, or why they raised."""
    from deepspeed.runtime.state_dict_factory import SDLoaderFactory

    try:
        ckpt_list = engine._get_all_ckpt_names(load_dir, tag)
        loader = SDLoaderFactory.get_sd_loader(ckpt_list, checkpoint_engine=engine.checkpoint_engine)
        world, rank = engine.mp_world_size, engine.checkpoint_mp_rank
        if engine.load_universal_checkpoint():
            world, rank = len(ckpt_list), rank * len(ckpt_list) // world
        loader.load(world, rank)
        if engine.load_universal_checkpoint():
            # ZeRO-1/2's `_load_universal_checkpoint`: each rank reads the `zero/<param>/` files of its partition
            # (no collective in it; the real load reads them again).
            engine.optimizer.load_hp_checkpoint_state_from_checkpoint_dir("bit16_groups", os.path.join(load_dir, tag))
        else:
            engine._get_all_zero_checkpoints(load_dir, tag)  # `_load_zero_checkpoint`'s read of the optim files
    except Exception as exc:
        return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
    return None


def _save_dir(path: str) -> str:
    """The save folder of the copy at `path`, whose `latest` names it (`build` wrote it: what a resume without a
    tag follows)."""
    return str(Path(path).parent)


def load(path: str, options: Mapping[str, Any]) -> Any:
    import deepspeed

    engine = _job["engine"]
    kind = options["kind"]
    folder = Path(path)
    failed = _read_first(engine, str(folder.parent), folder.name)
    said: list[Any] = [None, None]
    deepspeed.comm.all_gather_object(said, failed)
    if any(said):
        rank, why = next((i, s) for i, s in enumerate(said) if s)
        raise RuntimeError(f"rank {rank}: {why}")
    if kind == "zero":
        _, client = engine.load_checkpoint(str(folder.parent), tag=folder.name)
        return {**_engine_state(engine), "client": _plain(client)}
    if kind == "openrlhf":
        _, client = _job["strategy"].load_ckpt(engine, _save_dir(path))
        return {**_engine_state(engine), "client": _plain(client)}
    return _open_instruct(engine, path)


def _open_instruct(engine: Any, path: str) -> Any:
    """open-instruct's resume (see the module's doc)."""
    import numpy as np
    import torch

    checkpoint_state_dir = _save_dir(path)
    loaded, states = engine.load_checkpoint(
        checkpoint_state_dir,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
    )
    if loaded is None:
        raise ValueError(f"Failed to load checkpoint from {checkpoint_state_dir}")
    training_step = states["training_step"]
    rng_states = states["rng_states"]
    torch.set_rng_state(rng_states["torch_cpu_rng_state"])
    np.random.set_state(rng_states["numpy_rng_state"])
    random.setstate(rng_states["python_rng_state"])
    driver = torch.load(os.path.join(path, "driver_state.pt"), weights_only=False)
    return {
        **_engine_state(engine),
        "training_step": training_step,
        "client": _plain({k: v for k, v in states.items() if k != "rng_states"}),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        "driver": _plain(driver),
    }


def _prior_load(job: Mapping[str, Any]) -> None:
    """The job's older tag, loaded as the job loads (see the module's doc)."""
    engine = _job["engine"]
    prior = Path(job["prior"])
    if job["kind"] == "openrlhf":
        _job["strategy"].load_ckpt(engine, str(prior.parent), tag=prior.name)
        return
    universal = engine._config.load_universal_checkpoint
    engine._config.load_universal_checkpoint = False  # the prior is a plain tag of the run converted
    try:
        engine.load_checkpoint(str(prior.parent), tag=prior.name)
    finally:
        engine._config.load_universal_checkpoint = universal


def _run_job(job: Mapping[str, Any], rank: int) -> dict[str, str]:
    import deepspeed

    if job["kind"] == "openrlhf":
        _job["strategy"], _job["engine"] = _openrlhf_engine(job["pretrain"], rank)
    else:
        _job["engine"] = _engine(job["stage"], job["universal"])

    def loaded(path: str) -> Any:
        _prior_load(job)
        return load(path, job)

    options = {**job, "loggers": ["DeepSpeed"]}
    reference, said = load_capturing(lambda p, o: loaded(p), job["reference"], options)
    known = {without_path(m, job["reference"]) for m in said}
    mine = {}
    for cell in job["cells"]:
        # Which cell a rank was on, when the build fails (stderr is shown then only).
        print(f"rank {rank}: {job['framework']} {cell['id']}", file=sys.stderr, flush=True)
        mine[cell["id"]] = judge(lambda p, o: loaded(p), cell["path"], options, reference, known)
    both: list[Any] = [None, None]
    deepspeed.comm.all_gather_object(both, mine)
    verdicts = {"reference": "ok"}
    for cell in job["cells"]:
        said_by = [both[r][cell["id"]] for r in (0, 1) if both[r][cell["id"]] != "ok"]
        verdicts[cell["id"]] = said_by[0] if said_by else "ok"
    _job.clear()
    return verdicts


def _rank(rank: int, spec_path: str, port: int) -> None:
    import torch.distributed as dist

    from tests.writers.deepspeed_ranks import join_deepspeed_ranks

    join_deepspeed_ranks(rank, 2, port)
    spec = json.loads(Path(spec_path).read_text())
    # OpenRLHF's stand-ins and CPU patches stay in the process: its job runs last.
    results = {
        job["framework"]: _run_job(job, rank) for job in sorted(spec["jobs"], key=lambda j: j["kind"] == "openrlhf")
    }
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(results, indent=1))
    dist.barrier()


def build(checkpoints: Mapping[str, Mapping[str, Any]], _out: Path) -> dict[str, dict[str, str]]:
    """Each DeepSpeed-based framework's verdict on each cell of its checkpoint, by framework:
    `checkpoints` maps a framework to its job (`checkpoint`, `prior`, `kind` and the kind's options)."""
    with tempfile.TemporaryDirectory(prefix="ckptctl-faults-") as tmp:
        jobs = []
        for i, (framework, job) in enumerate(checkpoints.items()):
            checkpoint = Path(job["checkpoint"])
            copies = make_copies(checkpoint, Path(tmp) / f"job-{i}", cells(checkpoint))
            for copy in (copies.reference, *copies.copies.values()):
                (copy.parent / "latest").write_text(copy.name)
            jobs.append(
                {
                    **{k: str(v) if isinstance(v, Path) else v for k, v in job.items()},
                    "framework": framework,
                    "reference": str(copies.reference),
                    "cells": [{"id": cell.id, "path": str(path)} for cell, path in copies.copies.items()],
                }
            )
        spec = {"jobs": jobs, "out": str(Path(tmp) / "verdicts.json")}
        # A rank left waiting on the other (a hang the first-read check did not foresee) fails the build in 2
        # minutes rather than DeepSpeed's default 10 (deepspeed/constants.py: default_pg_timeout).
        verdicts: dict[str, dict[str, str]] = run_loader(
            _rank, (free_port(),), 2, spec, Path(tmp), DEEPSPEED_TIMEOUT="2"
        )
    return verdicts
