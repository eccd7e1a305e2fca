"""Megatron dist-ckpt (`torch_dist`) folders written by megatron-core 0.16.1's own saving code.

Two gloo ranks on the CPU run megatron-core's `GPTModel` with tensor-parallel size 2
(`parallel_state.initialize_model_parallel`), a tiny Llama-style configuration (2 layers, hidden 64, GQA with
4 heads in 2 query groups, SwiGLU, RMSNorm, RoPE, no biases). Its weights are a transformers
`LlamaForCausalLM`'s, built from a local seeded `LlamaConfig` and put into each rank's tensor-parallel part
with the layout Megatron-Bridge's Llama bridge uses (`merge_qkv_weights`: per query group its query heads,
then its key and value head; `linear_fc1` = gate rows then up rows, each rank holding its part of both).
Before anything is saved, each rank checks that megatron-core's forward pass gives the transformers model's
logits (its part of the vocabulary): the weights are where megatron-core reads them, not merely where a
converter would look for them. The transformers models are built, saved (`save_pretrained`) and run once in
the calling process; the ranks get their weights and logits through a torch.save file, so that they import
megatron-core only.

What is saved is what Megatron-LM's `save_checkpoint` saves with `--ckpt-format torch_dist`
(NVIDIA/Megatron-LM @ d98e8a64, `megatron/training/checkpointing.py`): the state dict of
`generate_state_dict` (`args`, `checkpoint_version` 3.0, `iteration`, `model` = the model's
`sharded_state_dict()`, `optimizer` = megatron-core's `FP32Optimizer.sharded_state_dict`,
`opt_param_scheduler` = megatron-core's `OptimizerParamScheduler.state_dict()`, `rng_state` = a ShardedObject
per (pp, tp) rank as `get_rng_state` builds it, CPU generators only) goes through
`megatron.core.dist_checkpointing.save(state_dict, <save>/iter_{iteration:07d}, ("torch_dist", 1))`, and rank 0
then writes the tracker `latest_checkpointed_iteration.txt` beside the iteration folders with
`f.write('release' if release else str(iteration))` (`iter_finalize_fn` of `save_checkpoint`, after the
barrier; `get_checkpoint_name` and `get_checkpoint_tracker_filename` name the folder and the tracker).

The run (`save`) trains two iterations with `--save-interval 1`: megatron-core's scheduler warms the learning
rate up from 0, so iteration 1 leaves the weights exactly as loaded (the round trip's reference) while filling
the optimizer's state, and iteration 2 changes them. `release_save` holds the same model saved with
`release=True` and no optimizer (`--no-save-optim`), as a converted model is published. `tied` is a model
with tied input and output embeddings (`share_embeddings_and_output_weights`) saved by megatron-core alone, as
the libraries built on it call it: `dist_checkpointing.save(model.sharded_state_dict(), ...)` with no
Megatron-LM state around it (no arguments in `common.pt`) into a `dist_ckpt/` folder, and no tracker.

Where megatron-core assumes a GPU, the ranks stand in for it on the CPU (nothing else is changed):
`torch.cuda.synchronize` (its async writer waits for device-to-host copies, `preload_tensors`) and
`torch.cuda.current_device` (the device of the save's failure flag, `save_state_dict_async_finalize`) become a
no-op and "cpu"; `FP32Optimizer.__init__` puts its constant loss scale of 1.0 on CUDA, so the optimizer is
built by the base class's `__init__` with that scale on the CPU. No apex, transformer_engine or flash_attn
module is needed: megatron-core's local layer spec (`get_gpt_layer_local_spec`) uses none.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.writers.ranks import join_gloo, run_ranks

__all__ = ["TRACKER", "WrittenMegatron", "gpt_model", "write_megatron_runs"]

#: Megatron-LM's tracker file (`get_checkpoint_tracker_filename`).
TRACKER = "latest_checkpointed_iteration.txt"
#: The source models' weights and logits, handed from the calling process to the ranks.
_SOURCES = ".sources.pt"
#: Where the tied model's dist-ckpt goes (verl keeps its megatron-core save in such a `dist_ckpt/`).
_TIED = "tied/dist_ckpt"

_TP = 2
_LAYERS = 2
_HIDDEN = 64
_HEADS = 4
_GROUPS = 2
_FFN = 128
_VOCAB = 128
_SEQ = 64
_EPS = 1e-6
_ROPE_BASE = 10000


@dataclass(frozen=True)
class WrittenMegatron:
    """What the writer saved.

    Attributes:
        save: Megatron-LM's `--save` folder: `iter_0000001/`, `iter_0000002/`, the tracker ("2").
        release_save: a `--save` folder with `release/` and the tracker "release".
        tied: megatron-core's save of a model with tied embeddings (`tied/dist_ckpt`).
        source: the transformers model whose weights iteration 1 holds (`save_pretrained`: config.json and
            model.safetensors).
        tied_source: the same for `tied` (`tie_word_embeddings=True`).
        parameters: the source model's parameter count (transformers'), `tied_parameters` the tied one's.
        megatron_version: megatron-core's version, as its package metadata says.
    """

    save: Path
    release_save: Path
    tied: Path
    source: Path
    tied_source: Path
    parameters: int
    tied_parameters: int
    megatron_version: str
    tensor_parallel: int = _TP
    iterations: tuple[int, ...] = (1, 2)

    def iteration(self, n: int) -> Path:
        """The folder of iteration `n` of `save` (Megatron-LM's `get_checkpoint_name`)."""
        return self.save / f"iter_{n:07d}"


def _llama_config(tied: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=_VOCAB,
        hidden_size=_HIDDEN,
        intermediate_size=_FFN,
        num_hidden_layers=_LAYERS,
        num_attention_heads=_HEADS,
        num_key_value_heads=_GROUPS,
        max_position_embeddings=_SEQ,
        rms_norm_eps=_EPS,
        rope_theta=float(_ROPE_BASE),
        tie_word_embeddings=tied,
    )


def _source_llama(tied: bool) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(4321 if tied else 1234)
    model = LlamaForCausalLM(_llama_config(tied))
    # Norm weights start at 1.0 in transformers: random ones make a swapped norm visible in the round trip.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    return model.eval()


def _transformer_config(tensor_parallel: int = _TP) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=_LAYERS,
        hidden_size=_HIDDEN,
        ffn_hidden_size=_FFN,
        num_attention_heads=_HEADS,
        num_query_groups=_GROUPS,
        kv_channels=_HIDDEN // _HEADS,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        layernorm_epsilon=_EPS,
        add_bias_linear=False,
        tensor_model_parallel_size=tensor_parallel,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def gpt_model(tied: bool, tensor_parallel: int = _TP) -> Any:
    """The saved model: megatron-core's `GPTModel` of the local layer spec (also what a load builds, with the
    tensor-parallel size it loads with)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        _transformer_config(tensor_parallel),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=_VOCAB,
        max_sequence_length=_SEQ,
        position_embedding_type="rope",
        rotary_base=_ROPE_BASE,
        share_embeddings_and_output_weights=tied,
    )


def _megatron_lm_args(iteration: int) -> argparse.Namespace:
    """The model's part of Megatron-LM's `args` (names from `megatron/training/arguments.py`) as
    `generate_state_dict` pickles them into the checkpoint, with megatron-core's own enum values."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=_LAYERS,
        hidden_size=_HIDDEN,
        ffn_hidden_size=_FFN,
        num_attention_heads=_HEADS,
        group_query_attention=True,
        num_query_groups=_GROUPS,
        kv_channels=_HIDDEN // _HEADS,
        max_position_embeddings=_SEQ,
        seq_length=_SEQ,
        position_embedding_type="rope",
        rotary_base=_ROPE_BASE,
        normalization="RMSNorm",
        norm_epsilon=_EPS,
        swiglu=True,
        untie_embeddings_and_output_weights=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=False,
        padded_vocab_size=_VOCAB,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=_TP,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        num_experts=None,
        data_parallel_size=1,
        world_size=_TP,
        ckpt_format="torch_dist",
        transformer_impl="local",
        attention_backend=AttnBackend.auto,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        iteration=iteration,
        consumed_train_samples=iteration * 4,
        save_interval=1,
        use_distributed_optimizer=False,
    )


