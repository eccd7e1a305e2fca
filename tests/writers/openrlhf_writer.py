"""A real OpenRLHF PPO checkpoint folder, written by OpenRLHF's own saving code (openrlhf 0.11.2) on CPU.

`train_rank` runs, in each of the 2 ranks the DeepSpeed writer spawns (`tests.writers.deepspeed_writer`, gloo,
`DS_ACCELERATOR=cpu`; after its own runs, so that the ranks' imports are paid once), what OpenRLHF's PPO actor
and critic workers run around their saves, with OpenRLHF's classes doing the work:

- `openrlhf.utils.deepspeed.DeepspeedStrategy` (ZeRO-2, bf16): `setup_distributed`, `prepare` (its DeepSpeed
  config, AdamW and `cosine_with_min_lr` scheduler), `backward`, `optimizer_step`, `save_ckpt` (retention,
  `model.save_checkpoint`, `metric.json`) and `save_model` (the HF export);
- `openrlhf.models.Actor` and `get_llm_for_sequence_regression(..., "critic")` loaded from a tiny local Llama
  (no hub), and `openrlhf.utils.get_tokenizer` for its tokenizer.

The loop is `PPOTrainer.fit`'s save schedule (`trainer/ppo_trainer.py`): per global step the client state
`{"episode", "global_step", "total_consumed_prompts", "data_loader_state_dict"}`, then
`save_logs_and_checkpoints` (adds `best_eval_metric_key/_value`, `latest_eval_metric_value`; tag
`global_step{N}`), then at the evaluation step `save_best_checkpoint` (tag `best_global_step{N}`, the metric
in `checkpoint_metric_key`). Each save does what `PolicyModelActor.save_checkpoint`
(`trainer/ray/ppo_actor.py`) and `CriticModelActor.save_checkpoint` (`trainer/ray/ppo_critic.py`) do:
`strategy.save_ckpt(engine, {ckpt.path}/_actor, tag, ckpt.max_num, ckpt.max_mem, client_states, ...)`,
`--ckpt.save_hf`'s `strategy.save_model(actor, tokenizer, {ckpt.path}/{tag}_hf)`, and the critic's
`save_ckpt` into `{ckpt.path}/_critic` with no client state. After training, `save_model` of each worker:
the actor into `--ckpt.output_dir`, the critic into `{output_dir}_critic` (`--critic.save_value_network`).
The folders are OpenRLHF's defaults: `--ckpt.output_dir ./ckpt`, `--ckpt.path ./ckpt/checkpoints_ppo_ray`.

With `ckpt.max_num` 2, `save_ckpt`'s own retention removes `global_step1` before `global_step3` is saved, so
each save folder ends with `best_global_step2`, `global_step2`, `global_step3` and `latest` naming
`global_step3`.

What is not OpenRLHF's own, and why:
- Stand-in modules for imports that these save paths never call: `flash_attn` (GPU kernels; OpenRLHF falls
  back to torch without them), `pylatexenc` (math answer grading, imported by `openrlhf.utils`) and
  `torchdata` (`StatefulDataLoader`, imported by the strategy module for `setup_dataloader`). The data
  loader state PPO saves is therefore written here in `StatefulDataLoader.state_dict()`'s shape for a
  single-process loader (pytorch/data `torchdata/stateful_dataloader/stateful_dataloader.py`,
  `_StatefulSingleProcessDataLoaderIter.state_dict`).
- The GPU calls around OpenRLHF's saves on this CPU-only torch: `torch.cuda.set_device` and
  `torch.cuda.synchronize` do nothing, and the device mesh `setup_distributed` builds is a CPU one.
- DeepSpeed's AdamW is torch's (`"torch_adam": true` in the optimizer params OpenRLHF writes): DeepSpeed's
  fused Adam would compile a C++ op first (minutes). The optimizer states are stored the same way.
- The losses are plain functions of the actor's log-probs and the critic's values (no rollouts, no vLLM):
  the saves only need weights and optimizer state that moved.

Rank 0 then runs DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint` (what `zero_to_fp32.py` does) on the
actor's `global_step3` and writes it as the reference for conversions.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.writers.deepspeed_writer import WORLD_SIZE

__all__ = ["WrittenOpenRlhf", "prepare_run", "train_rank", "written_run"]

STEPS = 3
#: `PPOTrainer.fit` evaluates every `eval.steps` global steps; a new best is saved as `best_global_step{N}`.
EVAL_STEP = 2
EVAL_METRIC = "eval_gsm8k_pass1"
EVAL_VALUE = 0.25
MAX_NUM = 2  # --ckpt.max_num
PROMPTS_PER_STEP = 4  # rollout batch: what `total_consumed_prompts` grows by per global step
VOCAB = 128


@dataclass(frozen=True)
class WrittenOpenRlhf:
    """What the OpenRLHF writer produced.

    Attributes:
        output_dir: `--ckpt.output_dir`: the actor's final HF model (`save_model` after training).
        ckpt_path: `--ckpt.path` (`output_dir/checkpoints_ppo_ray`): `_actor/`, `_critic/`, `{tag}_hf/`.
        critic_output_dir: `{output_dir}_critic`: the critic's final model.
        tags: the tags left in each save folder after OpenRLHF's retention, oldest first.
        latest: the tag both `latest` files name.
        exports: the `{tag}_hf` folders in `ckpt_path`, in the order they were written.
        rotated: tags OpenRLHF's retention deleted.
        reference: safetensors of DeepSpeed's fp32 reconstruction of the actor's `latest` tag.
        world_size: DP ranks.
    """

    output_dir: Path
    ckpt_path: Path
    critic_output_dir: Path
    tags: tuple[str, ...]
    latest: str
    exports: tuple[str, ...]
    rotated: tuple[str, ...]
    reference: Path
    world_size: int

    @property
    def actor(self) -> Path:
        return self.ckpt_path / "_actor"

    @property
    def critic(self) -> Path:
        return self.ckpt_path / "_critic"

    def reference_tensors(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.reference))


# --------------------------------------------------------------------------------------------------
# The pretrained model OpenRLHF starts from: a tiny local Llama and a word-level tokenizer.
# --------------------------------------------------------------------------------------------------


def _write_pretrain(folder: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    from tests.writers.models import tiny_llama

    tiny_llama().save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(folder)


# --------------------------------------------------------------------------------------------------
# The ranks.
# --------------------------------------------------------------------------------------------------


def _not_here(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("an inert stand-in of the OpenRLHF test writer was called")


def _install_stand_ins() -> None:
    """Inert modules for the imports OpenRLHF makes but its save paths never call (see the module docstring).

    transformers is imported first: it asks at import time whether flash_attn is installed (and caches the
    answer), which must stay "no" so that nothing takes the stand-in for the real kernels.
    """
    import importlib.machinery

    import transformers.modeling_utils  # noqa: F401

    names: dict[str, dict[str, Any]] = {
        "flash_attn": {},
        "flash_attn.bert_padding": dict.fromkeys(
            ("index_first_axis", "pad_input", "rearrange", "unpad_input"), _not_here
        ),
        "flash_attn.utils": {},
        "flash_attn.utils.distributed": {"all_gather": _not_here},
        "pylatexenc": {},
        "pylatexenc.latex2text": {"LatexNodes2Text": _not_here},
        "torchdata": {},
        "torchdata.stateful_dataloader": {"StatefulDataLoader": _not_here},
    }
    for name, attributes in names.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        module.__path__ = []  # a package: `flash_attn.ops...` then fails as not installed, as OpenRLHF expects
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def _cpu_only(strategy_module: Any) -> None:
    """The GPU calls OpenRLHF makes around its saves, on a CPU-only torch."""
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda device=None: None
    mesh = strategy_module.init_device_mesh
    strategy_module.init_device_mesh = lambda device_type, *args, **kwargs: mesh("cpu", *args, **kwargs)


def _args(rank: int) -> Any:
    """The parts of OpenRLHF's parsed arguments (`cli/train_ppo_ray.py`) its strategy and models read."""
    from types import SimpleNamespace

    return SimpleNamespace(
        local_rank=rank,
        ds=SimpleNamespace(
            param_dtype="bf16",
            zero_stage=2,
            adam_offload=False,
            zpg=1,
            use_universal_ckpt=False,
            grad_accum_dtype=None,
            overlap_comm=False,
            deepcompile=False,
            tensor_parallel_size=1,
            ring_attn_size=1,
        ),
        train=SimpleNamespace(dynamic_batch_enable=False),
    )


