"""Real DeepSpeed ZeRO checkpoints for tests, written by DeepSpeed itself on CPU.

`write_deepspeed_sets` spawns 2 ranks (torch.multiprocessing, gloo through `deepspeed.init_distributed`,
`DS_ACCELERATOR=cpu`) that train the tiny Llama of `tests.writers.models` for 4 steps with bf16 under each
requested ZeRO stage, 0 (no ZeRO) included (one `deepspeed.initialize` per stage, in the same processes
to pay the imports once) and `engine.save_checkpoint` at steps 2 and 4, so that each save folder holds `latest`,
`global_step2/` and `global_step4/`. bf16 works on DeepSpeed's CPU accelerator, so the optim files carry
the `bf16_` prefix as they do on GPUs. The ZeRO-3 run freezes one parameter, so that its
`frozen_param_fragments` are exercised too. Several sets of such folders (each with its own options) are
trained by the same two ranks: the suite's runs and the converter's (`CONVERTER_RUNS`) share one spawn.

After the last save rank 0 runs DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint` (what
`zero_to_fp32.py` does) on the latest tag and writes the result as the reference safetensors file
(without ZeRO, which zero_to_fp32 does not read, the module's own weights).

Options for the converter's tests (the defaults give the runs above): `tie_embeddings` ties `lm_head` to
the input embeddings (DeepSpeed records it in `shared_params`), `frozen` chooses the frozen parameter of
each stage, `wrap` trains, under the given stages, the model inside a wrapper module as OpenRLHF's
`Actor` does (every name gains a `model.` prefix; the wrapper's inner model also gets a persistent bf16
buffer and an integer one, so that `buffer_names` is exercised).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.writers.deepspeed_ranks import join_deepspeed_ranks
from tests.writers.ranks import run_ranks

__all__ = [
    "CONVERTER_FROZEN",
    "CONVERTER_RUNS",
    "DeepSpeedRuns",
    "WrittenDeepSpeed",
    "write_deepspeed_sets",
]

WORLD_SIZE = 2
STEPS = 4
SAVE_EVERY = 2
#: Frozen under ZeRO-3 (`frozen_param_shapes` / `frozen_param_fragments`).
FROZEN_UNDER_ZERO3 = "model.norm.weight"
#: The prefix a wrapped model's names carry (OpenRLHF's `Actor` holds the HF model as `self.model`).
WRAPPER_PREFIX = "model."
#: Buffers the wrapped model's inner model registers (names inside the HF model).
WRAPPED_BUFFERS = ("model.calibration", "model.bucket_ids")


@dataclass(frozen=True)
class WrittenDeepSpeed:
    """A DeepSpeed save folder written by DeepSpeed and what it must contain.

    Attributes:
        save_dir: the folder with `latest` and one tag folder per save.
        zero_stage: the ZeRO stage it was trained with.
        tags: the tag folders, oldest first (`latest` names the last).
        reference: safetensors of DeepSpeed's own fp32 reconstruction of the latest tag.
        model_parameters: elements of the model's parameters (what `param_shapes` must add up to).
        frozen: names of frozen parameters (as the HF model names them, without a wrapper prefix).
        world_size: DP ranks.
        client_state: what the writer passed as `client_state` to the last save.
        tied: whether `lm_head.weight` is tied to the input embeddings.
        wrapped: whether the model was trained inside a wrapper (names prefixed with `WRAPPER_PREFIX`).
        config_dir: a folder holding the model's `config.json` (for loading a conversion in transformers).
    """

    save_dir: Path
    zero_stage: int
    tags: tuple[str, ...]
    reference: Path
    model_parameters: int
    frozen: tuple[str, ...]
    world_size: int
    client_state: dict[str, int]
    tied: bool = False
    wrapped: bool = False
    config_dir: Path | None = None

    @property
    def latest(self) -> Path:
        return self.save_dir / self.tags[-1]

    def reference_tensors(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.reference))


def _client_state(step: int) -> dict[str, int]:
    return {"consumed_samples": step * 2 * WORLD_SIZE, "episode": 3, "training_step": step}


def _model(tie_embeddings: bool) -> Any:
    from tests.writers.models import tiny_llama

    model = tiny_llama()
    if tie_embeddings:
        from transformers import LlamaForCausalLM

        config = model.config
        config.tie_word_embeddings = True
        torch.manual_seed(1234)
        model = LlamaForCausalLM(config)
    return model


class _Wrapper(torch.nn.Module):
    """Holds the HF model as `self.model`, as OpenRLHF's `Actor` does."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        model.model.register_buffer("calibration", torch.linspace(0.5, 1.5, 8, dtype=torch.bfloat16))
        model.model.register_buffer("bucket_ids", torch.arange(6, dtype=torch.int64))

    def forward(self, **kwargs: Any) -> Any:
        return self.model(**kwargs)