def _megatron_tensors(hf: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """The transformers weights as megatron-core's full (unsplit) tensors, named as its modules name them."""
    head = _HIDDEN // _HEADS
    per_group = _HEADS // _GROUPS
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for layer in range(_LAYERS):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        q = hf[src + "self_attn.q_proj.weight"].view(_HEADS, head, _HIDDEN)
        k = hf[src + "self_attn.k_proj.weight"].view(_GROUPS, head, _HIDDEN)
        v = hf[src + "self_attn.v_proj.weight"].view(_GROUPS, head, _HIDDEN)
        groups = [
            torch.cat([q[g * per_group : (g + 1) * per_group], k[g : g + 1], v[g : g + 1]]) for g in range(_GROUPS)
        ]
        out[dst + "self_attention.linear_qkv.weight"] = torch.cat(groups).reshape(-1, _HIDDEN)
        out[dst + "self_attention.linear_proj.weight"] = hf[src + "self_attn.o_proj.weight"]
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]]
        )
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def _tp_part(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of a full tensor: column-parallel layers split their rows, row-parallel ones their
    columns, norms are whole on every rank; `linear_fc1` holds its part of the gate rows, then of the up rows."""
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(_TP)[rank], up.chunk(_TP)[rank]])
    if name.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
        return full.chunk(_TP)[rank]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(_TP, dim=1)[rank]
    return full


def _load(model: Any, hf: dict[str, torch.Tensor], tied: bool, rank: int) -> None:
    full = _megatron_tensors(hf, tied)
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(full), (sorted(params), sorted(full))
    with torch.no_grad():
        for name, param in params.items():
            part = _tp_part(name, full[name], rank)
            assert part.shape == param.shape, (name, part.shape, param.shape)
            param.copy_(part)


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, positions and Megatron's causal mask (True where attention is masked; megatron-core builds
    its default mask on CUDA, so the mask is passed as Megatron-LM's data loaders pass it)."""
    tokens = torch.randint(0, _VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    mask = torch.ones(tokens.shape[1], tokens.shape[1]).triu(diagonal=1).bool()[None, None]
    return tokens, positions, mask


def _check_logits(model: Any, logits: torch.Tensor, rank: int) -> None:
    """megatron-core's logits (this rank's part of the vocabulary) equal the transformers model's."""
    tokens, positions, mask = _inputs(7)
    with torch.no_grad():
        ours = model(tokens, positions, attention_mask=mask)
    part = logits.chunk(_TP, dim=-1)[rank]
    assert ours.shape == part.shape, (ours.shape, part.shape)
    assert torch.allclose(ours, part, atol=1e-4, rtol=1e-4), (ours - part).abs().max()


def _cpu_rng_tracker() -> None:
    """The model-parallel RNG state that attention's dropout forks (`DotProductAttention.forward`), kept in
    the CPU generator's format: `model_parallel_cuda_manual_seed` would create it with CUDA calls. Dropout is
    0 here, so no random number is drawn from it."""
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    tp_random.get_cuda_rng_tracker().set_states({tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME: torch.get_rng_state()})


def _rng_state(rank: int) -> Any:
    """Megatron-LM's `get_rng_state` (CPU generators only: no CUDA here): one ShardedObject per (pp, tp) rank."""
    import random

    import numpy as np
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
        }
    ]
    return ShardedObject("rng_state", state, (1, _TP), (0, rank), replica_id=0)


