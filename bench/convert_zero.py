"""convert DeepSpeed ZeRO→HF against DeepSpeed's own `zero_to_fp32.py`, measured side by side in one run.

Writes, with real DeepSpeed on 2 CPU ranks (gloo, bf16, a torch AdamW, one training step), a save folder
per ZeRO stage (default 3 and 2) of a Llama built from a local config (default: hidden 1024, 6 layers,
vocab 32000, untied embeddings: ~150M parameters, 0.57 GB of fp32 master weights; the checkpoint also
holds AdamW's two moments). Then, each in a fresh process, on a warm page cache (every source file read
once before the first measurement), per stage:

  (a)  `ckptctl convert SAVE_DIR OUT --to hf --mapping none` (fp32 masters under their stored names, as
       zero_to_fp32.py writes them; streams byte ranges of the partitions,
       fsyncs and checks its output),
  (a') the same with `--dtype bf16` (cast block by block while streaming; for information),
  (z)  `python SAVE_DIR/zero_to_fp32.py SAVE_DIR OUT --safe_serialization`, the script DeepSpeed copies
       into every save folder (it imports DeepSpeed; `torch.load(mmap=True)` of every optim file, then
       per-tensor `contiguous()` copies and `safetensors.save_file`).

Outputs of earlier runs are deleted first and `sync` runs before each measurement. Reported for each:
wall time of the whole process (interpreter start and imports included), the time of the work itself as
the process measured it (ckptctl: its JSON `seconds`; zero_to_fp32: the script's run after DeepSpeed and
torch were imported), and peak RSS from `os.wait4` (that child only; the checkpoint is written by another
process so that this one stays small; the outputs of (a) and (z) are compared tensor by tensor (names,
dtypes, values) only after every measurement, since a child's `ru_maxrss` starts from its parent's at
fork). Ratios (a)/(z).

(zero_to_fp32.py with --safe_serialization cannot write a model with tied embeddings at all: safetensors
refuses tensors that share memory. `ckptctl convert` writes the tied copy; the tests cover that case.)

Usage: python bench/convert_zero.py [--stages 3,2] [--layers 6] [--hidden 1024] [--vocab 32000]
                                    [--dir DIR] [--keep] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
WORLD_SIZE = 2


def _config(layers: int, hidden: int, vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _writer(rank: int, port: int, root: str, stages: tuple[int, ...], layers: int, hidden: int, vocab: int) -> None:
    import importlib
    import logging
    import warnings

    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_WORLD_SIZE=str(WORLD_SIZE),
    )
    warnings.filterwarnings("ignore")
    import deepspeed
    import torch
    from deepspeed.utils import logger
    from transformers import LlamaForCausalLM

    logger.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    # Plain gloo collectives; the CPU backend would JIT-compile a shared-memory allreduce first.
    setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)  # noqa: B010
    deepspeed.init_distributed(dist_backend="gloo")
    config = _config(layers, hidden, vocab)
    for stage in stages:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": True},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10_000,
        }
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engine.save_checkpoint(os.path.join(root, f"zero{stage}"))
        deepspeed.comm.barrier()
        del engine, model, optimizer


def build_checkpoints(root: Path, stages: tuple[int, ...], layers: int, hidden: int, vocab: int) -> None:
    """Write the save folders from a separate process (`ru_maxrss` survives exec: the measuring parent stays small)."""
    subprocess.run(
        [
            sys.executable,
            __file__,
            "--generate",
            str(root),
            "--stages",
            ",".join(map(str, stages)),
            "--layers",
            str(layers),
            "--hidden",
            str(hidden),
            "--vocab",
            str(vocab),
        ],
        check=True,
        cwd=REPO,
    )


def add_checkpoint_options(parser: argparse.ArgumentParser, stages: str, hidden: int) -> None:
    """The options of the save folders `build_checkpoints` writes and of the work folder (`--stages`,
    `--layers`, `--hidden`, `--vocab`, `--dir`, `--keep`, `--reuse`), with this bench's defaults."""
    parser.add_argument("--stages", default=stages, help=f"ZeRO stages to write and convert (default {stages})")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers (default 6)")
    parser.add_argument("--hidden", type=int, default=hidden, help=f"hidden size (default {hidden})")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    parser.add_argument("--dir", type=Path, default=None, help="work folder (default: a temp dir beside the repo)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and outputs")
    parser.add_argument("--reuse", action="store_true", help="reuse checkpoints a --keep run left in --dir")


def ensure_checkpoints(root: Path, stages: tuple[int, ...], args: argparse.Namespace) -> None:
    """The save folder `zero{stage}` of each stage in `root`: written anew, unless `--reuse` finds them all."""
    if args.reuse and all((root / f"zero{s}" / "latest").exists() for s in stages):
        return
    for s in stages:
        shutil.rmtree(root / f"zero{s}", ignore_errors=True)
    build_checkpoints(root, stages, args.layers, args.hidden, args.vocab)


def warm_tag(save_dir: Path) -> tuple[Path, list[Path], int]:
    """The tag `latest` names in `save_dir`, its files and their bytes, each file read once so that every
    measurement starts on a warm page cache."""
    tag = save_dir / (save_dir / "latest").read_text().strip()
    files = sorted(tag.iterdir())
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return tag, files, sum(f.stat().st_size for f in files)


def _generate(root: Path, stages: tuple[int, ...], layers: int, hidden: int, vocab: int) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_writer, args=(port, str(root), stages, layers, hidden, vocab), nprocs=WORLD_SIZE)


