"""torchtitan 0.3.0's own `CheckpointManager` saving its own Llama 3 model, on one CPU rank.

What torchtitan's `Trainer` builds for checkpointing (torchtitan/trainer.py, `Trainer.__init__`), at a tiny
size: `Llama3Model` from the same layer configs as its flavours (`torchtitan.models.llama3._build_llama3_layers`:
GQA with 4 heads over 2 KV heads, Llama 3 RoPE scaling), AdamW through `OptimizersContainer`
(`default_adamw`), `LRSchedulersContainer`, a `ParallelAwareDataloader` and the trainer's `train_state`
counters, handed to `CheckpointManager(config.checkpoint, ...)` with `base_folder=dump_folder`; then per step
what `Trainer.train` does: an optimizer step, `lr_schedulers.step()`, `checkpointer.save(step, last_step=...)`.
Three steps with `interval=1`: `step-1`, `step-2` full saves, `step-3` the model-only last save
(`last_save_model_only`, torchtitan's default).

The references are torchtitan's own: its `Llama3StateDictAdapter.to_hf` of the model at step 2 (what its
conversion to transformers writes) and the logits of its model at step 2 on fixed token ids.

Stand-ins (in the spawned rank only, for imports made by torchtitan's modules): `tyro` (its CLI parser; the
configs are built here as dataclasses), `triton` (GPU kernels of its MoE dispatch, not on this path),
`spmd_types` (its local-SPMD type annotations: checks off, `local_map` and `local()` plain, as with no mesh),
`torchdata`'s `StatefulDataLoader` (a `DataLoader` whose `state_dict()` holds the sample count). The model
runs with torch's SDPA inner attention (`ScaledDotProductAttention`, causal) rather than FlexAttention,
which compiles for tens of seconds on CPU; attention holds no weights, so the checkpoint is the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.writers.ranks import join_gloo, run_ranks
from tests.writers.stand_ins import InertModule, StandIns

__all__ = ["HF_CONFIG", "TOKENS", "WrittenTorchtitan", "model_parameters", "write_torchtitan_run"]

STEPS = 3
DIM, HEADS, KV_HEADS, LAYERS, VOCAB, HIDDEN = 64, 4, 2, 2, 128, 96
#: Token ids the logits are compared on.
TOKENS = (1, 7, 42, 99, 3, 127, 64, 5)
#: The transformers config of the same model (what torchtitan's `hf_assets_path` holds for a real Llama 3).
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": DIM,
    "intermediate_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def model_parameters() -> int:
    """Elements of the model's parameters (embedding, 2 layers of GQA attention and SwiGLU, norm, head)."""
    head_dim = DIM // HEADS
    attention = DIM * DIM * 2 + 2 * DIM * KV_HEADS * head_dim
    layer = attention + 3 * DIM * HIDDEN + 2 * DIM
    return 2 * VOCAB * DIM + LAYERS * layer + DIM


@dataclass(frozen=True)
class WrittenTorchtitan:
    """What torchtitan wrote.

    Attributes:
        dump_folder: `--dump_folder`; the checkpoints are in `checkpoint/` below it.
        assets: the HF config folder of the model (`--model.hf_assets_path`).
        reference: safetensors of torchtitan's `to_hf` of the model at step 2, and `logits.safetensors`
            beside it: its model's logits at step 2 on `TOKENS`.
    """

    dump_folder: Path
    assets: Path
    reference: Path

    @property
    def folder(self) -> Path:
        return self.dump_folder / "checkpoint"

    def step(self, n: int) -> Path:
        return self.folder / f"step-{n}"


# --------------------------------------------------------------------------------------------------
# Stand-ins (see the module docstring).
# --------------------------------------------------------------------------------------------------