def _save(state: dict[str, Any], save: Path, iteration: int, *, release: bool = False, rank: int) -> None:
    """`dist_checkpointing.save` into Megatron-LM's folder for the iteration, then its tracker, as
    `save_checkpoint` does (tracker after a barrier, by rank 0, as a plain write)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    folder = save / ("release" if release else f"iter_{iteration:07d}")
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, str(folder), sharded_strategy=("torch_dist", 1))
    dist.barrier()
    if rank == 0:
        with open(save / TRACKER, "w") as f:
            f.write("release" if release else str(iteration))


def lr_scheduler(optimizer: Any) -> Any:
    """The writer's `OptimizerParamScheduler` over `optimizer` (constant LR and weight decay after one warm-up
    step); the fault matrix's loader builds the same to load the scheduler's state into."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=0.0,
        lr_warmup_steps=1,
        lr_decay_steps=10,
        lr_decay_style="constant",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )


def _optimizer(model: Any) -> Any:
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, bf16=False, fp16=False)
    inner = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.01)
    optimizer = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(optimizer, inner, config, lambda opt, cfg: None)
    optimizer._scale = torch.tensor([1.0])
    optimizer.is_stub_optimizer = False
    return optimizer


def _train_step(model: Any, optimizer: Any, scheduler: Any, rank: int, step: int) -> None:
    tokens, positions, mask = _inputs(100 + step)
    optimizer.zero_grad()
    loss = model(tokens, positions, attention_mask=mask, labels=tokens).float().mean()
    loss.backward()
    optimizer.optimizer.step()
    scheduler.step(increment=1)