#: zero_to_fp32.py run as `__main__` after DeepSpeed and torch were imported (so that "work" is the
#: conversion); its own progress output goes to stderr, the timing to stdout.
ZERO_TO_FP32 = """
import contextlib, json, runpy, sys, time, warnings
warnings.simplefilter("ignore")
import deepspeed, torch, safetensors.torch
script, save_dir, out = sys.argv[1:4]
sys.argv = [script, save_dir, out, "--safe_serialization"]
start = time.perf_counter()
with contextlib.redirect_stdout(sys.stderr):
    runpy.run_path(script, run_name="__main__")
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


@dataclass(frozen=True)
class Measured:
    label: str
    wall: float
    work: float
    peak_rss: int
    cpu: float = 0.0  # user + system seconds of that child: what a loaded machine's wall times hide


def measure(label: str, argv: list[str]) -> Measured:
    """Run `argv` in a fresh process; wall time, the work time it prints (JSON), and its own peak RSS (shared
    by the convert and reshard benches; DeepSpeed, where a child imports it, on its CPU accelerator)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)  # that child's own rusage, unlike RUSAGE_CHILDREN
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        sys.stderr.write(stderr.decode()[-4000:])
        raise SystemExit(f"{label} failed with exit code {proc.returncode}")
    doc = json.loads(stdout.decode())
    return Measured(label, wall, float(doc["seconds"]), usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime)


def same_tensors(a: Path, b: Path) -> tuple[bool, int]:
    """Whether two HF folders hold the same tensors (names, dtypes, values), and how many."""
    import torch
    from safetensors import safe_open

    def files(folder: Path) -> dict[str, Path]:
        found = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                found.update(dict.fromkeys(f.keys(), path))
        return found

    fa, fb = files(a), files(b)
    if sorted(fa) != sorted(fb):
        return False, len(fa)
    for name, path in fa.items():
        with safe_open(str(path), "pt") as x, safe_open(str(fb[name]), "pt") as y:
            ta, tb = x.get_tensor(name), y.get_tensor(name)
            if ta.dtype != tb.dtype or not torch.equal(ta, tb):
                return False, len(fa)
    return True, len(fa)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_options(parser, stages="3,2", hidden=1024)
    parser.add_argument("--generate", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    stages = tuple(int(s) for s in args.stages.split(","))
    if args.generate is not None:
        _generate(args.generate, stages, args.layers, args.hidden, args.vocab)
        return 0

    root = args.dir or Path(tempfile.mkdtemp(prefix="ckptctl-bench-zero-", dir=REPO.parent))
    root.mkdir(parents=True, exist_ok=True)
    ok = True
    try:
        started = time.perf_counter()
        ensure_checkpoints(root, stages, args)
        print(f"checkpoints written by DeepSpeed (2 CPU ranks, bf16) in {time.perf_counter() - started:.0f} s")
        python = sys.executable
        summary = []
        for stage in stages:
            save_dir = root / f"zero{stage}"
            tag, files, total = warm_tag(save_dir)
            runs = {
                "a": (
                    "ckptctl convert --to hf",
                    # Raw names, no model check: the same work as zero_to_fp32.py, which writes no config either.
                    lambda out, d=save_dir: [
                        *(python, "-m", "ckptctl", "convert", str(d), str(out)),
                        *("--mapping", "none", "--json", "-q"),
                    ],
                ),
                "a'": (
                    "ckptctl convert --to hf --dtype bf16",
                    lambda out, d=save_dir: [
                        *(python, "-m", "ckptctl", "convert", str(d), str(out)),
                        *("--mapping", "none", "--json", "-q", "--dtype", "bf16"),
                    ],
                ),
                "z": (
                    "zero_to_fp32.py --safe_serialization",
                    lambda out, d=save_dir: [python, "-c", ZERO_TO_FP32, str(d / "zero_to_fp32.py"), str(d), str(out)],
                ),
            }
            results: dict[str, Measured] = {}
            for key, (label, argv) in runs.items():
                out = root / f"out-zero{stage}-{key.replace(chr(39), 'bf16')}"
                shutil.rmtree(out, ignore_errors=True)
                os.sync()  # no run waits behind another's dirty pages
                results[key] = measure(label, argv(out))
            model_bytes = sum(p.stat().st_size for p in (root / f"out-zero{stage}-a").glob("*.safetensors"))
            print(
                f"\nZeRO-{stage}: {tag.name}, {total / 2**30:.2f} GiB in {len(files)} files; "
                f"output {model_bytes / 2**30:.2f} GiB of safetensors"
            )
            print(f"{'':5}{'method':40}{'wall s':>9}{'work s':>9}{'peak RSS':>12}")
            for key, m in results.items():
                print(f"({key}){' ' * (3 - len(key))}{m.label:40}{m.wall:9.2f}{m.work:9.2f}{m.peak_rss / MIB:9.0f} MiB")
            a, z = results["a"], results["z"]
            print(
                f"(a)/(z): wall {a.wall / z.wall:.2f}, work {a.work / z.work:.2f}, peak RSS {a.peak_rss / z.peak_rss:.2f}"
            )
            summary.append((stage, a, z))
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(f"\nthis process's peak RSS while measuring: {own / MIB:.0f} MiB")
        for stage, _, _ in summary:
            identical, count = same_tensors(root / f"out-zero{stage}-a", root / f"out-zero{stage}-z")
            ok = ok and identical
            print(
                f"ZeRO-{stage}: outputs of (a) and (z) identical ({count} tensors; names, dtypes, values): {identical}"
            )
        for stage, a, z in summary:
            print(
                f"ZeRO-{stage}: ckptctl {a.wall:.1f} s / {a.peak_rss / MIB:.0f} MiB vs zero_to_fp32 {z.wall:.1f} s / "
                f"{z.peak_rss / MIB:.0f} MiB: {z.wall / a.wall:.1f}x faster, {z.peak_rss / a.peak_rss:.1f}x less memory"
            )
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