class _Plain(contextlib.ContextDecorator):
    """`spmd.local()` / `spmd.no_typecheck()`: a context manager and decorator that does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _Plain:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _torchdata() -> dict[str, Any]:
    from torch.utils.data import DataLoader

    class StatefulDataLoader(DataLoader):  # type: ignore[type-arg]
        _yielded = 0

        def __iter__(self) -> Any:
            for batch in super().__iter__():
                self._yielded += 1
                yield batch

        def state_dict(self) -> dict[str, Any]:
            return {"_num_yielded": self._yielded}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self._yielded = state["_num_yielded"]

    return {"StatefulDataLoader": StatefulDataLoader}


_WORKING = {
    "spmd_types": lambda: {
        "is_type_checking": lambda: False,
        "local_map": lambda *args, **kwargs: lambda function: function,
        "no_typecheck": _Plain,
        "local": _Plain,
    },
    "spmd_types.runtime": lambda: {"has_local_type": lambda tensor: False},
    "torchdata.stateful_dataloader": _torchdata,
}
_STOOD_IN = frozenset({"tyro", "triton", "spmd_types", "torchdata"})


def _stand_in(name: str) -> types.ModuleType:
    """An inert module, with the attributes torchtitan uses of it where it uses some (`_WORKING`)."""
    return InertModule(name, **_WORKING.get(name, dict)())


# --------------------------------------------------------------------------------------------------
# The rank.
# --------------------------------------------------------------------------------------------------


def _model_config() -> Any:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init
    from torchtitan.models.llama3.model import Llama3Model

    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            n_layers=LAYERS,
            dim=DIM,
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            hidden_dim=HIDDEN,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


class _TrainState:
    """The trainer's own counters (`Trainer.state_dict`), saved as `train_state`."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def _worker(rank: int, rendezvous: str, dump_folder: str, reference: str) -> None:
    import torch
    import torch.distributed as dist

    sys.meta_path.append(StandIns("torchtitan", _STOOD_IN, _stand_in))
    join_gloo(rank, 1, rendezvous=rendezvous)
    from safetensors.torch import save_file
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    try:
        config = _model_config()
        torch.manual_seed(0)
        with torch.device("meta"):
            model = config.build()
        model.to_empty(device="cpu")
        model.init_states(buffer_device=torch.device("cpu"))
        optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
        schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=STEPS)
        tokens = torch.arange(STEPS * 9).reshape(STEPS, 9) % VOCAB
        dataloader = ParallelAwareDataloader(
            torch.utils.data.TensorDataset(tokens), dp_rank=0, dp_world_size=1, batch_size=1
        )
        train_state = _TrainState()
        checkpointer = CheckpointManager(
            CheckpointManager.Config(enable=True, interval=1),
            dataloader=dataloader,
            model_parts=[model],
            optimizers=optimizers,
            lr_schedulers=schedulers,
            states={"train_state": train_state},
            sd_adapter=Llama3StateDictAdapter(config, None),
            base_folder=dump_folder,
        )
        batches = iter(dataloader)
        for step in range(1, STEPS + 1):
            (batch,) = next(batches)
            # FlexAttention has no backward on CPU: gradients stand in for a loss's (the save path is the same).
            torch.manual_seed(step)
            for parameter in model.parameters():
                parameter.grad = torch.randn_like(parameter) * 0.1
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad()
            train_state.step = step
            train_state.ntokens_seen += batch.numel()
            checkpointer.save(step, last_step=step == STEPS)
            if step == 2:
                adapter = Llama3StateDictAdapter(config, None)
                hf = adapter.to_hf({k: v.detach().clone() for k, v in model.state_dict().items()})
                save_file({k: v.contiguous() for k, v in hf.items()}, reference)
                with torch.no_grad():
                    logits = model(torch.tensor([TOKENS]))
                save_file({"logits": logits[0].contiguous()}, str(Path(reference).with_name("logits.safetensors")))
        checkpointer.close()
    finally:
        dist.destroy_process_group()


def write_torchtitan_run(root: Path) -> WrittenTorchtitan:
    """Run torchtitan's checkpointing in a spawned CPU rank into `root/outputs/` (see the module docstring)."""
    dump_folder = root / "outputs"
    assets = root / "assets"
    assets.mkdir(parents=True)
    (assets / "config.json").write_text(json.dumps(HF_CONFIG, indent=2))
    reference = root / "reference" / "model.safetensors"
    reference.parent.mkdir()
    rendezvous = root / "rendezvous"
    env = {"OMP_NUM_THREADS": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        run_ranks(_worker, (str(rendezvous), str(dump_folder), str(reference)), 1)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return WrittenTorchtitan(dump_folder, assets, reference)