def _train(
    rank: int,
    stage: int,
    save_dir: Path,
    tie_embeddings: bool = False,
    frozen: tuple[str, ...] | None = None,
    wrap: bool = False,
) -> Any:
    import deepspeed

    model = _model(tie_embeddings)
    if wrap:
        model = _Wrapper(model)
    for name in (FROZEN_UNDER_ZERO3,) if frozen is None and stage == 3 else frozen or ():
        model.get_parameter(name).requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        # A torch optimizer rather than DeepSpeed's FusedAdam, which would compile an op first.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(1, STEPS + 1):
        ids = torch.randint(0, 128, (2, 16), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if step % SAVE_EVERY == 0:
            engine.save_checkpoint(str(save_dir), client_state=_client_state(step))
    return engine


def _worker(rank: int, port: int, jobs: Sequence[_Job], then: Sequence[_Then]) -> None:
    join_deepspeed_ranks(rank, WORLD_SIZE, port)
    import deepspeed  # after joining, which picks DeepSpeed's CPU accelerator

    for out, stages, tie_embeddings, frozen, wrap in jobs:
        for stage in stages:
            save_dir = Path(out) / f"zero{stage}"
            stage_frozen = None if frozen is None else tuple(frozen.get(stage, ()))
            engine = _train(rank, stage, save_dir, tie_embeddings, stage_frozen, stage in wrap)
            deepspeed.comm.barrier()
            if rank == 0:
                _write_reference(save_dir, engine if stage == 0 else None)
            deepspeed.comm.barrier()
    for work, args in then:
        work(rank, *args)


def _write_reference(save_dir: Path, engine: Any) -> None:
    """zero_to_fp32's reconstruction of the latest tag; without ZeRO (which zero_to_fp32 does not read),
    the module's own (bf16) weights, which are what the model states hold."""
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    if engine is not None:
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    else:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
            state = get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    path = save_dir.parent / f"{save_dir.name}.reference.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, str(path))  # tied: unshared


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The converter tests' runs (tests/ops/test_convert_zero.py): ZeRO 0-3 of the tied model, one frozen parameter
#: per stage, and ZeRO-1 inside the wrapper.
CONVERTER_FROZEN: dict[int, tuple[str, ...]] = {
    1: ("model.norm.weight",),
    2: ("model.layers.0.mlp.up_proj.weight",),
    3: ("model.layers.1.self_attn.k_proj.weight",),
}


@dataclass(frozen=True)
class DeepSpeedRuns:
    """What `write_deepspeed_sets` trains into one folder: one save folder per ZeRO stage, with these options.

    Attributes:
        stages: the ZeRO stages (`zero{stage}/`).
        tie_embeddings: tie `lm_head.weight` to `model.embed_tokens.weight`.
        frozen: stage -> names of the parameters to freeze (default: `FROZEN_UNDER_ZERO3` under ZeRO-3).
            Names are the HF model's; under `wrap` they gain `WRAPPER_PREFIX`.
        wrap: stages whose model is trained inside a wrapper, as OpenRLHF's `Actor` does.
    """

    stages: tuple[int, ...] = (2, 3)
    tie_embeddings: bool = False
    frozen: Mapping[int, tuple[str, ...]] | None = None
    wrap: Collection[int] = ()


CONVERTER_RUNS = DeepSpeedRuns(stages=(0, 1, 2, 3), tie_embeddings=True, frozen=CONVERTER_FROZEN, wrap=(1,))

#: Work for both ranks after the sets: a module-level function (spawn pickles it) and its arguments after the rank.
_Then = tuple[Callable[..., None], tuple[Any, ...]]
#: (folder, stages, tie_embeddings, frozen with the wrapper's prefix, wrapped stages): one set, for the ranks.
_Job = tuple[str, tuple[int, ...], bool, Mapping[int, tuple[str, ...]] | None, tuple[int, ...]]


def write_deepspeed_sets(
    sets: Mapping[Path, DeepSpeedRuns], then: Sequence[_Then] = ()
) -> dict[Path, dict[int, WrittenDeepSpeed]]:
    """Train and save with DeepSpeed each folder of `sets` (`root/zero{stage}/` per stage), all in the same 2
    spawned ranks (their imports and process group paid once), then run each `(work, args)` of `then` in
    both ranks as `work(rank, *args)`: another writer's ranks on the same DeepSpeed process group
    (`tests.writers.openrlhf_writer.train_rank`).

    Takes tens of seconds (2 spawned ranks importing DeepSpeed and transformers); use it from a session-scoped
    fixture.
    """
    jobs: list[_Job] = []
    for root, runs in sets.items():
        root.mkdir(parents=True, exist_ok=True)
        wrap = tuple(runs.wrap)
        prefixed = (
            None
            if runs.frozen is None
            else {s: tuple(WRAPPER_PREFIX + n if s in wrap else n for n in names) for s, names in runs.frozen.items()}
        )
        jobs.append((str(root), runs.stages, runs.tie_embeddings, prefixed, wrap))
    run_ranks(_worker, (_free_port(), jobs, then), WORLD_SIZE)
    return {root: _written(root, runs) for root, runs in sets.items()}


def _written(root: Path, runs: DeepSpeedRuns) -> dict[int, WrittenDeepSpeed]:
    model = _model(runs.tie_embeddings)
    parameters = sum(p.numel() for p in model.parameters())
    config_dir = root / "config"
    model.config.save_pretrained(str(config_dir))
    frozen = runs.frozen
    written = {}
    for stage in runs.stages:
        save_dir = root / f"zero{stage}"
        tags = tuple(f"global_step{step}" for step in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
        written[stage] = WrittenDeepSpeed(
            save_dir=save_dir,
            zero_stage=stage,
            tags=tags,
            reference=root / f"zero{stage}.reference.safetensors",
            model_parameters=parameters,
            frozen=(FROZEN_UNDER_ZERO3,) if frozen is None and stage == 3 else tuple((frozen or {}).get(stage, ())),
            world_size=WORLD_SIZE,
            client_state=_client_state(STEPS),
            tied=runs.tie_embeddings,
            wrapped=stage in runs.wrap,
            config_dir=config_dir,
        )
        (root / f"zero{stage}.json").write_text(json.dumps({"tags": tags}))
    return written