def _worker(rank: int, world_size: int, rendezvous: str, root: str) -> None:
    import torch.distributed as dist

    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    join_gloo(rank, world_size, rendezvous=rendezvous)
    from megatron.core import dist_checkpointing, parallel_state

    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=_TP)
        _cpu_rng_tracker()
        base = Path(root)
        sources = torch.load(base / _SOURCES, weights_only=True)
        model = gpt_model(tied=False)
        _load(model, sources["untied"]["state"], tied=False, rank=rank)
        _check_logits(model, sources["untied"]["logits"], rank)
        loaded = {k: v.detach().clone() for k, v in model.state_dict().items() if v is not None}

        # Megatron-LM publishes a converted model as `release/` without optimizer state.
        _save(
            {
                "args": _megatron_lm_args(0),
                "checkpoint_version": 3.0,
                "iteration": 0,
                "model": model.sharded_state_dict(),
            },
            base / "release-save",
            0,
            release=True,
            rank=rank,
        )

        optimizer = _optimizer(model)
        scheduler = lr_scheduler(optimizer)
        for iteration in (1, 2):
            _train_step(model, optimizer, scheduler, rank, iteration)
            if iteration == 1:  # lr 0 during warmup: the weights are still the loaded ones, bit for bit
                now = model.state_dict()
                assert all(torch.equal(now[k], v) for k, v in loaded.items())
            model_state = model.sharded_state_dict()
            _save(
                {
                    "args": _megatron_lm_args(iteration),
                    "checkpoint_version": 3.0,
                    "iteration": iteration,
                    "model": model_state,
                    "optimizer": optimizer.sharded_state_dict(model_state),
                    "opt_param_scheduler": scheduler.state_dict(),
                    "rng_state": _rng_state(rank),
                    "num_floating_point_operations_so_far": 1000 * iteration,
                },
                base / "save",
                iteration,
                rank=rank,
            )

        # megatron-core alone, as the libraries built on it call it: the model's sharded state dict only.
        tied = gpt_model(tied=True)
        _load(tied, sources["tied"]["state"], tied=True, rank=rank)
        _check_logits(tied, sources["tied"]["logits"], rank)
        (base / _TIED).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(tied.sharded_state_dict(), str(base / _TIED), sharded_strategy=("torch_dist", 1))
        dist.barrier()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _sources(root: Path) -> dict[str, int]:
    """Build, save and run the two transformers models; their weights and logits go to the ranks through
    `_SOURCES`. Returns their parameter counts."""
    tokens, _, _ = _inputs(7)
    sources, counts = {}, {}
    for kind, folder in (("untied", "source"), ("tied", "tied-source")):
        model = _source_llama(tied=kind == "tied")
        model.save_pretrained(root / folder)
        with torch.no_grad():
            logits = model(input_ids=tokens).logits
        sources[kind] = {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "logits": logits}
        counts[kind] = sum(p.numel() for p in model.parameters())
    torch.save(sources, root / _SOURCES)
    return counts


def write_megatron_runs(root: Path) -> WrittenMegatron:
    """Run the two ranks once (tens of seconds on a loaded machine: each imports megatron-core) and say what
    they wrote."""
    from importlib.metadata import version

    root.mkdir(parents=True, exist_ok=True)
    counts = _sources(root)
    rendezvous = root / ".rendezvous"
    run_ranks(_worker, (_TP, str(rendezvous), str(root)), _TP)
    rendezvous.unlink(missing_ok=True)
    (root / _SOURCES).unlink()
    return WrittenMegatron(
        save=root / "save",
        release_save=root / "release-save",
        tied=root / _TIED,
        source=root / "source",
        tied_source=root / "tied-source",
        parameters=counts["untied"],
        tied_parameters=counts["tied"],
        megatron_version=version("megatron-core"),
    )