def _train_config() -> dict[str, Any]:
    """What `PolicyModelActor`/`CriticModelActor.init_model_from_pretrained` pass to `strategy.prepare`."""
    return {
        "optim": "adam",
        "muon": {},
        "adam": {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0},
        "lr_scheduler": "cosine_with_min_lr",
        "lr_warmup_ratio": 0.03,
        "min_lr_ratio": 0.1,
        "max_norm": 1.0,
        "scheduler_steps": STEPS,
    }


def _data_loader_state(step: int) -> dict[str, Any]:
    """`StatefulDataLoader.state_dict()` of PPO's prompts loader (batch size 1) after `step` rollouts."""
    yielded = step * PROMPTS_PER_STEP // WORLD_SIZE
    return {
        "_index_sampler_state": None,
        "_sampler_iter_state": None,
        "_sampler_iter_yielded": yielded,
        "_num_yielded": yielded,
        "_IterableDataset_len_called": None,
        "_shared_seed": None,
        "fetcher_state": None,
        "dataset_state": None,
        "_iterator_finished": False,
    }


def train_rank(rank: int, root: str) -> None:
    """One rank of the PPO saves into `root` (prepared by `prepare_run`), run by the DeepSpeed writer's ranks after
    their own runs (`write_deepspeed_sets(..., then=[(train_rank, (root,))])`): the environment and the
    DeepSpeed process group OpenRLHF's `setup_distributed` would set up are theirs (`DS_ACCELERATOR=cpu`, gloo,
    2 ranks, DeepSpeed's shared-memory op left unbuilt), and `deepspeed.init_distributed` does nothing the second
    time."""
    _install_stand_ins()
    import importlib

    import deepspeed

    strategy_module = importlib.import_module("openrlhf.utils.deepspeed.deepspeed")
    _cpu_only(strategy_module)
    from openrlhf.models import Actor, get_llm_for_sequence_regression
    from openrlhf.utils import get_tokenizer
    from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync

    folder = Path(root)
    pretrain = str(folder / "pretrain")
    output_dir = folder / "ckpt"
    ckpt_path = output_dir / "checkpoints_ppo_ray"

    strategy = strategy_module.DeepspeedStrategy(
        seed=42, max_norm=1.0, micro_train_batch_size=2, train_batch_size=4, zero_stage=2, args=_args(rank)
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
    critic = get_llm_for_sequence_regression(
        pretrain,
        "critic",
        attn_implementation="eager",
        param_dtype="bf16",
        ds_config=strategy.get_ds_train_config(),
        value_head_prefix="score",
        init_value_head=True,
    )
    tokenizer = get_tokenizer(pretrain, actor.model, "left", strategy, use_fast=True)
    (actor, actor_optim, actor_scheduler), (critic, critic_optim, critic_scheduler) = strategy.prepare(
        (actor, _train_config()), (critic, _train_config())
    )

    def save(tag: str, client_states: dict[str, Any] | None, metric_value: Any, metric_key: Any) -> None:
        strategy.save_ckpt(
            actor.model,
            str(ckpt_path / "_actor"),
            tag,
            MAX_NUM,
            float("inf"),
            client_states or {},
            metric_value=metric_value,
            metric_key=metric_key,
        )
        strategy.save_model(actor, tokenizer, str(ckpt_path / f"{tag}_hf"))
        torch_dist_barrier_and_cuda_sync()
        strategy.save_ckpt(
            critic,
            str(ckpt_path / "_critic"),
            tag,
            MAX_NUM,
            float("inf"),
            metric_value=metric_value,
            metric_key=metric_key,
        )

    best_key, best_value, latest_value = "", float("-inf"), None
    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(1, STEPS + 1):
        sequences = torch.randint(3, VOCAB, (2, 12), generator=generator)
        attention_mask = torch.ones_like(sequences)
        action_mask = torch.ones(2, 4)
        loss = -actor(sequences, action_mask, attention_mask).mean()
        strategy.backward(loss, actor, actor_optim)
        strategy.optimizer_step(actor_optim, actor, actor_scheduler)
        values = critic(sequences, action_mask, attention_mask)
        strategy.backward((values.float() - 1.0).pow(2).mean(), critic, critic_optim)
        strategy.optimizer_step(critic_optim, critic, critic_scheduler)

        client_states: dict[str, Any] = {
            "episode": 0,
            "global_step": step,
            "total_consumed_prompts": step * PROMPTS_PER_STEP,
            "data_loader_state_dict": _data_loader_state(step),
        }
        # PPOTrainer.save_logs_and_checkpoints
        client_states["best_eval_metric_key"] = best_key
        client_states["best_eval_metric_value"] = best_value
        client_states["latest_eval_metric_value"] = latest_value
        metric_key = client_states.get("checkpoint_metric_key") or best_key or None
        save(f"global_step{step}", client_states, latest_value, metric_key)
        if step == EVAL_STEP:  # PPOTrainer.save_best_checkpoint, after an evaluation
            best_key, best_value, latest_value = EVAL_METRIC, EVAL_VALUE, EVAL_VALUE
            client_states.update(
                best_eval_metric_key=best_key,
                best_eval_metric_value=best_value,
                latest_eval_metric_value=latest_value,
                checkpoint_metric_key=best_key,
            )
            save(f"best_global_step{step}", client_states, best_value, best_key)

    # After training: PolicyModelActor.save_model and CriticModelActor.save_model.
    strategy.save_model(actor, tokenizer, str(output_dir))
    strategy.save_model(critic, tokenizer, str(output_dir) + "_critic")
    if rank == 0:
        _write_reference(ckpt_path / "_actor", f"global_step{STEPS}", folder / "actor.reference.safetensors")
    deepspeed.comm.barrier()


def _write_reference(save_dir: Path, tag: str, path: Path) -> None:
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
        state = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag=tag)
    save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, str(path))


def prepare_run(root: Path) -> None:
    """The pretrained model the ranks of `train_rank` start from, in `root/pretrain`."""
    root.mkdir(parents=True, exist_ok=True)
    _write_pretrain(root / "pretrain")


def written_run(root: Path) -> WrittenOpenRlhf:
    """What the ranks of `train_rank` wrote into `root` (see the module docstring)."""
    ckpt_path = root / "ckpt" / "checkpoints_ppo_ray"
    tags = ("best_global_step2", "global_step2", "global_step3")
    written = WrittenOpenRlhf(
        output_dir=root / "ckpt",
        ckpt_path=ckpt_path,
        critic_output_dir=root / "ckpt_critic",
        tags=tags,
        latest=f"global_step{STEPS}",
        exports=tuple(f"{tag}_hf" for tag in ("global_step1", "global_step2", "best_global_step2", "global_step3")),
        rotated=("global_step1",),
        reference=root / "actor.reference.safetensors",
        world_size=WORLD_SIZE,
    )
    (root / "written.json").write_text(json.dumps({"tags": tags}))
    return written
