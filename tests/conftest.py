"""Fixtures shared across the suite: real Hugging Face folders, the demo runs, and a CLI runner.

Slow writers (the demo's 2-rank run) are session-scoped: written once, read by many tests. Tests that
modify a checkpoint copy it first (`copy_tree`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.writers.deepspeed_writer import WrittenDeepSpeed, write_deepspeed_runs
from tests.writers.rl_runs import WrittenFsdpRuns, write_fsdp_runs
from tests.writers.trainer_writer import WrittenTrainerRun, write_trainer_run

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_llama() -> Any:
    """A tiny Llama built from a local config (no hub access), with a fixed seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="session")
def hf_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same tiny Llama saved by transformers `save_pretrained` as one file and as 4+ shards."""
    root = tmp_path_factory.mktemp("hf")
    model = tiny_llama()
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    import torch

    torch.save(reference, root / "reference.pt")
    return {"single": root / "single", "sharded": root / "sharded", "reference": root / "reference.pt"}


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`ckptctl demo` output (single-process native run, 2-rank FSDP2 run, plain DCP, HF export)."""
    from ckptctl.ops.demo import run_demo

    root = tmp_path_factory.mktemp("demo") / "demo"
    run_demo(str(root), steps=30, distributed=True)
    return root


@pytest.fixture(scope="session")
def deepspeed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, WrittenDeepSpeed]:
    """DeepSpeed on 2 CPU ranks, bf16, ZeRO 0, 2 and 3, tags global_step2 and global_step4 (slow: spawns)."""
    return write_deepspeed_runs(tmp_path_factory.mktemp("deepspeed"), stages=(0, 2, 3))


@pytest.fixture(scope="session")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> WrittenTrainerRun:
    """transformers.Trainer on CPU: checkpoint-2 and checkpoint-4 of the tiny Llama (slow: a subprocess)."""
    return write_trainer_run(tmp_path_factory.mktemp("trainer") / "out")


@pytest.fixture(scope="session")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> WrittenFsdpRuns:
    """FSDP2 on 2 CPU ranks, saved every step as AReaL (trial with recover slots, exports, recover_info) and
    ROLL (launch folder with checkpoint-1 and checkpoint-2, the latter with critic/) save (slow: spawns)."""
    return write_fsdp_runs(tmp_path_factory.mktemp("fsdp-rl"))


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[..., CliResult]]:
    """Run `ckptctl ARGS...` in-process through `main` (the real error boundary) and capture its streams."""
    from ckptctl.cli.app import main

    def run(*args: str | os.PathLike[str]) -> CliResult:
        argv: Sequence[str] = [os.fspath(a) for a in args]
        capsys.readouterr()
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    yield run
